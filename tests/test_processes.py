"""The rank processes: their environment, launch prefix, output, the order of requests,
calls from many threads, their children and their private directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading

import numpy as np
import psutil
from conftest import wait_gone
from probe import Probe
from sample_workers import AllGather, AtExit, Echo, ReportEnvironment, SpawnChild

from reactor_dist import DistributedRunner

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fast_runner(world_size: int = 2, **kw) -> DistributedRunner:
    kw.setdefault("init_process_group", False)
    kw.setdefault("device", "cpu")
    return DistributedRunner(Echo, world_size=world_size, **kw)


def test_torchrun_environment_in_ranks_only(tmp_path):
    before = {k: os.environ.get(k) for k in TORCHRUN_VARS}
    with fast_runner(2, env={"EXTRA": "yes"}, gpus=[3, 5]) as runner:
        seen = runner.generate(ReportEnvironment())
        assert seen["device"] == "cpu"
        env = seen["env"]
        assert env["RANK"] == "0" and env["LOCAL_RANK"] == "0"
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
        assert env["EXTRA"] == "yes"
    assert {k: os.environ.get(k) for k in TORCHRUN_VARS} == before
    assert "EXTRA" not in os.environ


def test_launch_prefix_keeps_the_rank_pid_watched(log_dir):
    prefix = ["env", "PREFIXED={rank}"]
    with fast_runner(2, load_kwargs={"log_dir": log_dir}, launch_prefix=prefix) as runner:
        runner.generate("x")
        pids, launchers = Probe(runner).rank_pids, Probe(runner).launcher_pids
    # env(1) execs the launcher, so the wrapped rank keeps its pid
    assert pids == launchers


def test_launch_prefix_wraps_each_rank_with_rank_substituted():
    with fast_runner(2, launch_prefix=["env", "PREFIXED=numa-{rank}"]) as runner:
        assert runner.generate(ReportEnvironment())["env"]["PREFIXED"] == "numa-0"


def test_all_gather_over_gloo_returns_the_gathered_result_from_rank0():
    with DistributedRunner(Echo, world_size=2, device="cpu") as runner:
        out = runner.generate(AllGather())
        np.testing.assert_array_equal(out, [1.0, 1.0, 2.0, 2.0])
        env = runner.generate(ReportEnvironment())["env"]
        assert int(env["MASTER_PORT"]) > 0  # rank 0's rendezvous port, reported, not guessed


def test_requests_reach_every_rank_in_the_same_order(log_dir):
    with fast_runner(3, load_kwargs={"log_dir": log_dir}) as runner:
        for i in range(40):
            if i % 7 == 0:
                runner.reset()
            else:
                assert runner.generate(i) == i
    logs = []
    for rank in range(3):
        with open(os.path.join(log_dir, f"rank{rank}.log")) as f:
            logs.append(f.read())
    assert logs[0] == logs[1] == logs[2]
    assert logs[0].count("reset") == 6 and logs[0].count("echo") == 34


def test_calls_from_many_threads_are_serialized(log_dir):
    errors, results = [], {}
    with fast_runner(2, load_kwargs={"log_dir": log_dir}) as runner:
        def hammer(thread: int) -> None:
            try:
                for i in range(25):
                    value = (thread, i)
                    results[value] = runner.generate(value)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=hammer, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert runner.healthy
    assert errors == []
    assert all(k == v for k, v in results.items()) and len(results) == 100
    logs = [open(os.path.join(log_dir, f"rank{r}.log")).read() for r in (0, 1)]
    assert logs[0] == logs[1]


def test_a_child_process_of_a_worker_ends_with_the_rank():
    with fast_runner(2) as runner:
        child = runner.generate(SpawnChild())
        assert psutil.pid_exists(child)
    assert wait_gone([child]) == []


def test_private_directory_is_0700_and_removed():
    runner = fast_runner(1)
    runner.start()
    ipc_dir = Probe(runner).ipc_dir
    assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
    assert sorted(os.listdir(ipc_dir)) == ["cmd", "lock", "reply"]
    pids = Probe(runner).rank_pids
    runner.shutdown()
    assert not os.path.exists(ipc_dir)
    assert wait_gone(pids) == []


def run_script(tmp_path, code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=REPO))


MAIN_SCRIPT = textwrap.dedent("""
    import dataclasses
    from reactor_dist import DistributedRunner, DistributedWorker

    @dataclasses.dataclass
    class Answer:
        rank: int
        text: str

    class MainWorker(DistributedWorker):
        def load(self, greeting):
            self.greeting = greeting
            print("loaded", greeting)

        def generate(self, name):
            return Answer(self.rank, f"{self.greeting}, {name}")

    if __name__ == "__main__":
        with DistributedRunner(MainWorker, world_size=2, load_kwargs={"greeting": "hello"},
                               init_process_group=False, device="cpu") as runner:
            answer = runner.generate("world")
            print("RESULT", type(answer).__name__, answer.rank, answer.text)
""")


def test_worker_class_in_a_main_script(tmp_path):
    (tmp_path / "app.py").write_text(MAIN_SCRIPT)
    out = run_script(tmp_path, MAIN_SCRIPT, "app.py")
    assert out.returncode == 0, out.stderr
    assert "RESULT Answer 0 hello, world" in out.stdout
    # rank output reaches the application's stderr, prefixed
    assert "[rank 0] loaded hello" in out.stderr and "[rank 1] loaded hello" in out.stderr


def test_worker_class_in_a_main_module_run_with_dash_m(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "app.py").write_text(MAIN_SCRIPT)
    out = run_script(tmp_path, MAIN_SCRIPT, "-m", "mypkg.app")
    assert out.returncode == 0, out.stderr
    assert "RESULT Answer 0 hello, world" in out.stdout


def test_torchrun_style_model_forms_its_own_group_from_the_environment():
    from sample_workers import TorchrunStyleWorker

    with DistributedRunner(TorchrunStyleWorker, world_size=2, init_process_group=False,
                           device="cpu", start_timeout=60) as runner:
        assert runner.generate(1.0) == 3.0


def test_a_command_cut_short_by_ctrl_c_cannot_swallow_the_next():
    """A KeyboardInterrupt between the frames of a published command leaves a half
    message on the PUB socket; the next publish ends it first (the ranks reject it)."""

    with fast_runner(2, call_timeout=5) as runner:
        assert runner.generate("before") == "before"
        Probe(runner).cut_a_command_short()
        assert runner.generate("after") == "after"
        assert runner.healthy


def test_a_rank_that_leaves_runs_its_atexit_handlers_and_flushes_its_output(tmp_path):
    """A rank ends with os._exit (server.leave), past the interpreter's teardown: its atexit
    handlers still run, its unflushed output still reaches the runner, its code is 0."""
    path = tmp_path / "atexit.txt"
    runner = fast_runner(world_size=2, init_process_group=True)
    with runner:
        runner.generate(AtExit(str(path)))
        procs = Probe(runner).rank_processes
        outputs = [p.output for p in procs]
    assert sorted(path.read_text().splitlines()) == [
        "rank 0 ran its atexit handler", "rank 1 ran its atexit handler"]
    assert [p.popen.returncode for p in procs] == [0, 0]
    assert [[line for line in o.last_lines(200) if "unflushed" in line] for o in outputs] == [
        ["rank 0 unflushed"], ["rank 1 unflushed"]]
