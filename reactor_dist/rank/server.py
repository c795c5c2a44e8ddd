"""A rank's process: ``reactor-dist-rank`` (also ``python -m reactor_dist.rank``).

Life of a rank (messages in :mod:`reactor_dist.wire.protocol`)::

    read the Bootstrap from stdin (secret, addresses, worker class, load_kwargs)
    watch the runner's pid -> if it dies: remove its /dev/shm entries, kill own group
    connect SUB (commands) + PUSH (replies); import torch when a group is to be formed
    Kind.PING  -> Kind.PONG        (handshake: proves our subscription is live)
    Kind.INIT  -> Kind.READY       (set device, form the torch.distributed group, load();
                                    a repeated INIT gets the same READY, load() runs once)
    Kind.CALL  -> Kind.REPLY       (generate/reset; rank 0 alone sends the result payload)
    Kind.RELEASE, Kind.RECLAIM     (shared memory back: also read mid-call, memory.py)
    Kind.DROP                      (restart(): skip the calls that failed; read as it comes)
    Kind.ANSWERED                  (a call this rank raised in is over on every rank: the
                                    next CALL, held until then, may start; read as it comes)
    Kind.REJOIN -> Kind.REJOINED   (restart(), a rank that keeps its model: leave the old
                                    group, join the new one with the new ranks, rejoin())
    Kind.SHUTDOWN -> exit

A spare (``Bootstrap.spare``) loads at once with no rank and no group, says READY on
the runner's spare socket, and reads every command without acting on it until a REJOIN
names it in ``Field.TAKERS``: from then on it is that rank, and the REJOIN is its first
command (join the new group, ``rejoin()``).

The secret never appears in argv or the environment.  Every command is
authenticated (framing.Channel.unpack) before anything in it is decoded.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import dataclasses
import faulthandler
import logging
import os
import pickle
import select
import shutil
import signal
import sys
import threading
import time
from types import GeneratorType
from typing import Any, NoReturn

import psutil
import zmq

from ..device import choose_device, context_broken, wait_for_device
from ..errors import SharedMemoryExhausted, describe, pickle_exception
from ..shm import segments
from ..shm.collective_ring import ring_name
from ..wire import framing, log_records, transfer
from ..wire.progress import FORMING, IMPORTING, LOADING, Reporter
from ..wire.protocol import STACKS_SIGNAL, Bootstrap, Field, Kind, Method, Status
from ..worker import import_worker_class
from . import collective_wait, flight_recorder
from .group import Rendezvous, block_rank_signals, watch_abort
from .memory import CALLER, Inbox, RankMemory

log = logging.getLogger("reactor_dist")  # its records reach the caller's logging (log_records.py)


def watch_runner(pid: int, on_death) -> None:
    """Call ``on_death`` as soon as the runner process is gone, whatever killed it."""
    def wait() -> None:
        try:
            fd = os.pidfd_open(pid)
            select.select([fd], [], [])
        except (AttributeError, OSError):
            while psutil.pid_exists(pid):
                time.sleep(0.1)
        on_death()

    threading.Thread(target=wait, name="reactor-dist-runner-watch", daemon=True).start()


class RankServer:
    """Serves one rank: handshake, init, then one call at a time until shutdown."""

    def __init__(self, boot: Bootstrap) -> None:
        self.boot = boot
        self.rank = boot.rank
        self.world_size = boot.world_size
        self.channel = framing.Channel(boot.secret)
        self.worker: Any = None
        self.device = "cpu"  # chosen in init()
        self.last_seq = 0
        # A rank that raised in a call may have left collectives its peers are still in:
        # it starts no later call (they wait in ``held``) until every rank answered that
        # one (Kind.ANSWERED) or a restart dropped it, else the next call's collectives
        # would pair with the old call's and hand out a wrong result.
        self.raised_in = 0
        self.held: collections.deque[tuple[dict[str, Any], list]] = collections.deque()
        # Rank 0's results (owned here); the runner's inputs (mapped here, copy-on-write).
        # A spare has neither until it takes a rank's place (take_place).
        self.memory: RankMemory | None = None if boot.spare else self.new_memory()
        self.inside = 0.0  # seconds inside the running generator step (run_steps)
        self.digest: transfer.Digest | None = None  # rank 0, asked: of what it hands over
        self.waits: collective_wait.CollectiveWaits | None = None  # with a group
        self.progress = Reporter(self.send)  # Kind.PROGRESS during start-up
        # Kind.READY as sent: the runner re-sends INIT until it hears from us, and a
        # repeated INIT gets this again (load() runs once).
        self.ready: tuple[dict[str, Any], list] | None = None
        self.epoch = 0  # the group's generation: +1 per restart the rank survives
        self.rejoined: tuple[dict[str, Any], list] = ({}, [])  # Kind.REJOINED as sent
        # Payloads from this size on go through shared memory, where the runner has it.
        self.inline_limit = transfer.INLINE_LIMIT if boot.shared_memory else transfer.IN_BAND

    # -- plumbing ------------------------------------------------------------------
    def connect(self) -> None:
        self.ctx = zmq.Context()
        self.sub = framing.bounded(self.ctx.socket(zmq.SUB))
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.push = framing.bounded(self.ctx.socket(zmq.PUSH))
        self.push.setsockopt(zmq.LINGER, 2000)
        for sock in (self.sub, self.push):
            self.secure(sock)
        self.sub.connect(self.boot.cmd_addr)
        self.push.connect(self.boot.reply_addr)
        self.push_send = framing.direct_send(self.push)
        if self.memory is not None:
            self.inbox = self.memory.inbox = Inbox(self.channel, self.sub,
                                                   self.memory.on_memory)

    def secure(self, sock: zmq.Socket) -> None:
        """Over TCP from another node: CurveZMQ, as this rank's host's key (ray_host.py)."""
        if self.boot.curve is not None:
            server, public, secret = self.boot.curve
            sock.curve_serverkey, sock.curve_publickey = server, public
            sock.curve_secretkey = secret

    def new_memory(self) -> RankMemory:
        memory = RankMemory(self.boot, self.rank, self.send)
        self.results, self.inputs = memory.results, memory.inputs
        return memory

    def send(self, header: dict[str, Any], body: list | tuple = ()) -> None:
        header[Field.RANK] = self.rank
        self.channel.send(self.push_send, header, body)

    def on_runner_death(self) -> None:
        """Kill first, clean up after: whatever the cleanup meets, the group ends."""
        try:
            for child in psutil.Process().children(recursive=True):
                try:
                    child.kill()
                except psutil.Error:
                    pass
            if not self.boot.shared_memory or not self.private_dir():
                # Another node's runner, or a joiner's (placement.joiner): what the runner holds
                # is not ours to remove (finally: exit).
                return
            segments.remove_prefix(self.boot.shm_dir, self.boot.shm_prefix)
            # The runner's private ipc directory too: nobody else will ever remove it.
            shutil.rmtree(self.private_dir(), ignore_errors=True)
        finally:
            os.killpg(os.getpgrp(), signal.SIGKILL)
            os._exit(1)

    # -- the loop --------------------------------------------------------------------
    def run(self) -> int:
        watch_runner(self.boot.runner_pid, self.on_runner_death)
        self.connect()
        self.rendezvous = Rendezvous(self.boot, self.private_dir())
        watch_abort(self.rendezvous)
        if self.boot.spare:
            if not self.wait_as_spare():
                self.close()
                return 0
            port = 0  # it took a place: its REJOIN opens rank 0's store, where it is rank 0
        else:
            port = self.open_rendezvous()
        while True:
            if self.held and self.inbox.over(self.raised_in):
                self.start_call(*self.held.popleft())
                continue
            message = self.inbox.next(self.memory.idle_wait_ms())
            if message is None:
                self.memory.trim()  # no command for IDLE_RETURN seconds
                continue
            header, body = message
            kind = header[Field.KIND]
            if kind == Kind.CALL:  # the common command first
                if header[Field.SEQ] > self.last_seq:
                    self.last_seq = header[Field.SEQ]
                    if self.held or not self.inbox.over(self.raised_in):
                        self.held.append(message)
                    else:
                        self.start_call(header, body)
            elif kind == Kind.PING:
                self.send({Field.KIND: Kind.PONG, Field.SEQ: header[Field.SEQ],
                           Field.PID: os.getpid(), Field.PORT: port})
            elif kind in (Kind.INIT, Kind.REJOIN) and \
                    self.rank not in header.get(Field.RANKS, (self.rank,)):
                continue  # a restart's command for the other ranks
            elif kind == Kind.INIT and self.ready is None:
                self.init(header)
            elif kind == Kind.REJOIN and header.get(Field.EPOCH, 0) > self.epoch:
                self.rejoin(header)
            elif kind in (Kind.INIT, Kind.REJOIN):  # a repeat gets the same answer again
                again, again_body = self.ready if kind == Kind.INIT else self.rejoined
                self.send(dict(again), list(again_body))
            elif kind == Kind.SHUTDOWN:
                break
        self.close()
        return 0

    # -- a spare -----------------------------------------------------------------------
    def wait_as_spare(self) -> bool:
        """A spare: load() now, with no rank and no group, tell the runner's spare
        socket, then read every command (a spare's pipe must never fill: the bus would
        stop for the ranks) until a REJOIN gives this process a rank's place (True:
        it goes on as that rank) or a SHUTDOWN comes (False)."""
        slot = self.boot.rank
        tell = framing.bounded(self.ctx.socket(zmq.PUSH))
        tell.setsockopt(zmq.LINGER, 1000)
        self.secure(tell)
        tell.connect(self.boot.spare_addr)
        loaded: dict[str, Any] = {Field.KIND: Kind.READY, Field.SEQ: 0, Field.RANK: slot,
                                  Field.STATUS: Status.OK, Field.PID: os.getpid()}
        body: list = []
        try:
            self.device = loaded[Field.DEVICE] = choose_device(
                self.boot.device, slot, self.boot.device_index)
            began = time.perf_counter()
            self.worker = self.boot_worker(self.device, rank=None)
            loaded[Field.LOAD_SECONDS] = time.perf_counter() - began
            if self.boot.init_process_group and self.world_size > 1:
                import torch.distributed  # noqa: F401  (now, not on the takeover's path)
        except BaseException as exc:
            loaded[Field.STATUS], loaded[Field.ERROR] = Status.RAISED, describe(exc)
            body = [pickle_exception(exc) or b""]
        self.channel.send(tell.send, loaded, body)
        tell.close()
        if loaded[Field.STATUS] != Status.OK:
            return False  # the runner ends this process; nothing to wait for
        seen = 0  # the last CALL sent while a spare: it and every one before are not ours
        while True:
            try:
                header, _ = self.channel.recv(self.sub)
            except framing.ProtocolError:
                continue
            kind = header[Field.KIND]
            if kind == Kind.SHUTDOWN:
                return False
            if kind in (Kind.CALL, Kind.DROP):
                seen = max(seen, header[Field.SEQ])
            elif kind == Kind.REJOIN:
                place = dict(map(tuple, header.get(Field.TAKERS) or ()))
                if slot in place:
                    self.take_place(place[slot], seen, (header, []))
                    return True

    def take_place(self, rank: int, seen: int, rejoin: tuple[dict[str, Any], list]) -> None:
        """This spare becomes rank ``rank``; the REJOIN that said so is the first command
        of its loop (it joins the group and runs ``rejoin()`` there, as a kept rank)."""
        self.rank = rank
        self.boot = self.rendezvous.boot = dataclasses.replace(self.boot, rank=rank,
                                                                spare=False)
        os.environ["RANK"] = str(rank)
        self.memory = self.new_memory()
        self.memory.device = self.device
        self.inbox = self.memory.inbox = Inbox(self.channel, self.sub, self.memory.on_memory)
        self.inbox.dropped = self.inbox.answered = self.last_seq = seen
        self.inbox.backlog.append(rejoin)
        worker = self.worker
        worker.rank, worker.is_spare = rank, False
        if rank == 0:
            worker._reactor_allocate = self.memory.shared_empty
        worker._reactor_to_device = self.memory.to_device

    def start_call(self, header: dict[str, Any], body: list) -> None:
        """Run one CALL, or skip it if a restart dropped it already."""
        seq = header[Field.SEQ]
        if (header.get(Field.BEHIND) or seq <= self.inbox.dropped) and self.inbox.skips(seq):
            self.memory.skipped(header)
        elif self.call(header, body) == Status.RAISED:
            self.raised_in = seq

    def record_collectives(self, device: str) -> None:
        """Once the group formed: its collectives timed and recorded in this rank's ring
        (collective_wait), and torch's flight recorder written there when asked."""
        self.waits = collective_wait.install(device, self.ring_path(), self.world_size)
        if self.waits.ring is not None:
            flight_recorder.answer(self.waits.ring, device)

    def ring_path(self) -> str:
        """This rank's collective ring, made by the caller (collective_ring)."""
        return os.path.join(self.boot.shm_dir, ring_name(self.boot.shm_prefix, self.rank))

    def private_dir(self) -> str:
        """The runner's private 0700 directory (it holds the sockets and the store);
        "" for a rank on another node than the runner."""
        if not self.boot.cmd_addr.startswith("ipc://"):
            return ""
        return os.path.dirname(self.boot.cmd_addr.removeprefix("ipc://"))

    def open_rendezvous(self) -> int:
        """The port of rank 0's store where the group spans nodes, else 0 (see group.py).

        Every rank imports torch here, before the handshake, so that the ranks pay
        for the import side by side rather than one after the other."""
        if self.boot.init_process_group and self.world_size > 1:
            self.progress.phase(IMPORTING)
            import torch.distributed  # noqa: F401
            return self.rendezvous.open()
        return 0

    def init(self, header: dict[str, Any]) -> None:
        reply: dict[str, Any] = {Field.KIND: Kind.READY, Field.SEQ: header[Field.SEQ],
                                 Field.STATUS: Status.OK}
        body: list = []
        try:
            port = header.get(Field.PORT) or 0
            if port:
                os.environ["MASTER_PORT"] = str(port)
            device = reply[Field.DEVICE] = choose_device(self.boot.device, self.rank,
                                                         self.boot.device_index)
            self.device = self.memory.device = device
            began = time.perf_counter()
            if self.boot.init_process_group and self.world_size > 1:
                self.progress.phase(FORMING)
                self.epoch = self.rendezvous.epoch = header.get(Field.EPOCH, 0)
                self.rendezvous.form_group(device, port)
                reply[Field.GROUP_SECONDS] = time.perf_counter() - began
                self.record_collectives(device)
            self.progress.phase(LOADING)
            began = time.perf_counter()
            self.worker = self.boot_worker(device, self.rank)
            reply[Field.LOAD_SECONDS] = time.perf_counter() - began
            if self.boot.init_process_group and self.world_size > 1:
                self.rendezvous.serve_calls()
        except BaseException as exc:
            reply[Field.STATUS], reply[Field.ERROR] = Status.RAISED, describe(exc)
            body = [pickle_exception(exc) or b""]
        self.ready = (dict(reply), list(body))
        self.send(reply, body)

    def rejoin(self, header: dict[str, Any]) -> None:
        """restart(): this rank keeps its worker.  It leaves the old torch group, joins the new
        one (with the replaced ranks, which form it in their INIT), and runs the worker's
        ``rejoin()`` to rebuild what depends on the group."""
        self.epoch = header[Field.EPOCH]
        reply: dict[str, Any] = {Field.KIND: Kind.REJOINED, Field.SEQ: 0,
                                 Field.EPOCH: self.epoch, Field.STATUS: Status.OK}
        body: list = []
        def ack(port: int) -> None:  # the REJOIN arrived (rank 0 across nodes: its store)
            self.send({Field.KIND: Kind.PROGRESS, Field.SEQ: 0, Field.PHASE: FORMING,
                       Field.PORT: port})

        address = header.get(Field.ADDRESS)
        if address:  # across nodes: rank 0's store is there (a spare may have taken rank 0)
            self.boot = self.rendezvous.boot = dataclasses.replace(self.boot,
                                                                    master_addr=address)
        try:
            if self.boot.init_process_group and self.world_size > 1:
                reply[Field.GROUP_SECONDS] = self.rendezvous.rejoin(
                    self.device, self.epoch, header.get(Field.PORT) or 0, ack)
                # a spare's first group, or a kept rank (its ring again: the rank it is)
                self.record_collectives(self.device)
            else:
                ack(0)
            began = time.perf_counter()
            hook = getattr(self.worker, "rejoin", None)
            if hook is not None:
                hook()
            reply[Field.LOAD_SECONDS] = time.perf_counter() - began
        except BaseException as exc:
            reply[Field.STATUS], reply[Field.ERROR] = Status.RAISED, describe(exc)
            body = [pickle_exception(exc) or b""]
        self.rejoined = (dict(reply), list(body))
        self.send(reply, body)

    def boot_worker(self, device: str, rank: int | None) -> Any:
        """The worker, loaded as rank ``rank`` (None: a spare's, with no rank yet)."""
        cls = import_worker_class(self.boot.worker)
        worker = cls()
        worker.rank, worker.world_size, worker.device = rank, self.world_size, device
        worker.is_spare = rank is None
        if rank == 0 and self.memory is not None:
            worker._reactor_allocate = self.memory.shared_empty
        if self.memory is not None:
            worker._reactor_to_device = self.memory.to_device
        worker._reactor_progress = self.progress.report
        worker.load(**pickle.loads(self.boot.load_kwargs))
        return worker

    # -- one call ------------------------------------------------------------------------
    def call(self, header: dict[str, Any], body: list) -> str:
        """Run one call and send its REPLY; its status."""
        self.memory.apply(header)
        self.memory.call_seq = header[Field.SEQ]
        self.results.new_call()
        logged = log_records.written()
        reply: dict[str, Any] = {Field.KIND: Kind.REPLY, Field.SEQ: header[Field.SEQ],
                                 Field.STATUS: Status.OK}
        payload: list = []
        error: BaseException | None = None
        value = result = None
        method = header[Field.METHOD]
        generate = method == Method.GENERATE
        named = method not in Method.BUILT_IN  # a worker method by name (runner.call)
        # Who sends a result: rank 0, or with call_all (Field.ALL) every rank.
        delivers = (generate or named) and (self.rank == 0 or bool(header.get(Field.ALL)))
        # Sessions (reactor_dist.caller.session): rank 0 digests what it hands over, when asked.
        self.digest = transfer.Digest() if (generate or named) and self.rank == 0 and \
            header.get(Field.DIGEST) else None
        began = 0.0
        if self.waits is not None:
            self.waits.begin(header[Field.SEQ])
        try:
            if method == Method.SNAPSHOT:
                began = time.perf_counter()
                payload = self.snapshot(reply)
            elif method == Method.RESTORE:
                began = time.perf_counter()
                self.restore(header, body)
                wait_for_device(self.device)
            elif generate:
                value = transfer.decode(header.get(Field.DESCRIPTORS), body, self.memory.input_base)
                began = time.perf_counter()
                result = self.worker.generate(value)
                del value
                if isinstance(result, GeneratorType):
                    started, began = time.perf_counter() - began, 0.0
                    try:
                        reply[Field.ITEMS], error = self.run_steps(header[Field.SEQ], result)
                    finally:
                        reply[Field.COMPUTE] = started + self.inside
                    result = None
                    if error is not None:
                        reply[Field.STATUS] = Status.UNDELIVERABLE
                elif self.device != "cpu":
                    wait_for_device(self.device)  # the timing ends when the GPU is done
            elif named:
                args, kwargs = transfer.decode(header.get(Field.DESCRIPTORS), body,
                                               self.memory.input_base)
                function = self.worker_method(method)
                began = time.perf_counter()
                result = function(*args, **kwargs)
                del args, kwargs
                wait_for_device(self.device)
            else:
                began = time.perf_counter()
                self.worker.reset()
                wait_for_device(self.device)
        except SharedMemoryExhausted as exc:
            # shared_empty() allocates on rank 0 alone: a full /dev/shm there is a
            # delivery failure, not a disagreement between ranks (the others never
            # allocate). Anywhere else it is an exception like any other.
            reply[Field.STATUS] = Status.UNDELIVERABLE if self.rank == 0 else Status.RAISED
            error = exc
            value = result = None
        except BaseException as exc:
            reply[Field.STATUS], error = Status.RAISED, exc
            value = result = None
        if began:
            reply[Field.COMPUTE] = time.perf_counter() - began
        if self.waits is not None:  # read after wait_for_device: the events are done
            reply[Field.COLLECTIVE_WAIT] = self.waits.take()
        if error is None and delivers and Field.ITEMS not in reply:
            try:
                descriptors, payload, _ = transfer.encode(
                    result, self.results, lambda: f"the result of {method}() on rank {self.rank}",
                    holders=(CALLER,), reuse_segments=True, inline_limit=self.inline_limit,
                    verb="return", digest=self.digest, staging=self.memory.staging)
                if descriptors:
                    reply[Field.DESCRIPTORS] = descriptors
            except BaseException as exc:
                reply[Field.STATUS], error = Status.UNDELIVERABLE, exc
        if self.digest is not None and error is None:
            reply[Field.DIGEST] = self.digest.digest()
        del result
        if error is not None:
            reply[Field.ERROR] = describe(error)
            if context_broken(error, self.device):  # the runner replaces this process
                reply[Field.BROKEN] = True
            payload = [pickle_exception(error) or b""]
            error = None
        if log_records.written() != logged:  # the caller takes them in before it returns
            reply[Field.LOGGED] = True
        self.memory.tell(reply, released=True)
        self.send(reply, payload)
        self.memory.check_written_views()
        return reply[Field.STATUS]

    def worker_method(self, name: str) -> Any:
        """The worker's public method ``name`` (the caller checked the class; this
        instance may differ): an AttributeError, the same on every rank, where it has
        none."""
        function = None if name.startswith("_") else getattr(self.worker, name, None)
        if not callable(function):
            raise AttributeError(f"{type(self.worker).__qualname__} has no public method "
                                 f"{name!r} on rank {self.rank}")
        return function

    def snapshot(self, reply: dict[str, Any]) -> list:
        """Sessions: this rank's ``snapshot()``, into its snapshot pool (the caller holds
        it); every rank sends its own.  Its payload frames."""
        state = self.worker.snapshot()
        descriptors, payload, _ = transfer.encode(
            state, self.memory.snapshots, f"the snapshot() of rank {self.rank}",
            holders=(CALLER,), inline_limit=self.inline_limit, verb="return")
        if descriptors:
            reply[Field.DESCRIPTORS] = descriptors
        return payload

    def restore(self, header: dict[str, Any], body: list) -> None:
        """Sessions: ``restore()`` this rank's part of a snapshot (Field.STATES), read into
        this process's own memory."""
        first, count, descriptors = header[Field.STATES][self.rank]
        state = transfer.decode(descriptors, body[first:first + count],
                                self.memory.snapshot_copy)
        self.worker.restore(state)

    def run_steps(self, seq: int, steps: Any) -> tuple[int, BaseException | None]:
        """Run a generator worker's step to its end (its collectives are inside it); rank
        0 sends each item as it is yielded.  An item rank 0 cannot send is a delivery
        failure: the rest of the step still runs, its items are not sent.  Returns how
        many items were yielded and the delivery failure, if any; ``self.inside`` adds
        up the seconds spent inside the generator (sending items is not counted), each
        part until the rank's GPU is done with it."""
        count, failure = 0, None
        self.inside, began = 0.0, time.perf_counter()
        try:
            for item in steps:
                wait_for_device(self.device)
                self.inside += time.perf_counter() - began
                index, count = count, count + 1
                if self.rank == 0 and failure is None:
                    failure = self.send_item(seq, index, item)
                del item
                self.inbox.drain()  # the caller's releases: the next items reuse them
                began = time.perf_counter()
            wait_for_device(self.device)  # the work after the last item
        finally:  # the last next(): the generator ran out or raised
            self.inside += time.perf_counter() - began
            steps.close()
        return count, failure

    def send_item(self, seq: int, index: int, item: Any) -> BaseException | None:
        """Rank 0 sends one item; the delivery failure, if it cannot."""
        try:
            descriptors, payload, _ = transfer.encode(
                item, self.results, lambda: f"item {index} of generate() on rank 0",
                holders=(CALLER,),
                reuse_segments=True, inline_limit=self.inline_limit, verb="yield",
                digest=self.digest, staging=self.memory.staging)
        except Exception as exc:  # as for a result: no room, over the bound, no pickle
            return exc
        del item
        message: dict[str, Any] = {Field.KIND: Kind.ITEM, Field.SEQ: seq, Field.INDEX: index}
        if descriptors:
            message[Field.DESCRIPTORS] = descriptors
        self.memory.tell(message)
        self.send(message, payload)
        return None

    def close(self) -> None:
        self.worker = None
        dist = sys.modules.get("torch.distributed")  # never import torch just to leave
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if self.memory is not None:
            self.memory.close()
        self.sub.close(linger=0)
        self.push.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="reactor-dist-rank",
        description=(
            "Runs one rank of a reactor_dist DistributedRunner: imports the worker class, "
            "joins the runner's ZeroMQ bus and the torch group (torch.distributed), calls "
            "load() once, then serves generate()/reset() until shutdown. The runner starts "
            "it with its configuration (and a per-runner secret) on stdin. Started by "
            "another launcher (torchrun, srun) with --join ADDRESS --worker MODULE:CLASS "
            "(placement='external'), it joins that runner instead (python -m "
            "reactor_dist.placement.joiner --help tells more). Wrap it with the runner's "
            "launch_prefix option, e.g. launch_prefix=[sys.executable, '-m', "
            "'reactor_dist.numa', '{rank}'] (the CPUs of the rank's GPU's NUMA node)."
        ),
    )
    argv = sys.argv[1:] if argv is None else argv
    if any(arg == "--join" or arg.startswith("--join=") for arg in argv):
        # A rank another launcher started (torchrun, srun): this process becomes its
        # joiner, the runner's agent on this node, which starts the rank as its child.
        os.execv(sys.executable, [sys.executable, "-m", "reactor_dist.placement.joiner",
                                  *argv])
    parser.parse_args(argv)
    block_rank_signals()  # before any thread: they all inherit the mask
    faulthandler.enable(all_threads=True)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the runner asks on a timeout
    boot = Bootstrap.read(sys.stdin.buffer)
    sys.stdin.close()
    sys.path[:] = boot.sys_path + [p for p in sys.path if p not in boot.sys_path]
    server = RankServer(boot)
    if boot.log_levels is not None:  # before the worker's import: its records too
        log_records.install(boot.log_levels, lambda: server.rank)
    return server.run()


def leave(code: int) -> NoReturn:
    """End the rank without the interpreter's teardown, which with torch loaded costs
    about 0.5 s of CPU per rank (and on a GPU is where CUDA's and NCCL's own teardown
    can hang or crash).  What a program may count on at exit still happens: the atexit
    handlers run (logging's flush among them) and stdout and stderr are flushed.  The
    worker was already let go (RankServer.close), so its own finalizers have run."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    leave(main())
