"""What another local user (or a planted file) must not be able to do to a runner.

Each test sets up what an attacker could set up on a shared machine (a module in
the working directory, entries in /dev/shm owned by a second user, names taken in
advance) and checks that the runner works and that nothing foreign is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc

import numpy as np
import psutil
import pytest
import test_runner_death
import zmq
from probe import Probe
from sample_workers import Echo, FullArray, Step

from reactor_dist import DistributedRunner, SharedMemoryExhausted, WorkerCrashed
from reactor_dist.shm import segments
from reactor_dist.shm.ledger import NAME_TRIES, Ledger
from reactor_dist.wire import framing
from reactor_dist.wire.protocol import Field, Kind

apps = test_runner_death.apps  # runners in a subprocess, to be killed


@pytest.fixture
def other_user():
    """A second local user (removed afterwards): what it makes is not ours."""
    if os.geteuid() != 0:
        pytest.skip("creating a second user takes root")
    name = f"rdt{os.urandom(3).hex()}"
    subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", name], check=True)
    try:
        yield lambda *cmd: subprocess.run(["runuser", "-u", name, "--", *cmd], check=True)
    finally:
        subprocess.run(["userdel", name], check=False)


def dead_pid() -> int:
    pid = 4_000_000
    while psutil.pid_exists(pid):
        pid -= 1
    return pid


def small_runner(**kwargs) -> DistributedRunner:
    return DistributedRunner(Echo, world_size=2, init_process_group=False, device="cpu",
                             **kwargs)

PLANTED = """
import os
with open({marker!r}, "a") as f:
    f.write(f"{{os.getpid()}} imported {name}\\n")
"""


def test_a_module_planted_in_the_working_directory_never_runs_in_a_rank(tmp_path, monkeypatch):
    plant = tmp_path / "cwd"
    plant.mkdir()
    marker = tmp_path / "marker"
    for name in ("argparse", "numpy", "msgpack", "zmq", "psutil"):
        (plant / f"{name}.py").write_text(PLANTED.format(marker=str(marker), name=name))
    monkeypatch.chdir(plant)
    with DistributedRunner(Echo, world_size=2, init_process_group=False, device="cpu") as runner:
        x = np.arange(1 << 18, dtype=np.float32)[::2]
        assert np.array_equal(runner.generate(x), x)
        assert runner.generate(FullArray([4 << 20])).nbytes == 4 << 20
    assert not marker.exists(), marker.read_text()


def test_foreign_entries_in_dev_shm_neither_stop_a_runner_nor_are_touched(other_user):
    """Another user's directory and file, named like a dead runner's entries."""
    shm_dir = sticky_dir()
    base = f"{shm_dir}/rdist.{dead_pid()}.1.ab"
    foreign_dir, foreign_file = base + ".cd", base + ".in1"
    try:
        other_user("mkdir", foreign_dir)
        other_user("touch", foreign_file)
        with small_runner(shm_dir=shm_dir) as runner:
            x = np.ones(1 << 20, np.uint8)
            assert np.array_equal(runner.generate(x), x)
        assert os.path.isdir(foreign_dir) and os.path.isfile(foreign_file)
    finally:
        subprocess.run(["rm", "-rf", shm_dir], check=False)


def test_reclaim_never_follows_a_link_named_like_a_dead_runners_directory(tmp_path):
    """/tmp: a symlink named like a dead runner's private directory is left alone (lstat),
    its target untouched; a dead runner's real directory is reclaimed."""
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep").write_text("x")
    base = tempfile.gettempdir()
    link = os.path.join(base, f"reactor-dist-{dead_pid()}-beef")
    dead = os.path.join(base, f"reactor-dist-{dead_pid() - 7}-cafe")
    os.symlink(target, link)
    os.mkdir(dead, 0o700)
    try:
        with small_runner() as runner:
            assert runner.generate(1) == 1
        assert os.path.islink(link) and (target / "keep").read_text() == "x"
        assert not os.path.exists(dead)
    finally:
        os.unlink(link)
        shutil.rmtree(dead, ignore_errors=True)


