"""placement="external": ranks that another launcher starts (here: this test, by hand,
``python -m reactor_dist.rank --join ... --rank N``) join the runner over real TCP on
127.0.0.1 (CurveZMQ), are refused when they should be, and end when the runner does.
torchrun itself: test_join_torchrun.py."""

from __future__ import annotations

import glob
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
from conftest import wait_gone
from join_workers import Frames
from probe import Probe
from restart_workers import HangIn, Pid

import reactor_dist
from reactor_dist import (
    DistributedRunner,
    External,
    PlacementFailed,
    WorkerCrashed,
    WorkerTimeout,
)
from reactor_dist.wire.protocol import JOIN_SECRET_ENV

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
WORKER = "join_workers:Frames"


def joiner_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, REPO])}


class Joiners:
    """The joiners this test starts (as a launcher would), their output in files."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path, self.procs, self.logs = tmp_path, {}, {}

    def start(self, runner: DistributedRunner, rank: int | None, *extra: str,
              command: str | None = None, env: dict[str, str] | None = None,
              name: str | None = None, program: tuple[str, ...] = (),
              wrap: tuple[str, ...] = ()) -> subprocess.Popen:
        """A joiner of ``rank`` (None: the launcher's environment says), as
        ``python -m reactor_dist.rank JOIN-COMMAND'S-ARGS`` (or ``program``), behind
        ``wrap``."""
        name = name or f"rank{rank}-{len(self.procs)}"
        out = open(self.tmp_path / f"{name}.log", "w+b")  # noqa: SIM115
        args = (command or runner.join_command).split()[1:]
        which = [] if rank is None else ["--rank", str(rank), "--world-size",
                                         str(runner.world_size)]
        proc = subprocess.Popen(
            [*wrap, sys.executable, *(program or ("-m", "reactor_dist.rank")), *args, *which,
             *extra], env=env or joiner_env(), stdout=out, stderr=subprocess.STDOUT)
        self.procs[name], self.logs[name] = proc, out
        return proc

    def output(self, name: str) -> str:
        log = self.logs[name]
        log.flush()
        log.seek(0)
        return log.read().decode(errors="replace")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        for log in self.logs.values():
            log.close()


@pytest.fixture
def joiners(tmp_path):
    made = Joiners(tmp_path)
    yield made
    made.close()


def started(runner: DistributedRunner, joiners: Joiners, ranks=None,
            join=None) -> None:
    """start() in a thread; once the join command is known, each of ``ranks``' joiners
    (default: every rank's), or ``join(runner)`` starts them."""
    failed: list[BaseException] = []

    def start() -> None:
        try:
            runner.start()
        except BaseException as exc:  # re-raised below
            failed.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    while not runner.join_command and thread.is_alive():
        time.sleep(0.02)
    if join is not None:
        join(runner)
    else:
        for rank in range(runner.world_size) if ranks is None else ranks:
            joiners.start(runner, rank, name=f"rank{rank}")
    thread.join(120)
    if failed:
        raise failed[0]


def external_runner(world_size: int = 2, **options) -> DistributedRunner:
    options.setdefault("device", "cpu")
    options.setdefault("start_timeout", 90.0)
    options.setdefault("call_timeout", 30.0)
    options.setdefault("shutdown_grace", 2.0)
    return DistributedRunner(Frames, world_size=world_size, placement="external", **options)


def crash_of(runner: DistributedRunner) -> WorkerCrashed:
    """The WorkerCrashed of the calls after a death (noticed within a beat or two)."""
    with pytest.raises(WorkerCrashed) as failed:
        for _ in range(200):
            runner.generate(1.0)
            time.sleep(0.02)
    return failed.value


def rank_pids(runner: DistributedRunner) -> list[int]:
    return [pid for pid, _, _ in runner.generate(Pid())]


def test_joined_ranks_serve_a_frame_and_end_with_the_runner(joiners):
    runner = external_runner()
    started(runner, joiners)
    command = runner.join_command
    secret_file = command.split("--secret-file ")[1]
    assert command.startswith("reactor-dist-rank --join tcp://127.0.0.1:")
    assert f"--worker {WORKER} " in command
    assert oct(os.stat(secret_file).st_mode & 0o777) == "0o600"
    frame = np.arange(4 * 1024 * 1024, dtype=np.uint8).reshape(1024, 4096)
    out = runner.generate(frame)
    np.testing.assert_array_equal(out["frame"], frame[::-1] * 2)
    assert out["sum"] == 2 * float(frame.sum(dtype=np.float64))
    assert Probe(runner).shares_memory  # the frame went through /dev/shm
    pids = rank_pids(runner)
    assert runner.placement == "external"
    runner.shutdown()
    assert [joiners.procs[f"rank{r}"].wait(10) for r in range(2)] == [0, 0]
    assert wait_gone(pids) == []
    assert not os.path.exists(secret_file)
    # This test's joiners only: tests side by side have probes of their own.
    ours = {f"reactor-dist-probe-{pid}-" for pid in pids}
    ours |= {f"reactor-dist-probe-{proc.pid}-" for proc in joiners.procs.values()}
    assert [n for n in os.listdir("/dev/shm") if n[:n.rfind("-") + 1] in ours] == []


# A /dev/shm of its own, as on another machine: the joiner's probe is not found here.
OTHER_MEMORY = ("unshare", "--mount", "sh", "-c", 'mount -t tmpfs none /dev/shm && exec "$@"',
                "sh")


def test_a_rank_without_our_shared_memory_gets_its_frames_over_tcp(joiners):
    runner = external_runner()

    def join(runner: DistributedRunner) -> None:
        joiners.start(runner, 0, wrap=OTHER_MEMORY, name="rank0")  # rank 0: its result too
        joiners.start(runner, 1, name="rank1")

    started(runner, joiners, join=join)
    assert runner.healthy and not Probe(runner).shares_memory
    frame = np.arange(2 * 1024 * 1024, dtype=np.uint16).reshape(1024, 2048)
    out = runner.generate(frame)
    np.testing.assert_array_equal(out["frame"], frame[::-1] * 2)
    assert out["sum"] == 2 * float(frame.sum(dtype=np.float64))
    runner.shutdown()
    assert [joiners.procs[f"rank{r}"].wait(10) for r in range(2)] == [0, 0]


def test_bad_joins_are_refused_and_the_runner_carries_on(joiners, tmp_path, caplog):
    runner = external_runner()
    started(runner, joiners)
    before = rank_pids(runner)
    server = open(runner.join_command.split("--secret-file ")[1]).read()[:40]
    import zmq

    _, other_secret = zmq.curve_keypair()
    wrong = {**joiner_env(), JOIN_SECRET_ENV: f"{server}_{other_secret.decode()}"}
    command = runner.join_command.split(" --secret-file")[0]
    loose = tmp_path / "loose-secret"
    loose.write_text(open(runner.join_command.split("--secret-file ")[1]).read())
    loose.chmod(0o644)
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    cases = {
        "wrong-secret": (0, (), command, wrong),
        "taken": (0, (), None, None),
        "out-of-range": (5, (), None, None),
        "loose-file": (1, (), f"{command} --secret-file {loose}", None),
    }
    for name, (rank, extra, cmd, env) in cases.items():
        joiners.start(runner, rank, *extra, command=cmd, env=env, name=name)
    other_worker = runner.join_command.replace(WORKER, "restart_workers:Reduces")
    joiners.start(runner, 1, command=other_worker, name="other-worker")
    joiners.start(runner, 1, "--world-size", "3", name="other-size")
    joiners.start(runner, 1, name="other-version", program=(
        "-c", "import sys, reactor_dist; reactor_dist.__version__ = '0.0.9'; "
              "from reactor_dist.placement.joiner import main; sys.exit(main())"))
    codes = {name: joiners.procs[name].wait(60)
             for name in [*cases, "other-worker", "other-size", "other-version"]}
    assert codes == dict.fromkeys(codes, 2)
    said = {name: joiners.output(name) for name in codes}
    assert "refused this rank's join secret" in said["wrong-secret"]
    assert f"rank 0 is taken: it joined from {os.uname().nodename} (pid " \
           f"{joiners.procs['rank0'].pid}) and runs" in said["taken"]
    assert "rank 5 is out of range: the runner's ranks are 0 to 1" in said["out-of-range"]
    assert f"chmod 600 {loose}" in said["loose-file"]
    assert f"join with --worker {WORKER}" in said["other-worker"]
    assert "this rank was started for world size 3, the runner's is 2" in said["other-size"]
    assert ("this rank runs reactor_dist 0.0.9 (wire 2), the runner 0.1.0 (wire 2): "
            "install the same version on both") in said["other-version"]
    records = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(records) == 6, records  # one each but the loose file (refused at home)
    assert rank_pids(runner) == before  # the same ranks, healthy
    runner.shutdown()


def test_malformed_join_messages_are_dropped_and_the_join_socket_serves_on(joiners, caplog):
    """An authenticated peer that sends what no joiner sends (not msgpack, not a map, a
    hello whose fields have the wrong types) while start() waits: one record each, and
    the join socket's thread goes on: the ranks join, and a death is noticed after."""
    import msgpack
    import zmq

    from reactor_dist.wire.protocol import JOIN_KIND, split_join_secret

    dropped = "dropped a message on the join socket that is not a join message"
    caplog.set_level(logging.WARNING, logger="reactor_dist")

    def join(runner: DistributedRunner) -> None:
        command = runner.join_command.split()
        server, secret = split_join_secret(open(command[-1]).read())
        ctx = zmq.Context()
        peer = ctx.socket(zmq.DEALER)
        peer.curve_serverkey, peer.curve_secretkey = server, secret
        peer.curve_publickey = zmq.curve_public(secret)
        peer.connect(command[2])
        hello = {JOIN_KIND: "hello", "version": reactor_dist.__version__, "wire": 2,
                 "rank": 1, "world_size": 2, "worker": WORKER, "local_rank": "first"}
        for data in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb(hello)):
            peer.send(data)
        deadline = time.monotonic() + 30
        while sum(r.getMessage() == dropped for r in caplog.records) < 3:
            # wall-clock: a hang's bound, not a speed's: the records come within
            # milliseconds on an idle machine, 30 s is the join thread dead
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.02)
        peer.close(linger=0)
        ctx.term()
        for rank in range(2):
            joiners.start(runner, rank, name=f"rank{rank}")

    runner = external_runner()
    started(runner, joiners, join=join)
    pids = rank_pids(runner)
    joiners.procs["rank1"].kill()
    assert f"rank 1 (pid {pids[1]} on {os.uname().nodename}): its joiner's connection " \
           f"closed" in str(crash_of(runner))
    runner.shutdown()


