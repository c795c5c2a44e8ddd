"""File descriptors (issue 19, point 3): a child process lowers RLIMIT_NOFILE with
resource.setrlimit and starts a real runner of 4 ranks.  Too low a limit is a clear
FileLimitTooLow before anything starts (never libzmq's SIGABRT); just enough starts
and calls; a bus whose bind fails (the check made permissive) gives back every
descriptor, its ZeroMQ context and its ipc directory."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap

import pytest

from reactor_dist.caller import open_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD_SIZE = 4

CHILD = textwrap.dedent("""
    import glob, json, os, resource, sys, tempfile
    import numpy as np
    import zmq
    from reactor_dist import DistributedRunner
    from sample_workers import Echo

    spec = json.loads(sys.argv[1])
    if spec["permissive"]:  # the situation of a check that passed, then a bind that fails
        try:
            import reactor_dist.caller.open_files as open_files
            open_files.check_room = lambda world_size: None
        except ImportError:  # before the check existed
            pass
    extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(spec["extra_open"])]

    def fds():
        return sorted(int(n) for n in os.listdir("/proc/self/fd"))

    def dirs():
        base = {tempfile.gettempdir(), "/tmp"}
        return sorted(p for b in base for p in glob.glob(f"{b}/*reactor-dist-*")
                      if str(os.getpid()) in p or "draft" in p)

    before = fds()
    used = len(before) - 1  # the listing's own descriptor
    limit = spec["limit"] if spec["limit"] else used + spec["above_used"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    report = {"limit": limit, "used": used, "hard": hard}
    runner = DistributedRunner(Echo, world_size=spec["world_size"], device="cpu",
                               init_process_group=False)
    try:
        runner.start()
        frames = np.arange(1 << 20, dtype=np.float32)
        report["answer"] = bool((runner.generate(frames) == frames).all())
        report["reset"] = runner.reset()
        report["stream"] = list(runner.stream("item"))
        runner.shutdown()
    except BaseException as exc:
        report["error"] = [type(exc).__name__, str(exc), getattr(exc, "errno", None),
                           isinstance(exc, zmq.ZMQError) or isinstance(exc, OSError)]
    del runner
    # The rank template's socket stays: it serves every runner of the process (template.py).
    from reactor_dist.placement.template import Template
    report["leftover_fds"] = [f for f in fds() if f not in before and f not in Template.fds()]
    report["leftover_dirs"] = dirs()
    print(json.dumps(report))
""")


def run_child(limit: int = 0, above_used: int = 0, extra_open: int = 0,
              permissive: bool = False) -> dict:
    spec = {"limit": limit, "above_used": above_used, "extra_open": extra_open,
            "permissive": permissive, "world_size": WORLD_SIZE}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"rc {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert "Too many open files (src/" not in out.stderr  # libzmq's abort
    return json.loads(out.stdout.splitlines()[-1])


def expected_message(report: dict) -> str:
    limit, used = report["limit"], report["used"]
    need = open_files.needed(WORLD_SIZE)
    unlimited = report["hard"] == resource.RLIM_INFINITY
    suggest = max(used + need, 4096 if unlimited else min(4096, report["hard"]))
    hard = "unlimited" if unlimited else str(report["hard"])
    if not unlimited and report["hard"] < used + need:
        hard += "; raising it past that needs root, or docker --ulimit nofile=65536"
    return (f"the open files limit (RLIMIT_NOFILE) is {limit}, with {used} descriptors in "
            f"use: a runner of {WORLD_SIZE} ranks needs {need} more (19 + 5 per rank + 32 "
            f"for shared-memory segments), so at least {used + need} is needed. Raise it "
            f"before starting: `ulimit -n {suggest}` in the shell, or resource.setrlimit("
            f"resource.RLIMIT_NOFILE, ({suggest}, hard)) in Python (the hard limit is "
            f"{hard}); nothing was started")


@pytest.mark.parametrize("situation", [
    {"limit": 32},                      # the first case: SIGABRT before
    {"limit": 64, "extra_open": 26},    # the second: 64 with 30 in use
    {"limit": 16},                      # a ZMQError before, with fds and the dir left
    {"above_used": open_files.needed(WORLD_SIZE) - 1},  # one short
], ids=["32", "64-with-30-in-use", "16", "one-short"])
def test_too_low_a_limit_is_a_clear_error_before_anything_starts(situation):
    report = run_child(**situation)
    name, message, errno, is_oserror = report["error"]
    assert name == "FileLimitTooLow" and is_oserror and errno == 24
    assert message == expected_message(report)
    assert report["leftover_fds"] == [] and report["leftover_dirs"] == []


def test_just_enough_starts_and_calls():
    report = run_child(above_used=open_files.needed(WORLD_SIZE))
    assert "error" not in report, report["error"]
    assert report["answer"] is True and report["reset"] is None
    assert report["stream"] == ["item"]
    assert report["leftover_fds"] == [] and report["leftover_dirs"] == []


@pytest.mark.parametrize("above_used", [8, 10, 14], ids=["cmd-bind", "reply-bind", "later"])
def test_a_bind_that_fails_gives_back_every_descriptor_and_the_ipc_directory(above_used):
    """With the check out of the way, the limit runs out while the bus is built (or just
    after): the error is a Python exception, and nothing stays behind."""
    report = run_child(above_used=above_used, permissive=True)
    name, message, _, is_oserror = report["error"]
    assert is_oserror and "Too many open files" in message, report["error"]
    assert report["leftover_fds"] == [] and report["leftover_dirs"] == []


def test_doctor_reports_the_limit_and_the_ranks_it_allows():
    code = ("import resource, sys; from reactor_dist.__main__ import main; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit("
            "resource.RLIMIT_NOFILE)[1])); sys.exit(main(['doctor', '--world-size', '4', "
            "'--device', 'cpu', '--no-smoke']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("✗ open files limit")]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    found = lines[at].split("open files limit", 1)[1].strip()
    used = int(found.split("; ")[1].split(" in use")[0])
    allowed = (64 - used - open_files.FIXED - open_files.SEGMENTS) // open_files.PER_RANK
    assert found == f"64 (hard {shown}); {used} in use, room for {allowed} ranks (4 asked)"
    assert lines[at + 1].strip() == "fix: ulimit -n 4096 (docker: --ulimit nofile=65536)"