def test_a_directory_squatting_on_a_runners_names_never_stops_its_shutdown(tmp_path):
    squat = None
    try:
        with small_runner() as runner:
            runner.generate(np.ones(1 << 20, np.uint8))
            squat = f"{segments.DEFAULT_DIR}/{Probe(runner).shm_prefix}.in99"
            os.mkdir(squat)
        assert os.path.isdir(squat)
    finally:
        if squat:
            os.rmdir(squat)


def test_ranks_end_after_a_sigkilled_runner_whatever_squats_in_dev_shm(apps):
    app = apps("idle")
    app.read_running()
    squat = f"{segments.DEFAULT_DIR}/{app.info['prefix']}.squat"
    os.mkdir(squat)
    try:
        since = app.kill()
        test_runner_death.assert_all_gone_within(app.info["ranks"], since, bound=2.0)
    finally:
        os.rmdir(squat)


def test_names_taken_in_advance_do_not_stop_calls():
    """Whoever sees one name cannot take the next ones: names carry a random token."""
    runner = small_runner()
    prefix = f"{segments.DEFAULT_DIR}/{Probe(runner).shm_prefix}."
    squatted = [f"{prefix}{tag}{n}" for tag in ("in", "r0-") for n in range(1, 40)]
    for path in squatted:
        open(path, "x").close()
    try:
        with runner:
            held = [runner.generate(np.full(n << 20, n, np.uint8)) for n in (1, 2, 3, 4)]
            assert [int(a[0]) for a in held] == [1, 2, 3, 4]
            assert runner.generate(FullArray([5 << 20])).nbytes == 5 << 20
    finally:
        for path in squatted:
            segments.unlink_quietly(path)


def test_a_name_somebody_took_first_is_passed_over(tmp_path):
    tokens = iter(["taken", "fresh", *["taken"] * NAME_TRIES])
    (tmp_path / "p.intaken").write_bytes(b"not ours")
    ledger = Ledger(str(tmp_path), "p", "in", token=lambda: next(tokens))
    try:
        assert ledger.acquire(100, "a test", ["r"]).name == "p.infresh"
        with pytest.raises(SharedMemoryExhausted, match="taken"):
            ledger.acquire(2 << 20, "a test", ["r"])
        assert (tmp_path / "p.intaken").read_bytes() == b"not ours"
    finally:
        ledger.close()


def take_pid(pid: int, tries: int = 50) -> subprocess.Popen | None:
    """A process leading a group of its own under ``pid`` if the kernel hands that pid
    out again (ns_last_pid, root), else None (the pid is still taken)."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_shutdown_never_signals_the_group_of_a_rank_whose_pid_passed_on():
    if os.geteuid() != 0:
        pytest.skip("choosing the next pid (ns_last_pid) takes root")
    stand_in = None
    with small_runner() as runner:
        victim = Probe(runner).rank_pids[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerCrashed):
            runner.generate(1)  # the crash is reported: its exit status was read
        stand_in = take_pid(victim)
    try:
        if stand_in is not None:  # only where the runner let the pid go before its kill
            time.sleep(0.1)
            assert stand_in.poll() is None, "shutdown killed a process that took a dead rank's pid"
    finally:
        if stand_in is not None:
            stand_in.kill()
            stand_in.wait()


NAMESPACED_APP = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from probe import Probe
    from sample_workers import Echo
    from reactor_dist import DistributedRunner

    with DistributedRunner(Echo, world_size=2, init_process_group=False, device="cpu",
                           shm_dir=sys.argv[1]) as runner:
        x = np.arange(1 << 20, dtype=np.uint8)
        runner.generate(x)  # leaves an idle input segment, kept warm
        print(json.dumps({{"prefix": Probe(runner).shm_prefix}}), flush=True)
        sys.stdin.readline()
        print(json.dumps(bool(np.array_equal(runner.generate(x), x))), flush=True)
""")


