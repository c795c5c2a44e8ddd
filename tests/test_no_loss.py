"""No command is ever lost on the command socket (issue 19): a pipe at its bound makes
the runner wait, re-send or report, never drop.

The bound is made small for a test (``REACTOR_DIST_SEND_BOUND``) and a rank made to stop
reading (SIGSTOP) while commands big enough to fill the kernel's socket buffer (a few
MiB of ``bytes``, which travel in-band) pile up behind it: with a plain PUB socket
ZeroMQ drops every command past the bound for that rank, silently.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from bus_workers import CountLoads
from probe import Probe

from reactor_dist import DistributedRunner, WorkerTimeout
from reactor_dist.caller.bus import Bus, CommandBlocked, private_dir
from reactor_dist.wire.protocol import COMMANDS, SEND_BOUND_ENV, Delivery, Field, Kind, Status

BIG = 4 << 20  # bigger than a Unix socket's send buffer: one such message fills it

# A subscriber like a rank's: answers the first PING with a PONG, then records the SEQ
# of every CALL in order until SHUTDOWN, and prints them.
PEER = r"""
import json, sys, zmq
from reactor_dist.wire import framing
from reactor_dist.wire.protocol import Field, Kind
cmd, reply, secret = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.setsockopt(zmq.RCVHWM, 0)
sub.connect(cmd)
push = ctx.socket(zmq.PUSH)
push.connect(reply)
channel, seqs, ponged = framing.Channel(secret), [], False
while True:
    header, body = channel.recv(sub)
    if header[Field.KIND] == Kind.PING and not ponged:
        channel.send(push.send, {Field.KIND: Kind.PONG, Field.SEQ: 0, Field.RANK: 0})
        ponged = True
    elif header[Field.KIND] == Kind.CALL:
        seqs.append(header[Field.SEQ])
    elif header[Field.KIND] == Kind.SHUTDOWN:
        break
print(json.dumps(seqs), flush=True)
push.close(linger=1000)
sub.close(linger=0)
ctx.term()
"""


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once it is stopped (it reads nothing more)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        # wall-clock: a SIGSTOP takes effect in ms; 10 s is a hang's bound, not a speed's
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.01)


def call(seq: int) -> tuple[dict, list]:
    return {Field.KIND: Kind.CALL, Field.SEQ: seq}, [bytes(BIG)]


def test_a_stopped_subscriber_gets_every_command_in_order(monkeypatch):
    """Publishing past the bound to a stopped subscriber: a deadline passes with
    CommandBlocked (sent to nobody); each kind then does what its row of
    protocol.COMMANDS says (a deadline kind raises at once with no time left, the one-try
    kinds say False); and once the subscriber runs again it has every CALL exactly once,
    in order."""
    monkeypatch.setenv(SEND_BOUND_ENV, "2")
    secret = os.urandom(32)
    ipc, lock = private_dir()
    bus = Bus(secret, ipc, world_size=1)
    peer = subprocess.Popen([sys.executable, "-c", PEER, bus.cmd_addr, bus.reply_addr,
                             secret.hex()], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        pong = None
        while pong is None and time.monotonic() < deadline:  # PUB/SUB's slow joiner
            bus.publish({Field.KIND: Kind.PING, Field.SEQ: 0})
            pong = bus.receive(20)
        assert pong is not None and pong[0][Field.KIND] == Kind.PONG
        stop(peer.pid)
        sent, blocked = 0, False
        while sent < 20 and not blocked:  # the bound (2) + what ZeroMQ's I/O thread holds
            try:
                bus.publish(*call(sent + 1), deadline=time.monotonic() + 2)
                sent += 1
            except CommandBlocked:  # sent to nobody: the same command is sent again below
                blocked = True
        assert blocked, f"{sent} commands past the bound were all taken: some were dropped"
        with pytest.raises(CommandBlocked):
            bus.publish(*call(sent + 1), deadline=time.monotonic())
        for kind, delivery in sorted(COMMANDS.items()):
            if delivery.delivery is not Delivery.DEADLINE:  # one try, whatever the kind
                assert bus.publish({Field.KIND: kind, Field.SEQ: sent + 1}) is False, kind
        os.kill(peer.pid, signal.SIGCONT)
        total = sent + 10
        for seq in range(sent + 1, total + 1):
            bus.publish(*call(seq), deadline=time.monotonic() + 60)
        bus.publish({Field.KIND: Kind.SHUTDOWN, Field.SEQ: 0}, deadline=time.monotonic() + 60)
        out, _ = peer.communicate(timeout=60)
        assert json.loads(out) == list(range(1, total + 1))
        assert peer.returncode == 0
    finally:
        if peer.poll() is None:
            os.kill(peer.pid, signal.SIGCONT)
            peer.kill()
        peer.wait()
        bus.close()
        shutil.rmtree(ipc, ignore_errors=True)
        os.close(lock)


def test_start_and_calls_complete_past_the_bound_of_a_stopped_rank(monkeypatch):
    """A bound of 1 command: start-up's pings and INIT meet full pipes and are tried
    again at their pace; then rank 1 stops while two big calls are left (their
    tasks cancelled), so the third call finds rank 1's pipe full: it waits for room
    instead of being dropped, and returns once rank 1 runs again."""
    monkeypatch.setenv(SEND_BOUND_ENV, "1")
    runner = DistributedRunner(CountLoads, world_size=3, device="cpu",
                               init_process_group=False, start_timeout=60, call_timeout=60)
    with runner:
        assert runner.generate(b"x") == 1
        rank1 = Probe(runner).rank_pids[1]
        stop(rank1)
        resume = threading.Timer(1.0, os.kill, (rank1, signal.SIGCONT))
        try:
            fill_the_stopped_ranks_pipe(runner)
            # Rank 1's pipe is full now: a command would be refused (a PING is harmless).
            assert not Probe(runner).bus.publish({Field.KIND: Kind.PING, Field.SEQ: 0})
            resume.start()
            assert runner.generate(bytes(BIG) + b"!") == BIG + 1
            assert runner.generate(b"after") == 5
            assert runner.healthy
        finally:
            resume.cancel()
            os.kill(rank1, signal.SIGCONT)


def fill_the_stopped_ranks_pipe(runner: DistributedRunner) -> None:
    """Two calls of 4 MiB in-band each, left (their tasks cancelled): the stopped
    rank's socket buffer and its pipe (bound 1) are full."""
    async def leave_two() -> None:
        for _ in range(2):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(runner.agenerate(bytes(BIG)), 0.3)

    asyncio.run(leave_two())


