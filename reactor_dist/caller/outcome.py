"""The error contract as one pure function: what each rank did -> what the caller gets.

The contract's table is stated once, in docs/errors-and-recovery.md ("The error
contract"); :func:`judge` decides its rows for a call whose every rank answered. An
undeliverable result (rank 0's; with ``call_all`` any rank's) beside other ranks'
exceptions is judged as one more exception. Crashes and timeouts never get here: the
supervisor raises them while it waits (:mod:`reactor_dist.caller.supervisor`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..errors import CudaContextBroken, RankDesync, RankFailure
from ..wire.protocol import Status
from .fault_log import first_line


class Outcome(NamedTuple):
    """What one rank did in one call, as the caller sees it."""

    status: str  # Status.OK, RAISED or UNDELIVERABLE
    value: Any = None  # rank 0's decoded result, when every rank returned
    error: BaseException | None = None  # the rank's exception, rebuilt in the caller
    error_type: str = ""  # its type's name as the rank saw it
    failure: RankFailure | None = None  # the rank's record, when it raised (RankDesync's)
    broken: bool = False  # its CUDA context broke in the raise (Field.BROKEN): it is lost


RETURNED = Outcome(Status.OK)
# The end of every RankDesync's message.
UNUSABLE_ENDING = ("; the runner is unusable: runner.restart() brings its ranks back "
            "(DistributedRunner(max_restarts=N) restarts it by itself)")


class Verdict(NamedTuple):
    value: Any
    error: BaseException | None  # raise this, when set
    breaks: bool  # the runner is unusable from now on


def judge(method: str, outcomes: Sequence[Outcome],
          collectives: Callable[[], Any] = lambda: None) -> Verdict:
    """The caller's answer to one call whose every rank answered (index = rank).
    ``collectives()`` (a collective_ring.Report of the call, asked only when a rank did
    not return): ranks that called different collectives, or passed them different
    tensors, are out of step even when each raised the same exception."""
    world_size = len(outcomes)
    if [o.status for o in outcomes].count(Status.OK) == world_size:
        return Verdict(outcomes[0].value, None, False)
    lost = {r: o for r, o in enumerate(outcomes) if o.broken}
    if lost:  # before any comparison: such a rank cannot run another step
        return Verdict(None, context_broken(method, lost), True)
    collectives = collectives()
    lead = lines = ""
    if collectives is not None:
        lead = f"{collectives.headline}\n" if collectives.headline else ""
        lines = f"\nthe ranks' collectives:{collectives.text()}"
    failed = {r: o for r, o in enumerate(outcomes) if o.status == Status.RAISED}
    undelivered = {r: o for r, o in enumerate(outcomes) if o.status == Status.UNDELIVERABLE}
    if undelivered:  # rank 0's result (or, for call_all, any rank's) could not be sent
        if not failed:  # every rank finished the step; only delivery failed: in step
            return Verdict(None, next(iter(undelivered.values())).error, False)
        failed = dict(sorted({**undelivered, **failed}.items()))
    if not failed:  # a status we do not know: the ranks did not all return
        failed = {r: o for r, o in enumerate(outcomes) if o.status != Status.OK}
    errors = {r: o.error for r, o in failed.items()}
    if len(failed) == world_size:
        types = {r: o.error_type for r, o in failed.items()}
        if len(set(types.values())) == 1:
            if collectives is None or not collectives.differ:
                return Verdict(None, errors[0], False)
            desync = RankDesync(f"{lead}every rank raised {types[0]} in {method}(), but "
                                f"in different collectives: the ranks are out of step"
                                f"{UNUSABLE_ENDING}{lines}")
        else:
            named = ", ".join(f"rank {r} raised {t}" for r, t in types.items())
            desync = RankDesync(f"{lead}ranks raised different exception types in "
                                f"{method}(): {named}{UNUSABLE_ENDING}{lines}")
    else:
        first = next(iter(failed))
        returned = [r for r in range(world_size) if r not in failed]
        desync = RankDesync(
            f"{lead}rank {first} raised {failed[first].error_type} in {method}() while rank "
            f"{', '.join(map(str, returned))} returned: the ranks are out of step"
            f"{UNUSABLE_ENDING}{lines}")
    desync.__cause__ = next(iter(errors.values()))
    desync.rank_errors = errors
    desync.failures = tuple(
        o.failure if collectives is None else
        dataclasses.replace(o.failure, collective=collectives.lines.get(o.failure.rank))
        for o in failed.values() if o.failure is not None)
    return Verdict(None, desync, True)


def context_broken(method: str, lost: dict[int, Outcome]) -> CudaContextBroken:
    """The error of a call in which ranks broke their CUDA context (``lost``, by rank)."""
    said = "; ".join(f"rank {r}: {o.error_type}: {first_line(o.error) if o.error else ''}"
                     for r, o in lost.items())
    which = f"rank {next(iter(lost))}" if len(lost) == 1 else \
        f"ranks {', '.join(map(str, lost))}"
    error = CudaContextBroken(
        f"the CUDA context of {which} is broken in {method}() ({said}): every later CUDA "
        f"call of that process would fail, so the restart replaces it (with a spare where "
        f"one waits) and the other ranks keep theirs{UNUSABLE_ENDING}")
    error.__cause__ = next(iter(lost.values())).error
    error.failures = tuple(o.failure for o in lost.values() if o.failure is not None)
    return error