def sticky_dir() -> str:
    """A directory like /dev/shm (mode 1777, on tmpfs) that other runners on the machine
    never look into: what happens there is this test's doing alone."""
    path = f"{segments.DEFAULT_DIR}/rdt-{os.urandom(4).hex()}"
    os.mkdir(path)
    os.chmod(path, 0o1777)
    return path


def test_a_runner_in_another_pid_namespace_keeps_its_segments():
    """Its pid means nothing outside: a host runner's start must not take it for dead,
    nor may its start take the host runner for dead (its ipc directory stays)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a pid namespace takes root and unshare(1)")

    script = NAMESPACED_APP.format(tests=os.path.dirname(os.path.abspath(__file__)))
    shm_dir = sticky_dir()
    try:
        namespaced_beside_host(script, shm_dir)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def without_results(names) -> list[str]:
    return sorted(n for n in names if ".r0-" not in n)


def namespaced_beside_host(script: str, shm_dir: str) -> None:
    with small_runner(shm_dir=shm_dir) as host:
        host_dir = Probe(host).ipc_dir
        app = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script,
             shm_dir],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        try:
            json.loads(app.stdout.readline())  # started: it reclaimed what it took for dead
            assert os.path.isdir(host_dir) and "cmd" in os.listdir(host_dir)
            entries = sorted(os.listdir(shm_dir))
            assert any(".in" in name for name in entries)
            with small_runner(shm_dir=shm_dir) as runner:
                runner.generate(1)
            # The app's rank 0 may retire its own idle result segment meanwhile (idle
            # trimming, its own doing under a slow machine); nothing else may go.
            assert without_results(os.listdir(shm_dir)) == without_results(entries)
            app.stdin.write("go\n")
            app.stdin.flush()
            assert json.loads(app.stdout.readline()) is True
            assert app.wait(30) == 0
            assert host.generate("still here") == "still here"
        finally:
            with contextlib.suppress(psutil.Error):  # the namespace's init: ends it all
                for p in psutil.Process(app.pid).children():
                    p.kill()
            app.kill()
            app.wait()


FLOOD = textwrap.dedent("""
    import sys, zmq
    push = zmq.Context().socket(zmq.PUSH)
    push.connect(sys.argv[1])
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 512 << 20
    big = bytes(size)
    for _ in range(3):
        push.send(big)
        push.send_multipart([bytes(100), big])
    push.close(linger=10000)
""")


def peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def test_huge_forged_frames_cost_the_runner_no_memory_and_no_call(tmp_path):
    """A stranger on the reply socket sends 512 MiB frames while calls run (1 s timeout)."""
    with small_runner(call_timeout=1) as runner:
        runner.generate(1)
        peak_rss_reset()
        before = peak_rss()
        flood = subprocess.Popen([sys.executable, "-c", FLOOD,
                                  f"ipc://{Probe(runner).ipc_dir}/reply"])
        try:
            deadline = time.monotonic() + 4
            calls = 0
            while time.monotonic() < deadline or flood.poll() is None and calls < 400:
                assert runner.generate(calls) == calls
                calls += 1
            assert flood.wait(30) == 0
            assert runner.generate("still") == "still" and runner.healthy
        finally:
            flood.kill()
            flood.wait()
        assert peak_rss() - before < 128 << 20, f"peak grew by {(peak_rss() - before) >> 20} MiB"


def test_forged_frames_under_the_bound_are_never_copied_before_their_mac_fails():
    """200 MiB forged frames (under the 256 MiB bound) reach the runner's reply socket:
    it checks their MAC on ZeroMQ's own buffer, so Python never allocates their size."""
    with small_runner() as runner:
        runner.generate(1)
        tracemalloc.start()
        try:
            flood = subprocess.Popen([sys.executable, "-c", FLOOD,
                                      f"ipc://{Probe(runner).ipc_dir}/reply", str(200 << 20)])
            try:
                calls = 0
                while flood.poll() is None and calls < 2000:
                    assert runner.generate(calls) == calls
                    calls += 1
                assert flood.wait(30) == 0
                for n in range(20):  # the reply socket reads its peers in turn: drain it
                    assert runner.generate(n) == n
            finally:
                flood.kill()
                flood.wait()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert runner.healthy
    assert peak < 32 << 20, f"Python allocated up to {peak >> 20} MiB for forged frames"


