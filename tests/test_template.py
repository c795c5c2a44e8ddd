"""The rank template (reactor_dist.placement.template): local ranks forked from a process that has
imported what every rank imports (and torch, for the ranks of a group), each one made as
a spawned rank would be: the runner's child, in a process group of its own, with its own
environment, working directory, CPUs and random generators; a template that serves
every runner of its process and ends with it; spawning where it cannot fork, or where
``REACTOR_DIST_RANK_START=spawn`` says so."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from conftest import wait_gone
from probe import Probe, interrupt_a_fork_reply, rank_templates
from sample_workers import Echo, ProcessFacts

from reactor_dist import DistributedRunner
from reactor_dist.placement import template
from reactor_dist.placement.template import Template
from reactor_dist.wire.protocol import MARK_ENV, TEMPLATE_NAME

TESTS = os.path.dirname(os.path.abspath(__file__))


def facts(runner: DistributedRunner) -> list[dict]:
    return runner.generate(ProcessFacts())


def shown_environ(pid: int) -> dict[str, str]:
    return psutil.Process(pid).environ()


def app_lines(tmp_path, source: str) -> list[str]:
    """Run ``source`` as an application's own script; what it printed, line by line."""
    script = tmp_path / "app.py"
    script.write_text(source)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_ranks_of_a_group_are_forked_children_made_as_spawned_ones(runner_for):
    with runner_for(Echo, world_size=2, init_process_group=True,
                    env={"TEMPLATE_TEST_VALUE": "mine"}) as runner:
        ranks = facts(runner)
        pids = Probe(runner).rank_pids
        shown = [(psutil.Process(p).cmdline(), shown_environ(p)) for p in pids]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["pid"] for r in ranks] == pids
    for r in ranks:
        assert r["ppid"] == os.getpid() and r["pgid"] == r["pid"]  # the runner's child
        assert r["comm"] != TEMPLATE_NAME and r["comm"] == psutil.Process().name()
        assert r["mark"].startswith(f"{os.getpid()}-") and not r["mark"].endswith("-template")
        assert r["RANK"] == str(r["rank"]) and r["own"] == "mine"  # env= reaches the rank
        assert r["cwd"] == os.getcwd() and r["cpus"] == sorted(os.sched_getaffinity(0))
        assert r["argv"] == [] and r["torch"] is True
    assert ranks[0]["mark"] != ranks[1]["mark"]
    # Reseeded in each rank: not the template's draws, nor each other's.
    assert ranks[0]["torch_seed"] != ranks[1]["torch_seed"]
    assert ranks[0]["numpy_draw"] != ranks[1]["numpy_draw"]
    # /proc shows the template's command line and environment: the rank's program, with
    # torch imported before the fork; this process's pid in the mark; none of what is
    # read only after the fork.
    templates = [psutil.Process(p) for p in Template.pids()]
    assert all(t.name() == TEMPLATE_NAME and t.ppid() == os.getpid() for t in templates)
    for cmdline, environ in shown:
        assert cmdline in [t.cmdline() for t in templates]
        assert "reactor_dist.rank" in " ".join(cmdline) and "torch.distributed" in cmdline
        assert environ[MARK_ENV] == f"{os.getpid()}-template"
        assert "TEMPLATE_TEST_VALUE" not in environ


def test_one_template_serves_every_runner_of_the_process(runner_for):
    seen = []
    for _ in range(2):
        with runner_for(Echo, world_size=2, init_process_group=True) as runner:
            assert [r["ppid"] for r in facts(runner)] == [os.getpid()] * 2
        seen.append(Template.pids())
    assert seen[0] == seen[1] and seen[0]


def test_a_rank_without_a_group_is_forked_without_torch(runner_for):
    with runner_for(Echo, world_size=2) as runner:  # init_process_group=False
        (rank0,) = facts(runner)
    assert rank0["torch"] is False and rank0["ppid"] == os.getpid()
    assert rank0["comm"] != TEMPLATE_NAME


def test_spawn_is_chosen_with_the_environment(runner_for, monkeypatch):
    monkeypatch.setenv("REACTOR_DIST_RANK_START", "spawn")
    with runner_for(Echo, world_size=2, init_process_group=True) as runner:
        ranks = facts(runner)
        marks = [shown_environ(r["pid"]).get(MARK_ENV) for r in ranks]
    assert [r["ppid"] for r in ranks] == [os.getpid()] * 2
    assert marks == [r["mark"] for r in ranks]  # a spawned rank's own, in /proc too
    monkeypatch.setenv("REACTOR_DIST_RANK_START", "fast")
    with pytest.raises(ValueError, match="REACTOR_DIST_RANK_START must be 'fork' or 'spawn', "
                                         "got 'fast'"):
        DistributedRunner(Echo, world_size=2, device="cpu")


