"""``python -m benchmarks.chaos`` (``make chaos SECONDS=300 SEED=...``): a chaos soak.

For ``--seconds`` it runs one runner after another (scenario x world_size 2, 3, each for
``--lifetime`` seconds) and injects a fault every 1-4 s: SIGKILL of a rank, SIGSTOP of a
rank past the call timeout (then SIGCONT), a raise on one rank or on all, a hang, a
desync (ranks raising different types), ``os._exit``.  Scenarios: ``pipelined``
(``submit()``, ``max_in_flight`` 2-3), ``stream`` (streams read to the end or left early,
a call or a stream queued behind), ``asyncio`` (``agenerate``/``astream`` tasks cancelled
at random).  Every runner has ``max_restarts`` set and a torch gloo group with an
all_reduce in every item (benchmarks/chaos_workers.py: every answer is exact and shows a
mis-paired collective); most define ``rejoin()``.

It fails (exit 1) on any wrong result or stream item, on anything left behind after a
runner's shutdown (processes, /dev/shm entries, ipc dirs), and, with ``--strict``, on an
exception type the error contract does not allow (else those are counted and shown).
Every wait runs under a watchdog: a call, ``restart()`` or ``shutdown()`` past its bound
dumps every thread's stack and exits 3.  The seed is printed; the same seed replays the
same plan (which faults, scenarios and inputs; their timing still varies).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from benchmarks import chaos_checks as checks
from benchmarks.chaos_checks import Faults, Watchdog
from benchmarks.chaos_workers import ChaosRejoins, ChaosWorker, expected, fires_here
from reactor_dist import DistributedRunner

SCENARIOS = ("pipelined", "stream", "asyncio")


@dataclass
class Tally:
    """One cell's (scenario, world_size) counts over its lifetimes."""

    lifetimes: int = 0
    calls: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    items: int = 0  # stream items checked
    faults: collections.Counter = field(default_factory=collections.Counter)
    restart_seconds: list[float] = field(default_factory=list)
    kept: int = 0
    replaced: int = 0
    taken: int = 0  # ranks whose place a spare took (--spares)
    restart_failed: int = 0  # "the runner could not restart" log records
    restart_cut: int = 0  # the same, as shutdown() ended a restart in progress
    explicit: int = 0  # restart() calls the harness made (an unusable runner)
    leftovers: list[str] = field(default_factory=list)