def test_a_message_over_the_bound_in_all_is_dropped_frame_by_frame(tmp_path, monkeypatch):
    """Frames each under the frame bound, together over the message bound: rejected
    without being held, and the socket reads the next message cleanly."""
    monkeypatch.setattr(framing, "MAX_MESSAGE", 10 << 20)
    secret = os.urandom(32)
    channel = framing.Channel(secret)
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(f"ipc://{tmp_path}/s")
        push.connect(f"ipc://{tmp_path}/s")
        pull.rcvtimeo = 5000
        push.send_multipart([b"\0" * 64] + [bytes(4 << 20)] * 4)
        header = {Field.KIND: Kind.REPLY, Field.SEQ: 1, Field.RANK: 0}
        channel.send(push.send, header, [b"ok", bytes(4 << 20)])
        with pytest.raises(framing.ProtocolError, match="a message of 16 MiB, over the bound"):
            channel.recv(pull)
        got, body = channel.recv(pull)
        assert got[Field.SEQ] == 1 and bytes(body[0]) == b"ok" and len(body[1]) == 4 << 20
    finally:
        ctx.destroy(linger=0)


class Blob(Step):
    """A result that pickles in-band: ``n`` bytes."""

    def __init__(self, n: int) -> None:
        self.n = n

    def run(self, worker):
        return b"x" * self.n


def test_a_payload_too_big_for_the_bus_is_refused_by_its_sender(monkeypatch):
    monkeypatch.setenv("REACTOR_DIST_MAX_FRAME", str(1 << 20))  # the ranks'
    monkeypatch.setattr(framing, "MAX_FRAME", 1 << 20)  # and the runner's
    with small_runner() as runner:
        with pytest.raises(TypeError, match="above the bus's bound"):
            runner.generate(b"x" * (2 << 20))
        with pytest.raises(Exception, match="above the bus's bound"):
            runner.generate(Blob(2 << 20))
        assert runner.generate(Blob(1000)) == b"x" * 1000 and runner.healthy


def test_a_non_contiguous_input_too_big_for_shm_fails_before_any_copy(monkeypatch):
    shm_dir = sticky_dir()
    monkeypatch.setenv(segments.LIMIT_ENV, str(64 << 20))
    try:
        with small_runner(shm_dir=shm_dir) as runner:
            base = np.ones(200 << 20, np.uint8)
            strided = base[::2]  # 100 MiB, copied to be pickled
            peak_rss_reset()
            before = peak_rss()
            with pytest.raises(SharedMemoryExhausted, match="100.0 MiB"):
                runner.generate(strided)
            assert peak_rss() - before < 32 << 20, "the input was copied before it was refused"
            x = np.arange(1 << 20, dtype=np.uint8)[::2]
            assert np.array_equal(runner.generate(x), x) and runner.healthy
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_the_group_meets_in_a_store_only_the_runners_user_can_reach():
    """The torch.distributed rendezvous is a FileStore in the private 0700 directory,
    not a TCP port on loopback that any local user could connect to."""
    with DistributedRunner(Echo, world_size=2, init_process_group=True, device="cpu") as runner:
        private = Probe(runner).ipc_dir
        assert "store" in os.listdir(private)
        assert os.stat(private).st_mode & 0o777 == 0o700
        assert os.stat(private).st_uid == os.getuid()
        assert runner.generate("formed") == "formed"