def test_a_rank_srun_started_takes_its_rank_from_slurms_environment(joiners):
    runner = external_runner(start_timeout=None)  # no limit: waits in slices

    def join(runner: DistributedRunner) -> None:
        joiners.start(runner, 0, name="rank0")
        slurm = {**joiner_env(), "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                 "SLURM_LOCALID": "0"}
        joiners.start(runner, None, env=slurm, name="rank1")

    started(runner, joiners, join=join)
    assert runner.healthy and runner.generate(1.0) == [2.0, 5.0, 8.0, 11.0]
    host = os.uname().nodename
    assert [(r.rank, r.host) for r in runner.ranks] == [(0, host), (1, host)]
    runner.shutdown()
    assert joiners.procs["rank1"].wait(10) == 0


def test_a_dead_joined_rank_fails_the_call_and_restart_keeps_the_survivor(joiners):
    runner = external_runner()
    started(runner, joiners)
    survivor, victim = rank_pids(runner)
    os.kill(victim, signal.SIGKILL)
    crashed = crash_of(runner)
    message = str(crashed)
    host = os.uname().nodename
    assert f"rank 1 (pid {victim} on {host}) killed by SIGKILL" in message
    assert [(f.rank, f.host) for f in crashed.failures] == [(1, host)]
    assert joiners.procs["rank1"].wait(10) == 1  # its launcher would start it again
    joiners.start(runner, 1, name="rank1-again")
    runner.restart()
    after = runner.generate(Pid())
    assert after[0] == (survivor, 1, 1)  # the same process, loaded once, rejoined
    assert after[1][0] != victim and after[1][1:] == (1, 0)
    assert runner.generate(2.0) == [4.0, 7.0, 10.0, 13.0]  # 3 * arange(4) + 2 * 2
    runner.shutdown()
    assert joiners.procs["rank0"].wait(10) == 0 and joiners.procs["rank1-again"].wait(10) == 0


def test_a_hung_joined_rank_times_out_with_its_stack_and_restart_replaces_it(joiners):
    runner = external_runner(call_timeout=3.0)
    started(runner, joiners)
    survivor, hung = rank_pids(runner)
    with pytest.raises(WorkerTimeout) as failed:
        runner.generate(HangIn(rank=1))
    message = str(failed.value)
    assert message.startswith("no answer from rank 1 within 3 s during generate()")
    assert "restart_workers.py\", line" in message  # its stack, through its joiner
    restart = threading.Thread(target=runner.restart)
    restart.start()
    assert joiners.procs["rank1"].wait(30) == 1  # the restart ended it: its launcher's turn
    joiners.start(runner, 1, name="rank1-again")  # as a launcher does, once it exited
    restart.join(120)
    after = runner.generate(Pid())
    assert after[0] == (survivor, 1, 1) and after[1][0] != hung
    assert wait_gone([hung]) == []
    runner.shutdown()


@pytest.mark.parametrize(("sig", "noticed"), [
    (signal.SIGKILL, "its joiner's connection closed (it died)"),
    (signal.SIGSTOP, "its joiner fell silent for 0.8 s"),
])
def test_a_killed_or_stopped_joiner_is_noticed(joiners, sig, noticed):
    runner = external_runner()
    started(runner, joiners)
    pids = rank_pids(runner)
    os.kill(joiners.procs["rank1"].pid, sig)
    assert f"rank 1 (pid {pids[1]} on {os.uname().nodename}): {noticed}" in str(crash_of(runner))
    runner.shutdown()
    assert joiners.procs["rank0"].wait(10) == 0
    joiners.procs["rank1"].kill()  # a stopped one ends here; its rank goes with it
    assert wait_gone([pids[1]]) == []


def test_an_application_that_holds_the_gil_a_while_loses_no_rank(joiners):
    """The join socket's thread gets no turn for 1.5 s (twice JOIN_SILENCE): what it did
    not hear meanwhile is no joiner's death."""
    runner = external_runner()
    started(runner, joiners)
    pids = rank_pids(runner)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # no other thread runs until this one waits
    try:
        end = time.perf_counter() + 1.5
        while time.perf_counter() < end:
            pass
    finally:
        sys.setswitchinterval(interval)
    time.sleep(0.3)  # the thread's next rounds
    assert runner.healthy and rank_pids(runner) == pids
    runner.shutdown()


def test_start_names_the_ranks_that_did_not_join(joiners):
    # Rank 0's joiner says hello within a second on an idle machine; 15 s leaves it room
    # on a loaded one (the message names it as joined), and rank 1 never comes.
    runner = external_runner(start_timeout=15.0)
    with pytest.raises(PlacementFailed) as failed:
        started(runner, joiners, ranks=[0])
    pid = joiners.procs["rank0"].pid
    assert str(failed.value).startswith(
        f"rank 1 did not join within start_timeout=15 s during start() (joined: rank 0 "
        f"from {os.uname().nodename} (pid {pid})); start each with: reactor-dist-rank "
        f"--join tcp://127.0.0.1:")
    assert joiners.procs["rank0"].wait(10) == 2
    assert "the runner refused rank 0: the runner shut down" in joiners.output("rank0")


APP = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{tests!r}, {repo!r}]
    import numpy as np
    from join_workers import Frames
    from reactor_dist import DistributedRunner, External
    runner = DistributedRunner(Frames, world_size=2, device="cpu", start_timeout=90,
                               placement=External(port={port}, secret_file={secret!r}))
    runner.start()
    runner.generate(np.ones((256, 256), np.uint8))
    print("ready", flush=True)
    sys.stdin.readline()  # the test says when
    raise RuntimeError("the application failed")  # or it is SIGKILLed first
