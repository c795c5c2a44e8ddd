"""The application process dies (SIGKILL: no atexit, no finalizer).

The ranks exit when the runner process dies, whatever killed it, and no /dev/shm
entry outlives the runner, also after a crash or kill.  The
ranks watch the runner's pid (a pidfd): on its death each one removes the runner's
/dev/shm entries and ipc directory and kills every process it started.  Should the
ranks die with it (the whole tree SIGKILLed), the next runner started on the machine
removes entries whose owner is dead, and never those of a live runner.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest
from conftest import wait_gone
from probe import Probe, marked_by
from sample_workers import Echo

from reactor_dist import DistributedRunner
from reactor_dist.shm import segments
from reactor_dist.wire.protocol import TEMPLATE_NAME

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

APP = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {tests!r})
    import numpy as np
    from sample_workers import Echo, FullArray, HangsInLoadOnRank, Sleep, SpawnChild
    from probe import Probe, marked_by
    from reactor_dist import DistributedRunner

    mode, log_dir = sys.argv[1], sys.argv[2]
    if mode == "loading":
        worker, load_kwargs = HangsInLoadOnRank, {{"rank": 1}}
    else:
        worker, load_kwargs = Echo, {{"log_dir": log_dir}}
    runner = DistributedRunner(worker, world_size=2, init_process_group=False,
                               device="cpu", call_timeout=600, load_kwargs=load_kwargs)
    probe = Probe(runner)
    print(json.dumps({{"prefix": probe.shm_prefix}}), flush=True)
    runner.start()
    children = [runner.generate(SpawnChild()), runner.generate(SpawnChild(detached=True))]
    held = runner.generate(FullArray([8 << 20]))  # a result segment, held
    print(json.dumps({{"ipc": probe.ipc_dir, "ranks": probe.rank_pids,
                       "children": children}}), flush=True)
    if mode == "idle":
        print("idle", flush=True)
        sys.stdin.read()  # until the test closes our stdin
    else:
        print("calling", flush=True)
        runner.generate(Sleep(600, value=np.ones(8 << 20, np.uint8)))
""")


def our_entries(prefix: str) -> list[str]:
    return [n for n in os.listdir(segments.DEFAULT_DIR) if n.startswith(prefix + ".")]