def test_a_template_that_cannot_start_means_spawned_ranks_and_a_warning(
        runner_for, monkeypatch, caplog):
    monkeypatch.setattr(template, "PRELOAD", ("reactor_dist_test_no_such_module",))
    with caplog.at_level(logging.WARNING, logger="reactor_dist"):
        with runner_for(Echo, world_size=2) as runner:
            (rank0,) = facts(runner)
            assert runner.generate(7) == 7
            shown = shown_environ(rank0["pid"]).get(MARK_ENV)
    assert rank0["ppid"] == os.getpid() and shown == rank0["mark"]  # spawned
    warned = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("the rank template did not fork a rank")]
    assert len(warned) == 2 and all("it exited (1)" in w and w.endswith(
        "spawning it instead") for w in warned)


APP = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from sample_workers import Echo
    from reactor_dist import DistributedRunner
    from reactor_dist.placement.template import Template
    if __name__ == "__main__":
        runner = DistributedRunner(Echo, world_size=2, device="cpu")
        runner.start()
        assert runner.generate(1) == 1
        print(" ".join(str(p) for p in Template.pids()), flush=True)
        if sys.argv[1] == "exit":
            runner.shutdown()
            sys.exit(0)
        time.sleep(60)
""")


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_the_template_ends_with_its_process(tmp_path, end):
    script = tmp_path / "app.py"
    script.write_text(APP.format(tests=TESTS))
    app = subprocess.Popen([sys.executable, str(script), end], stdout=subprocess.PIPE,
                           text=True)
    try:
        line = app.stdout.readline()
        templates = [int(p) for p in line.split()]
        assert len(templates) == 1 and psutil.Process(templates[0]).name() == TEMPLATE_NAME
        if end == "sigkill":
            app.send_signal(signal.SIGKILL)
        assert app.wait(timeout=60) == (0 if end == "exit" else -signal.SIGKILL)
        assert wait_gone(templates, timeout=10.0) == []
    finally:
        app.kill()
        app.wait()
        app.stdout.close()


FORKED_APP = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from sample_workers import Echo
    from reactor_dist import DistributedRunner
    from reactor_dist.placement.template import Template
    if __name__ == "__main__":
        with DistributedRunner(Echo, world_size=2, device="cpu") as runner:
            runner.generate(1)
        ours = Template.pids()
        child = os.fork()
        if child == 0:  # its parent's template is not its own: it starts one
            found = Template.pids()
            with DistributedRunner(Echo, world_size=2, device="cpu") as runner:
                answer = runner.generate(2)
            print(len(found), answer, len(Template.pids() - ours), flush=True)
            os._exit(0)
        _, status = os.waitpid(child, 0)
        with DistributedRunner(Echo, world_size=2, device="cpu") as runner:
            print(os.waitstatus_to_exitcode(status), runner.generate(3),
                  Template.pids() == ours, flush=True)
""")


def test_a_forked_application_starts_its_own_template_and_its_parent_keeps_its(tmp_path):
    lines = app_lines(tmp_path, FORKED_APP.format(tests=TESTS))
    assert lines == ["0 2 1", "0 3 True"]