""")


@pytest.mark.parametrize("ends", ["killed", "raises"])
def test_the_joined_ranks_end_when_the_application_does(joiners, tmp_path, ends):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = str(tmp_path / "secret")
    app = subprocess.Popen(
        [sys.executable, "-c", APP.format(tests=TESTS, repo=REPO, port=port, secret=secret)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=joiner_env())
    try:
        while not os.path.exists(secret):
            assert app.poll() is None
            time.sleep(0.05)
        command = f"reactor-dist-rank --join tcp://127.0.0.1:{port} --worker {WORKER} " \
                  f"--secret-file {secret}"

        class Named:
            world_size = 2
            join_command = command

        for rank in range(2):
            joiners.start(Named, rank, name=f"rank{rank}")
        assert app.stdout.readline() == b"ready\n"
        ranks = [c.pid for j in joiners.procs.values()
                 for c in psutil.Process(j.pid).children()]
        assert len(ranks) == 2
        if ends == "killed":
            app.kill()
        else:
            app.stdin.write(b"go\n")
            app.stdin.flush()
        assert app.wait(30) == (-signal.SIGKILL if ends == "killed" else 1)
        assert [joiners.procs[f"rank{r}"].wait(10) for r in range(2)] == [0, 0]
        assert wait_gone(ranks) == []
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"rdist.{app.pid}.")]
        assert left == []
        assert glob.glob(f"/tmp/reactor-dist-{app.pid}-*") == []  # its private directory
    finally:
        app.kill()
        app.wait()


def test_external_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="spares= needs a placement that starts processes"):
        DistributedRunner(Frames, world_size=2, placement="external", spares=1)
    with pytest.raises(ValueError, match="launch_prefix= does not apply"):
        DistributedRunner(Frames, world_size=2, placement="external", launch_prefix=["nice"])
    with pytest.raises(ValueError, match="gpus= and placement='external' exclude each other"):
        DistributedRunner(Frames, world_size=2, placement="external", gpus=[0, 1],
                          device="cuda")
    with pytest.raises(ValueError, match="rank_output='log' does not apply with placement="):
        DistributedRunner(Frames, world_size=2, placement="external", rank_output="log")
    with pytest.raises(ValueError, match="External\\(port=...\\) must be a TCP port"):
        External(port=70000)
    with pytest.raises(ValueError, match="placement must be 'local', 'ray', 'external'"):
        DistributedRunner(Frames, world_size=2, placement="slurm")


def test_the_docs_sbatch_script_is_bash_and_the_join_commands_parse():
    """The page's launcher examples are fragments (a cluster runs them): the sbatch
    script is checked by bash itself, the join commands by the joiner's own parser."""
    import argparse

    from docs_pages import blocks

    from reactor_dist.placement import joiner as join

    found = {b.heading: b.code for b in blocks("docs/cluster-launchers.md")
             if b.language == "bash"}
    script = found["Slurm: an `sbatch` script with `srun`"]
    checked = subprocess.run(["bash", "-n"], input=script.encode(), capture_output=True)
    assert checked.returncode == 0, checked.stderr.decode()
    parser = argparse.ArgumentParser()
    join.add_arguments(parser)
    by_hand = found["By hand"].replace("\\\n", " ").split()
    args = parser.parse_args(by_hand[1:])
    assert (args.join, args.worker, args.rank, args.world_size, args.local_rank) == \
           ("tcp://127.0.0.1:29600", "mymodel:VideoModel", 1, 2, 1)
    torchrun = found["torchrun on two nodes"].replace("\\\n", " ").split()
    after = torchrun[torchrun.index("reactor_dist.rank") + 1:]
    assert parser.parse_args(after).secret_file == "/shared/job-42/reactor-secret"