class App:
    """A runner in a subprocess: the application we are about to kill."""

    def __init__(self, tmp_path, mode: str) -> None:
        script = tmp_path / "app.py"
        script.write_text(APP.format(tests=TESTS))
        self.log_dir = tmp_path / f"logs-{os.urandom(4).hex()}"
        self.log_dir.mkdir()
        self.proc = subprocess.Popen(
            [sys.executable, str(script), mode, str(self.log_dir)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path,
            env=dict(os.environ, PYTHONPATH=REPO))
        self.info = json.loads(self.proc.stdout.readline())
        self.ipc = None

    def read_running(self) -> None:
        self.info.update(json.loads(self.proc.stdout.readline()))
        self.ipc = self.info["ipc"]
        assert self.proc.stdout.readline().strip() in ("idle", "calling")

    def wait_for_log(self, rank: int, text: str, timeout: float = 30.0) -> None:
        path = self.log_dir / f"rank{rank}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and text in path.read_text():
                return
            time.sleep(0.01)
        raise AssertionError(f"rank {rank} never logged {text!r}")

    def tree(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def kill(self) -> float:
        self.proc.kill()
        self.proc.wait()
        return time.monotonic()

    def cleanup(self) -> None:
        """Whatever a failed test left: never leave a process or file of the app behind."""
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.wait(5)
        for name in our_entries(self.info["prefix"]):
            segments.unlink_quietly(os.path.join(segments.DEFAULT_DIR, name))
        if self.ipc:
            shutil.rmtree(self.ipc, ignore_errors=True)


@pytest.fixture
def apps(tmp_path):
    started: list[App] = []

    def start(mode: str) -> App:
        app = App(tmp_path, mode)
        started.append(app)
        return app

    yield start
    for app in started:
        for p in app_processes(app) + marked_by(app.proc.pid):
            with contextlib.suppress(psutil.Error):
                p.kill()
        app.cleanup()


def app_processes(app: App) -> list[psutil.Process]:
    pids = app.info.get("ranks", []) + app.info.get("children", [])
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    return procs


def assert_all_gone_within(pids, since: float, bound: float = 2.0) -> None:
    alive = wait_gone(pids, timeout=bound)
    assert alive == [], f"still alive {time.monotonic() - since:.2f} s after the runner died"
    # wall-clock: the runner-death promise (every rank and child gone within 2 s): 21-23 ms
    # on an idle machine, 2 s is 90x that; a rank that missed the death would live on
    assert time.monotonic() - since < bound


def assert_reclaimed(app: App, since: float, bound: float = 2.0) -> None:
    deadline = since + bound
    while time.monotonic() < deadline:
        if not our_entries(app.info["prefix"]) and not os.path.exists(app.ipc):
            return
        time.sleep(0.01)
    assert our_entries(app.info["prefix"]) == [], "the dead runner's /dev/shm entries remain"
    assert not os.path.exists(app.ipc), "the dead runner's ipc directory remains"


@pytest.mark.parametrize("mode", ["idle", "calling"])
def test_sigkill_of_the_application_ends_every_rank_and_child_and_frees_shm(apps, mode):
    app = apps(mode)
    app.read_running()
    if mode == "calling":
        for rank in (0, 1):
            app.wait_for_log(rank, "Sleep")  # the call is in flight on every rank
    tree = app.tree()
    pids = [p.pid for p in tree]
    assert set(app.info["ranks"]) <= set(pids)
    assert len(pids) >= 2 + 4, "2 ranks, each with a child and a detached child"
    detached = app.info["children"][1]
    assert os.getsid(detached) != os.getsid(app.info["ranks"][0])  # left the rank's session
    assert our_entries(app.info["prefix"]), "the runner should hold /dev/shm segments"
    died = app.kill()
    assert_all_gone_within(pids, died)
    assert_reclaimed(app, died)


def test_sigkill_of_the_application_during_start(apps):
    """Killed while a rank is still in load(): the ranks follow all the same."""
    app = apps("loading")
    deadline = time.monotonic() + 30
    ranks: list[psutil.Process] = []
    while time.monotonic() < deadline and len(ranks) < 2:
        ranks = [p for p in app.tree() if is_rank(p, app.proc.pid)]
        time.sleep(0.05)
    assert len(ranks) == 2
    time.sleep(0.5)  # let them get into load()
    pids = [p.pid for p in app.tree()]
    died = app.kill()
    assert_all_gone_within(pids, died)
    assert our_entries(app.info["prefix"]) == []


def is_rank(p: psutil.Process, app_pid: int) -> bool:
    """A rank of the app: its child that runs reactor_dist.rank, spawned or forked, and not
    the rank template those are forked from (nor the template's fork on its way)."""
    try:
        return (p.ppid() == app_pid and p.name() != TEMPLATE_NAME
                and "reactor_dist.rank" in " ".join(p.cmdline()))
    except psutil.Error:
        return False


def fake_entry(pid: int, started: str, what: str = "in1") -> str:
    name = f"rdist.{pid}.{started}.{os.urandom(4).hex()}.{what}"
    fd = os.open(os.path.join(segments.DEFAULT_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR,
                 0o600)
    os.close(fd)
    return name


def start_tag(pid: int) -> str:
    return f"{int(psutil.Process(pid).create_time() * 100):x}"


def test_reclaim_dead_owners_removes_only_entries_of_dead_owners(apps):
    gone = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    gone_tag = start_tag(gone.pid)
    gone.communicate()
    live_app = apps("idle")  # another live runner on the machine, in another process
    live_app.read_running()
    live_before = set(our_entries(live_app.info["prefix"]))
    assert live_before
    made: list[str] = []
    try:
        dead = fake_entry(gone.pid, gone_tag)
        reused = fake_entry(os.getpid(), "1")     # our pid, but another (dead) process's
        alive = fake_entry(os.getpid(), start_tag(os.getpid()))  # ours, alive
        init = fake_entry(1, start_tag(1))        # a live process not ours
        foreign = ["rdist.notapid.1.2.in1", "rdist.5", "other-app-segment"]
        for name in foreign:
            with open(os.path.join(segments.DEFAULT_DIR, name), "w"):
                pass
        made = [dead, reused, alive, init, *foreign]
        with DistributedRunner(Echo, world_size=1, init_process_group=False,
                               device="cpu") as runner:  # start() reclaims
            ours = Probe(runner).shm_prefix
            runner.generate(np.ones(1 << 20, np.uint8))
            assert our_entries(ours)
            segments.reclaim_dead_owners(segments.DEFAULT_DIR)  # and again, with our runner live
            assert our_entries(ours), "a live runner's entries were removed"
        present = set(os.listdir(segments.DEFAULT_DIR))
        assert dead not in present and reused not in present
        assert {alive, init, *foreign} <= present
        assert set(our_entries(live_app.info["prefix"])) == live_before
    finally:
        for name in made:
            segments.unlink_quietly(os.path.join(segments.DEFAULT_DIR, name))
    live_app.proc.stdin.close()  # the live app ends normally: its runner cleans up
    assert live_app.proc.wait(30) == 0
    assert our_entries(live_app.info["prefix"]) == []


def test_entries_of_a_tree_killed_at_once_go_at_the_next_start(apps):
    """Ranks SIGKILLed with their runner (an OOM kill of the cgroup, say) cannot clean
    up: the next runner's start() removes the dead runner's entries and ipc directory,
    not a live one's."""
    victim, bystander = apps("idle"), apps("idle")
    victim.read_running()
    bystander.read_running()
    left = our_entries(victim.info["prefix"])
    assert left and our_entries(bystander.info["prefix"])
    os.kill(victim.proc.pid, signal.SIGSTOP)  # so it cannot react to its ranks' deaths
    tree = marked_by(victim.proc.pid)  # every rank's children too, the detached ones as well
    assert len(tree) >= 2 + 4, "2 ranks, each with a child and a detached child"
    for p in tree:
        p.kill()
    assert wait_gone([p.pid for p in tree], timeout=2.0) == []
    victim.kill()
    assert our_entries(victim.info["prefix"]) == left  # nobody was left to remove them
    assert os.path.isdir(victim.ipc)
    with DistributedRunner(Echo, world_size=1, init_process_group=False,
                           device="cpu") as runner:
        assert runner.generate(1) == 1
        assert os.path.isdir(bystander.ipc), "a live runner's ipc directory was removed"
    assert our_entries(victim.info["prefix"]) == []
    assert not os.path.exists(victim.ipc), "the dead runner's ipc directory remains"
    assert our_entries(bystander.info["prefix"]), "a live runner's entries were removed"
    bystander.proc.stdin.close()
    assert bystander.proc.wait(30) == 0
    assert our_entries(bystander.info["prefix"]) == []


def test_the_next_start_removes_a_killed_applications_entries_lock_included(apps):
    """An application SIGKILLed while it holds a result, and a runner started at once
    (its owner may still be exiting, its ranks still removing its entries): when the
    new runner's start() returns nothing of the dead one is left in /dev/shm, its
    owner lock included, nor after a call and shutdown() (issue 43, item 8: its lock
    was left in 1 of 3 runs).  Three times over."""
    for _ in range(3):
        app = apps("idle")
        app.read_running()
        prefix = app.info["prefix"]
        assert f"{prefix}.lock" in our_entries(prefix) and len(our_entries(prefix)) > 1
        app.proc.kill()  # not waited for: it may be exiting still, or a zombie
        with DistributedRunner(Echo, world_size=1, init_process_group=False,
                               device="cpu") as runner:
            assert our_entries(prefix) == []
            assert runner.generate(1) == 1
        assert our_entries(prefix) == []
        app.proc.wait()
        assert wait_gone(app.info["ranks"], timeout=5.0) == []
        assert our_entries(prefix) == []


def test_the_next_start_removes_a_dead_runners_entries_whose_lock_went_first(apps):
    """The dead application a zombie (not yet reaped), its ranks stopped after removing
    its lock and before its segments: start() removes the segments (a lock gone means
    its runner is ending; a zombie owner is dead), not the live bystander's."""
    victim, bystander = apps("idle"), apps("idle")
    victim.read_running()
    bystander.read_running()
    prefix = victim.info["prefix"]
    ranks = [psutil.Process(pid) for pid in victim.info["ranks"]]
    for rank in ranks:
        rank.suspend()  # as if descheduled amid their cleanup
    victim.proc.kill()
    deadline = time.monotonic() + 10
    while psutil.Process(victim.proc.pid).status() != psutil.STATUS_ZOMBIE:
        # wall-clock: a SIGKILLed process is a zombie within milliseconds; 10 s is only
        # the way out of the loop, over 100x that on an idle machine
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.unlink(os.path.join(segments.DEFAULT_DIR, f"{prefix}.lock"))
    left = our_entries(prefix)
    assert left and f"{prefix}.lock" not in left
    with DistributedRunner(Echo, world_size=1, init_process_group=False,
                           device="cpu") as runner:
        assert our_entries(prefix) == []
        assert runner.generate(1) == 1
        assert f"{bystander.info['prefix']}.lock" in our_entries(bystander.info["prefix"])
    for rank in ranks:
        rank.kill()
    assert wait_gone([r.pid for r in ranks]) == []
    victim.proc.wait()
    assert our_entries(prefix) == []
    bystander.proc.stdin.close()
    assert bystander.proc.wait(30) == 0
    assert our_entries(bystander.info["prefix"]) == []


def test_an_owner_is_judged_by_its_lock_and_by_its_process_past_death(tmp_path):
    """shm's verdicts: a lock held, free or gone; an owner alive, a zombie (dead, its pid
    not yet reaped) or another process's pid (not ours to judge); an owner-lock draft a
    minute old and free goes, a fresh one stays."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    tag = start_tag(child.pid)
    lock = segments.hold_owner_lock(str(tmp_path), "rdist.1.2.ab")
    path = str(tmp_path / "rdist.1.2.ab.lock")
    try:
        assert segments.lock_state(path) == "held"
        assert segments.lock_state(str(tmp_path / "none.lock")) == "gone"
        assert segments.owner_dying(child.pid, tag) is False
        assert segments.owner_alive(child.pid, tag) is True
        child.kill()
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            # wall-clock: a SIGKILLed process is a zombie within milliseconds; 10 s is only
            # the way out of the loop, over 100x that on an idle machine
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert segments.owner_dying(child.pid, tag) is True
        assert segments.owner_alive(child.pid, tag) is False
        assert segments.owner_dying(child.pid, "1") is False  # the pid, not that process
    finally:
        os.close(lock)
        child.wait()
    assert segments.lock_state(path) == "free"
    old, fresh = tmp_path / ".lock-0011", tmp_path / ".lock-0022"
    for draft in (old, fresh):
        draft.touch()
    os.utime(old, (time.time() - 120, time.time() - 120))
    assert segments.reclaim_dead_owners(str(tmp_path)) == 2  # the old draft, the free lock
    assert sorted(os.listdir(tmp_path)) == [".lock-0022"]