def test_an_interrupted_fork_keeps_the_template_in_step_and_its_rank_is_reaped(
        runner_for, monkeypatch):
    """A KeyboardInterrupt between a fork's request and its reply: the next fork reads
    past that reply (its own carries its number), and the rank it named, which was never
    told anything, exits and is reaped: no zombie is left."""
    # Children of this process that an earlier test of this worker left (a subprocess.Popen
    # dropped unwaited stays a zombie until the next Popen): not this test's to judge.
    earlier = {c.pid for c in psutil.Process().children()}
    with runner_for(Echo, world_size=1) as runner:  # the template is ready
        assert runner.generate(0) == 0
    interrupt_a_fork_reply(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        runner_for(Echo, world_size=2).start()
    with runner_for(Echo, world_size=2) as runner:
        (rank0,) = facts(runner)  # the handle's pid is the rank's own, not the orphan's
        assert Probe(runner).rank_pids[0] == rank0["pid"] and rank0["ppid"] == os.getpid()
        assert runner.generate(5) == 5
    # Without torch: this test's template, and any an earlier test of this worker left
    # with another environment (kept while idle).
    light = [t for t in rank_templates() if "torch.distributed" not in t.process.args]
    deadline = time.monotonic() + 10
    while any(t.orphans for t in light) and time.monotonic() < deadline:
        with runner_for(Echo, world_size=1) as runner:  # each fork reaps what has exited
            runner.generate(1)
    assert light and {frozenset(t.orphans) for t in light} == {frozenset()}
    own = Template.pids()
    zombies = [c.pid for c in psutil.Process().children()
               if c.pid not in own | earlier and c.status() == psutil.STATUS_ZOMBIE]
    assert zombies == []


def test_orphans_adopted_while_a_rank_is_forked_are_reaped_and_the_apps_children_untouched(
        runner_for):
    """While a rank is forked this process is a child subreaper, so an orphan of the
    application's own processes (a shell's background job, whose shell exits) may be
    handed to it: each is waited for, not left a zombie; and no child of the
    application's own is ever waited for here (each shell's exit status reaches it)."""
    with runner_for(Echo, world_size=1) as runner:  # the template is ready
        runner.generate(0)
    statuses: list[int | None] = []
    stop = threading.Event()

    def orphan_maker() -> None:
        while not stop.is_set():
            statuses.append(subprocess.Popen(["sh", "-c", "sleep 0.2 & exit 3"]).wait())

    maker = threading.Thread(target=orphan_maker)
    maker.start()
    try:
        for _ in range(3):
            with runner_for(Echo, world_size=2) as runner:
                assert runner.generate(1) == 1
    finally:
        stop.set()
        maker.join()
    assert len(statuses) > 10 and set(statuses) == {3}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        sleeps = [c for c in psutil.Process().children() if c.name() == "sleep"]
        if not sleeps:
            break
        time.sleep(0.1)
    assert [(c.pid, c.status()) for c in sleeps] == []


SUBREAPER_APP = textwrap.dedent("""
    import ctypes, os, sys
    sys.path.insert(0, {tests!r})
    from sample_workers import Echo, ProcessFacts
    from reactor_dist import DistributedRunner
    libc = ctypes.CDLL(None, use_errno=True)

    def subreaper():
        value = ctypes.c_int(0)
        libc.prctl(37, ctypes.byref(value), 0, 0, 0)
        return value.value

    if __name__ == "__main__":
        assert libc.prctl(36, 1, 0, 0, 0) == 0
        with DistributedRunner(Echo, world_size=1, device="cpu") as runner:
            (facts,) = runner.generate(ProcessFacts())
        print(subreaper(), facts["ppid"] == os.getpid())
""")


def test_an_application_that_is_a_subreaper_stays_one(tmp_path):
    lines = app_lines(tmp_path, SUBREAPER_APP.format(tests=TESTS))
    assert lines == ["1 True"]


IDLE_APP = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from sample_workers import Echo
    import reactor_dist
    from reactor_dist import DistributedRunner
    from reactor_dist.placement.template import Template

    def run(value, wait=0.0):
        with DistributedRunner(Echo, world_size=2, device="cpu") as runner:
            time.sleep(wait)
            assert runner.generate(value) == value
        return sorted(Template.pids())

    if __name__ == "__main__":
        reactor_dist.set_rank_template_idle({idle})
        first = run(1)
        print(*first, flush=True)
        time.sleep({idle} / 4)
        print(run(2) == first, run(3, wait={idle} * 1.5) == first, flush=True)
        time.sleep({idle} * 2.5)  # idle for longer than {idle} s: gone
        print(sorted(Template.pids()), flush=True)
        again = run(4)
        reactor_dist.close_rank_templates()
        print(len(again) == 1 and again != first, sorted(Template.pids()), *again, flush=True)
""")


def test_the_template_ends_once_no_runner_used_it_for_a_while(tmp_path):
    lines = app_lines(tmp_path, IDLE_APP.format(tests=TESTS, idle=1.0))
    first, reused, idle, closed = lines
    # Within the idle time, and while a runner is started, the same template serves.
    assert reused == "True True"
    assert idle == "[]"  # ended after 1 s without a runner
    assert closed.startswith("True [] ")  # a new one, ended at once by close_rank_templates
    pids = [int(p) for p in first.split()] + [int(p) for p in closed.split()[2:]]
    assert len(pids) == 2 and wait_gone(pids, timeout=5.0) == []


def test_with_no_idle_time_the_template_ends_with_the_last_runner(tmp_path):
    lines = app_lines(tmp_path, textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        from sample_workers import Echo
        import reactor_dist
        from reactor_dist import DistributedRunner
        from reactor_dist.placement.template import Template
        if __name__ == "__main__":
            reactor_dist.set_rank_template_idle(0)
            with DistributedRunner(Echo, world_size=1, device="cpu") as runner:
                runner.generate(1)
                print(*Template.pids(), flush=True)
            print(sorted(Template.pids()), flush=True)
    """))
    during, after = lines
    assert len(during.split()) == 1 and after == "[]"
    assert wait_gone([int(during)], timeout=5.0) == []


@pytest.mark.parametrize("bad", [-1, "10", None, float("nan"), True])
def test_the_idle_time_is_seconds_at_least_zero(bad):
    with pytest.raises(ValueError) as err:
        template.set_rank_template_idle(bad)
    assert str(err.value) == (
        f"seconds must be a number >= 0 (how long the rank templates stay after the last "
        f"runner shut down; 0: they end with it), got {bad!r}")