class Soak:
    """The whole run: its tallies, what went wrong, and the one runner alive now."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.args, self.seed = args, seed
        self.tallies: dict[tuple[str, int], Tally] = {}
        self.tally = Tally()
        self.cell = ("", 0)
        self.life = 0
        self.wrong: list[str] = []
        self.unexpected: collections.Counter = collections.Counter()
        self.samples: dict[str, str] = {}
        self.fatal: list[str] = []
        self.faults: Faults | None = None  # the fault clock of the runner alive now
        ct, st, grace = args.call_timeout, args.start_timeout, args.shutdown_grace
        self.bound_call = 4 * ct + 30  # a turn, a restart, the wait behind, the run: each <= ct
        self.bound_restart = 2 * st + grace + 30  # restart() may wait for one in progress
        self.bound_start = st + 30
        self.bound_shutdown = grace + 45  # a restart's give-up (10 s), grace, SIGTERM + 2 s
        self.watchdog = Watchdog(self.stuck)
        checks.watch_restarts(self.on_restart_record, args.verbose)

    # -- accounting -------------------------------------------------------------------------
    def on_restart_record(self, record: Any) -> None:
        """The runner's WARNING for each restart (extra: restart, replaced, kept,
        restart_seconds), or its ERROR when a restart failed."""
        t = self.tally
        if hasattr(record, "restart_seconds"):
            t.restart_seconds.append(record.restart_seconds)
            t.kept += len(record.kept)
            t.replaced += len(record.replaced)
            t.taken += len(record.taken)
        elif "shut down" in record.getMessage():
            t.restart_cut += 1
        else:
            t.restart_failed += 1
            if self.args.verbose:
                print(f"  {record.getMessage().splitlines()[0][:300]}", flush=True)

    def where(self, spec: dict | None = None) -> str:
        scenario, ws = self.cell
        fault = f" fault={spec['fault']}" if spec and spec["fault"] else ""
        tag = f" call tag={spec['tag']} value={spec['value']} items={spec['items']}" \
            if spec else ""
        return f"seed {self.seed} lifetime {self.life} {scenario} ws={ws}:{tag}{fault}"

    def outcome(self, key: str) -> None:
        self.tally.outcomes[key] += 1

    def bad(self, spec: dict, what: str) -> None:
        line = f"WRONG {self.where(spec)}: {what}"
        print(line, flush=True)
        self.wrong.append(line)

    def error(self, spec: dict, exc: BaseException, wrong_before: bool = False) -> bool:
        """Count ``exc`` as this call's outcome; True if the runner said "unusable"
        (the harness then restarts it)."""
        key, allowed = checks.classify(exc, spec["fault"])
        if key in checks.NOT_SENT and spec["fault"] is not None and self.faults:
            self.faults.put_back(spec["fault"])
        if not allowed:
            self.unexpected[key] += 1
            if key not in self.samples:
                self.samples[key] = f"{self.where(spec)}\n" + "".join(
                    traceback.format_exception(exc))[-4000:]
                print(f"UNEXPECTED {key} at {self.where(spec)}", flush=True)
        self.outcome("wrong" if wrong_before else key)
        return key == "RuntimeError: unusable"

    def judge_result(self, spec: dict, result: Any) -> None:
        ws = self.cell[1]
        want = expected(ws, spec["tag"], spec["value"], 0)
        if spec["fault"] is not None:
            self.bad(spec, f"returned {result!r} although a rank fires its fault")
        elif result != want:
            self.bad(spec, f"returned {result!r}, want {want!r}")
        else:
            self.outcome("correct")
            return
        self.outcome("wrong")

    def judge_item(self, spec: dict, i: int, item: Any) -> bool:
        """True if item ``i`` of the stream is right (and may come at all)."""
        self.tally.items += 1
        ws, fault = self.cell[1], spec["fault"]
        if fault is not None:
            k = fault["item"]
            last = k if fault["where"] == "after_collective" and not fires_here(
                fault, 0, k, "after_collective") else k - 1
            if i > last:
                self.bad(spec, f"item {i} ({item!r}) came although the fault fires at "
                               f"item {k} {fault['where']}")
                return False
        want = expected(ws, spec["tag"], spec["value"], i)
        if item != want:
            self.bad(spec, f"item {i} is {item!r}, want {want!r}")
            return False
        return True

    def judge_end(self, spec: dict, count: int) -> bool:
        if spec["fault"] is not None:
            self.bad(spec, f"ended normally after {count} items although a rank fires "
                           f"its fault")
            return False
        if count != spec["items"]:
            self.bad(spec, f"ended after {count} items, want {spec['items']}")
            return False
        return True

    def stuck(self, what: str, seconds: float) -> None:
        """The watchdog's verdict: print what is known, end what we started, exit 3."""
        print(f"\nSTUCK {self.where()}: {what} did not end within {seconds:.0f} s; "
              f"every thread's stack:", flush=True)
        checks.dump_stacks()
        self.fatal.append(f"stuck: {what}")
        self.report()
        checks.end_everything()
        os._exit(3)

    # -- one runner's life -----------------------------------------------------------------------
    def spec(self, rng: random.Random, faults: Faults, items: int | None) -> dict:
        fault = faults.take()
        if fault is not None:
            fault["where"] = rng.choice(["before_collective", "after_collective"])
            fault["item"] = rng.randrange(items) if items else 0
        return {"tag": rng.getrandbits(40), "value": rng.randrange(1000), "items": items,
                "work": rng.choice([0, 0.002, 0.01, 0.03]), "fault": fault}

    def lifetime(self, scenario: str, ws: int, rng: random.Random, until: float) -> None:
        args = self.args
        self.cell = (scenario, ws)
        self.tally = self.tallies.setdefault(self.cell, Tally())
        self.tally.lifetimes += 1
        in_flight, budget = rng.choice([2, 3]), rng.choice([2, 1000])
        worker = ChaosRejoins if rng.random() < 0.75 else ChaosWorker
        spares = args.spares if worker is ChaosRejoins else 0  # a spare needs rejoin()
        print(f"lifetime {self.life}: {scenario} ws={ws} max_in_flight={in_flight} "
              f"max_restarts={budget} spares={spares} {worker.__name__}", flush=True)
        runner = DistributedRunner(
            worker, world_size=ws, device="cpu", call_timeout=args.call_timeout,
            start_timeout=args.start_timeout, shutdown_grace=args.shutdown_grace,
            max_in_flight=in_flight, max_restarts=budget, restart_window=600.0,
            rank_output="log", env={"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
            spares=spares)
        faults = self.faults = Faults(random.Random(rng.getrandbits(64)), ws, args.call_timeout,
                        self.tally.faults, args.faults, args.fault_every)
        try:
            try:
                with self.watchdog.bound("start()", self.bound_start):
                    runner.start()
            except Exception as exc:
                self.unexpected[f"start(): {type(exc).__name__}"] += 1
                self.samples.setdefault(f"start(): {type(exc).__name__}",
                                        "".join(traceback.format_exception(exc))[-4000:])
                return
            faults.start()
            drive = {"pipelined": self.pipelined, "stream": self.streams}.get(scenario)
            if drive is not None:
                drive(runner, rng, faults, until, in_flight)
            else:
                asyncio.run(self.tasks(runner, rng, faults, until, in_flight))
        finally:
            faults.stop()
            with self.watchdog.bound("shutdown()", self.bound_shutdown):
                runner.shutdown()
            faults.resume_stopped()
            left = checks.leftovers()
            if left:
                print(f"LEFT BEHIND {self.where()}: {left}", flush=True)
            self.tally.leftovers += left

    def restart(self, runner: DistributedRunner) -> None:
        """The runner said "unusable" (its budget spent, or a restart failed): restart()."""
        self.tally.explicit += 1
        try:
            with self.watchdog.bound("restart()", self.bound_restart):
                runner.restart()
        except Exception as exc:
            self.outcome(f"restart() raised {checks.classify(exc, None)[0]}")

    def pipelined(self, runner: DistributedRunner, rng: random.Random, faults: Faults,
                  until: float, in_flight: int) -> None:
        pending: collections.deque = collections.deque()
        unusable = False
        while time.monotonic() < until:
            if unusable:
                unusable = False
                self.restart(runner)
            spec = self.spec(rng, faults, None)
            self.tally.calls += 1
            try:
                with self.watchdog.bound("submit()", self.bound_call):
                    future = runner.submit(spec)
            except Exception as exc:
                unusable |= self.error(spec, exc)
                time.sleep(0.02)
                continue
            pending.append((spec, future))
            depth = rng.randint(1, in_flight + 1)  # one more than fits: submit() waits
            while len(pending) >= depth:
                unusable |= self.settle(*pending.popleft())
        while pending:
            self.settle(*pending.popleft())

    def settle(self, spec: dict, future: Any) -> bool:
        try:
            with self.watchdog.bound(f"result() of call {spec['tag']}", self.bound_call):
                result = future.result()
        except Exception as exc:
            return self.error(spec, exc)
        self.judge_result(spec, result)
        return False

    def streams(self, runner: DistributedRunner, rng: random.Random, faults: Faults,
                until: float, in_flight: int) -> None:
        unusable = False
        while time.monotonic() < until:
            if unusable:
                unusable = False
                self.restart(runner)
            first = self.spec(rng, faults, rng.randint(2, 6))
            self.tally.calls += 1
            try:
                with self.watchdog.bound("stream()", self.bound_call):
                    stream = runner.stream(first)
            except Exception as exc:
                unusable |= self.error(first, exc)
                time.sleep(0.02)
                continue
            behind, kind = None, rng.choice(["none", "submit", "submit", "stream"])
            if kind != "none":  # queued behind the open stream
                second = self.spec(rng, faults, None if kind == "submit" else rng.randint(2, 6))
                self.tally.calls += 1
                try:
                    with self.watchdog.bound(f"{kind}() behind a stream", self.bound_call):
                        behind = (second, runner.submit(second) if kind == "submit"
                                  else runner.stream(second))
                except Exception as exc:
                    unusable |= self.error(second, exc)
            unusable |= self.read(stream, first, rng)
            if behind is not None:
                unusable |= (self.settle(*behind) if kind == "submit"
                             else self.read(behind[1], behind[0], rng))

    def read(self, stream: Any, spec: dict, rng: random.Random) -> bool:
        """Read a stream to its end or leave it early; judge every item."""
        leave = rng.randint(1, spec["items"] - 1) if rng.random() < 0.4 else None
        count, right = 0, True
        try:
            while True:
                with self.watchdog.bound(f"item {count} of stream {spec['tag']}",
                                         self.bound_call):
                    try:
                        item = next(stream)
                    except StopIteration:
                        right &= self.judge_end(spec, count)
                        break
                right &= self.judge_item(spec, count, item)
                count += 1
                if leave is not None and count >= leave:
                    stream.close()
                    self.outcome("left early" if right else "wrong")
                    return False
        except Exception as exc:
            return self.error(spec, exc, wrong_before=not right)
        self.outcome("correct" if right else "wrong")
        return False

    async def tasks(self, runner: DistributedRunner, rng: random.Random, faults: Faults,
                    until: float, in_flight: int) -> None:
        loop = asyncio.get_running_loop()
        running: set[asyncio.Task] = set()
        self.unusable = False
        while time.monotonic() < until:
            if self.unusable:
                self.unusable = False
                self.tally.explicit += 1
                try:
                    with self.watchdog.bound("arestart()", self.bound_restart):
                        await runner.arestart()
                except Exception as exc:
                    self.outcome(f"restart() raised {checks.classify(exc, None)[0]}")
            spec = self.spec(rng, faults, None if rng.random() < 0.6 else rng.randint(2, 6))
            leave = rng.randint(1, spec["items"] - 1) \
                if spec["items"] and rng.random() < 0.3 else None
            self.tally.calls += 1
            task = asyncio.create_task(self.one_task(runner, spec, leave))
            if rng.random() < 0.25:
                loop.call_later(rng.uniform(0, 0.3), task.cancel)
            running.add(task)
            if len(running) > in_flight:
                _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(0)
        if running:
            await asyncio.wait(running)

    async def one_task(self, runner: DistributedRunner, spec: dict, leave: int | None) -> None:
        count, right = 0, True
        try:
            if spec["items"] is None:
                with self.watchdog.bound(f"agenerate() of call {spec['tag']}",
                                         self.bound_call):
                    result = await runner.agenerate(spec)
                self.judge_result(spec, result)
                return
            stream = runner.astream(spec)
            try:
                while True:
                    with self.watchdog.bound(f"item {count} of astream {spec['tag']}",
                                             self.bound_call):
                        try:
                            item = await stream.__anext__()
                        except StopAsyncIteration:
                            right &= self.judge_end(spec, count)
                            break
                    right &= self.judge_item(spec, count, item)
                    count += 1
                    if leave is not None and count >= leave:
                        await stream.aclose()
                        self.outcome("left early" if right else "wrong")
                        return
            finally:
                stream.close()
            self.outcome("correct" if right else "wrong")
        except asyncio.CancelledError:
            self.outcome("cancelled" if right else "wrong")
        except Exception as exc:
            self.unusable |= self.error(spec, exc, wrong_before=not right)
            await asyncio.sleep(0.02)

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> int:
        args = self.args
        rng = random.Random(self.seed)
        cells = [(s, w) for s in args.scenarios for w in args.world_sizes]
        rng.shuffle(cells)
        lifetime = args.lifetime or min(90.0, max(10.0, args.seconds / (2 * len(cells))))
        began = time.monotonic()
        deadline = began + args.seconds
        try:
            while self.life == 0 or deadline - time.monotonic() > 3:
                scenario, ws = cells[self.life % len(cells)]
                until = min(deadline, time.monotonic() + lifetime)
                self.lifetime(scenario, ws, random.Random(rng.getrandbits(64)), until)
                self.life += 1
        except KeyboardInterrupt:
            print("\ninterrupted: the table so far", flush=True)
            self.fatal.append("interrupted")
        print(f"\n{time.monotonic() - began:.0f} s, {self.life} runner lifetimes")
        return self.report()

    def report(self) -> int:
        """Print the tables and the verdict; the exit status."""
        print(checks.table(self.tallies))
        for key, sample in self.samples.items():
            print(f"\nunexpected {key} ({self.unexpected[key]}x), a sample:\n{sample}")
        for line in self.wrong[:50]:
            print(line)
        leftovers = sum(len(t.leftovers) for t in self.tallies.values())
        unexpected = sum(self.unexpected.values())
        failed = bool(self.wrong or leftovers or self.fatal
                      or (self.args.strict and unexpected))
        print(f"\nchaos: {'FAIL' if failed else 'PASS'}: {len(self.wrong)} wrong results or "
              f"items, {leftovers} leftovers, {unexpected} unexpected errors"
              f"{' (fatal: --strict)' if self.args.strict else ' (counted: no --strict)'}"
              f"{'; ' + '; '.join(self.fatal) if self.fatal else ''}; seed {self.seed}: "
              f"rerun with `make chaos SECONDS={self.args.seconds:g} SEED={self.seed}`",
              flush=True)
        return 1 if failed else 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chaos",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="how long (default 300)")
    ap.add_argument("--seed", type=int, default=None, help="replay a run's plan")
    ap.add_argument("--strict", action="store_true",
                    help="an exception type the error contract does not allow fails the run "
                         "(default: counted and shown, not fatal)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    type=lambda s: [x for x in s.split(",") if x])
    ap.add_argument("--world-sizes", default="2,3",
                    type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--faults", default=",".join(checks.KINDS),
                    type=lambda s: [x for x in s.split(",") if x],
                    help=f"the kinds of fault (default: all: {','.join(checks.KINDS)})")
    ap.add_argument("--fault-every", default="1,4", metavar="LO,HI",
                    type=lambda s: tuple(float(x) for x in s.split(",")),
                    help="seconds between faults, drawn uniformly (default 1,4)")
    ap.add_argument("--lifetime", type=float, default=None,
                    help="seconds per runner (default: --seconds / 12, within 10-90)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="also print the runner's other WARNING and ERROR records")
    ap.add_argument("--spares", type=int, default=0,
                    help="spares= of the runners whose worker has rejoin() (default 0)")
    ap.add_argument("--call-timeout", type=float, default=3.0)
    ap.add_argument("--start-timeout", type=float, default=60.0)
    ap.add_argument("--shutdown-grace", type=float, default=3.0)
    args = ap.parse_args(argv)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown or not args.scenarios:
        ap.error(f"--scenarios: choose from {', '.join(SCENARIOS)}")
    if not args.faults or set(args.faults) - set(checks.KINDS):
        ap.error(f"--faults: choose from {', '.join(checks.KINDS)}")
    if len(args.fault_every) != 2 or not 0 < args.fault_every[0] <= args.fault_every[1]:
        ap.error("--fault-every: LO,HI seconds, 0 < LO <= HI")
    if not args.world_sizes or min(args.world_sizes) < 2:
        ap.error("--world-sizes: 2 or more ranks (a fault needs a peer)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 if every answer was right and nothing was left behind."""
    args = parse(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    print(f"chaos: seed {seed}, {args.seconds:g} s, scenarios {','.join(args.scenarios)}, "
          f"world sizes {','.join(map(str, args.world_sizes))}, faults "
          f"{','.join(args.faults)} every {args.fault_every[0]:g}-{args.fault_every[1]:g} s, "
          f"call_timeout "
          f"{args.call_timeout:g} s, {'strict' if args.strict else 'not strict'} "
          f"({os.cpu_count()} cores)", flush=True)
    return Soak(args, seed).run()


if __name__ == "__main__":
    sys.exit(main())