def test_a_call_that_cannot_be_handed_over_names_the_stopped_rank(monkeypatch):
    """A rank stopped for longer than the call's timeout: the call is sent to nobody and
    fails with a WorkerTimeout that names the stopped rank (never a lost command)."""
    monkeypatch.setenv(SEND_BOUND_ENV, "1")
    # Room for the two calls that fill the pipe (they stay in flight) and a third.
    runner = DistributedRunner(CountLoads, world_size=2, device="cpu", max_in_flight=3,
                               init_process_group=False, start_timeout=60, call_timeout=60)
    with runner:
        rank1 = Probe(runner).rank_pids[1]
        stop(rank1)
        try:
            fill_the_stopped_ranks_pipe(runner)
            with pytest.raises(WorkerTimeout, match=r"generate\(\)'s command was sent to no "
                                                    r"rank within 0.5 s.*rank 1: stopped"):
                runner.generate(b"x", timeout=0.5)
            assert not runner.healthy
        finally:
            os.kill(rank1, signal.SIGCONT)


def test_a_repeated_init_answers_ready_again_without_a_second_load(log_dir):
    runner = DistributedRunner(CountLoads, world_size=2, device="cpu",
                               init_process_group=False, load_kwargs={"log_dir": log_dir})
    with runner:
        bus = Probe(runner).bus
        assert bus.publish({Field.KIND: Kind.INIT, Field.SEQ: 0, Field.PORT: 0})  # one try
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + 30
        while len(ready) < 2 and time.monotonic() < deadline:
            message = bus.receive(1000)
            if message is not None and message[0][Field.KIND] == Kind.READY:
                ready[message[0][Field.RANK]] = message[0]
        assert sorted(ready) == [0, 1]
        assert all(h[Field.STATUS] == Status.OK and h[Field.DEVICE] == "cpu"
                   for h in ready.values())
        assert runner.generate(b"abc") == 3  # after the repeated INIT on every rank
    with open(os.path.join(log_dir, "loads")) as f:
        assert sorted(f.read().splitlines()) == ["load 0", "load 1"]


def test_the_send_bound_must_be_a_positive_number(monkeypatch):
    monkeypatch.setenv(SEND_BOUND_ENV, "none")
    runner = DistributedRunner(CountLoads, world_size=1, device="cpu")
    with pytest.raises(ValueError, match=f"{SEND_BOUND_ENV}='none': give a whole number"):
        runner.start()
