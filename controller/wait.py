"""The one wait loop: results of group calls, failing on the first error instead of blocking on the others.

A single ``ray.get(refs)`` would block until every rank returns; if one rank dies, the others may be
stuck forever in a collective waiting for it. Waiting ref by ref with ``ray.wait`` surfaces the first
failure at once. The refs may belong to several calls in flight together (the two sides of a weight
sync: a sender stuck in a broadcast must not hide that the receivers already failed).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from controller.errors import WorkerGroupError, WorkerGroupTimeoutError


def _get_one(ref, role: str, rank: int, method: str, timeout_s: float | None = None):
    """``ray.get(ref)``, a failure raised as a WorkerGroupError naming the call (GetTimeoutError passes)."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise
    except RayTaskError as err:
        cause = getattr(err, "cause", None)
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else "the worker raised"
        raise WorkerGroupError(role, rank, method, reason, str(err)) from err
    except RayActorError as err:
        # An actor whose constructor raised reports it through the same error type.
        creation = "creation task" in str(err)
        reason = "the worker's constructor raised" if creation else "the worker actor died"
        raise WorkerGroupError(role, rank, method, reason, str(err)) from err
    except RayError as err:
        raise WorkerGroupError(role, rank, method, f"{type(err).__name__}", str(err)) from err


def wait_for_results(
    refs: Sequence[ray.ObjectRef],
    ranks: Sequence[int],
    role: str,
    method: str,
    timeout_s: float | None = None,
    started: float | None = None,
) -> list:
    """Results of ``refs`` (one per rank in ``ranks``) in order; WorkerGroupError on the first failure, and
    WorkerGroupTimeoutError naming the ranks still running after ``timeout_s`` and the time since the call
    ``started`` (a ``time.perf_counter()`` value; default: now)."""
    return wait_for_calls(refs, [RankCall(role, method, rank) for rank in ranks], timeout_s, started)


@dataclass(frozen=True)
class RankCall:
    """Who computes one ref: rank ``rank`` of group ``role`` running ``method`` (for error messages)."""

    role: str
    method: str
    rank: int


def wait_for_calls(
    refs: Sequence[ray.ObjectRef],
    calls: Sequence[RankCall],
    timeout_s: float | None = None,
    started: float | None = None,
) -> list:
    """Results of ``refs`` in order, where ``calls[i]`` says who computes ``refs[i]`` (the refs may belong to
    several group calls in flight at once). The first failure of any of them raises a WorkerGroupError
    naming its group, rank and method; after ``timeout_s`` a WorkerGroupTimeoutError names the first call
    still running and its pending ranks."""
    started = time.perf_counter() if started is None else started
    position = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def timed_out() -> WorkerGroupTimeoutError:
        assert timeout_s is not None  # without a deadline nothing times out
        first = calls[position[pending[0]]]
        same_call = [c for c in (calls[position[ref]] for ref in pending) if c.role == first.role]
        stuck = sorted(c.rank for c in same_call if c.method == first.method)
        return WorkerGroupTimeoutError(
            first.role, first.method, stuck, timeout_s, time.perf_counter() - started
        )

    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if len(pending) == 1:  # nothing else to fail first: one timed get instead of a wait and a get
            i = position[pending[0]]
            try:
                results[i] = _get_one(pending[0], calls[i].role, calls[i].rank, calls[i].method, remaining)
            except GetTimeoutError:
                raise timed_out() from None
            return results
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            raise timed_out()
        if pending:  # pick up everything else already finished in the same pass
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready += more
        for ref, value in zip(ready, _get_ready(ready, [calls[position[ref]] for ref in ready])):
            results[position[ref]] = value
    return results


def _get_ready(refs: list, calls: list[RankCall]) -> list:
    """Values of finished ``refs`` in one ``ray.get``; only when one of them failed are they fetched one by
    one, so that the error names the failing call."""
    try:
        return ray.get(refs)
    except RayError:
        return [_get_one(ref, call.role, call.rank, call.method) for ref, call in zip(refs, calls)]
