"""The one wait: results of group calls, failing on the first error instead of blocking on the others.

If one rank dies, the others may be stuck forever in a collective waiting for it, so the wait must surface
the first failure at once. Ray's ``ray.get(refs)`` does: it returns when every ref is ready or raises as soon
as any of them holds an error (a raised exception or a dead actor; ``tests/controller/test_failures.py`` and
``test_split_and_wait_all.py`` check that it comes at once). One ``ray.get`` is also the cheapest wait, as
cheap as a bare Ray round trip; only after a failure or a timeout are the refs looked at one by one, to name
the failing rank or the ranks still running. The refs may belong to several calls in flight together (the
two sides of a weight sync: a sender stuck in a broadcast must not hide that the receivers already failed).
When a rank dies, its peers' collectives fail with errors of their own ("connection reset by peer"), often a
moment before Ray reports the death: a failed wait gives the death ``DEATH_GRACE_S`` to show and names it
first, since the death is the cause (a fault a restart can mend) and the peers' errors only its consequence.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayError, RayTaskError

from controller.errors import WorkerGroupError, WorkerGroupTimeoutError

# How long a failed wait looks for a rank's death behind its peers' errors (a collective broken by the death)
DEATH_GRACE_S = 2.0


def _get_one(ref, role: str, rank: int, method: str):
    try:
        return ray.get(ref)
    except RayTaskError as err:
        cause = getattr(err, "cause", None)
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else "the worker raised"
        raise WorkerGroupError(role, rank, method, reason, str(err)) from err
    except RayActorError as err:
        # An actor whose constructor raised reports it through the same error type.
        creation = "creation task" in str(err)
        reason = "the worker's constructor raised" if creation else "the worker actor died"
        kind = "constructor" if creation else "died"
        raise WorkerGroupError(role, rank, method, reason, str(err), kind=kind) from err
    except OutOfMemoryError as err:  # Ray's memory monitor killed the worker
        raise WorkerGroupError(role, rank, method, "out of memory", str(err), kind="died") from err
    except RayError as err:
        raise WorkerGroupError(role, rank, method, f"{type(err).__name__}", str(err), kind="ray") from err


def _error_of(ref, call: RankCall) -> WorkerGroupError | None:
    """The error a finished ref holds, named (`_get_one`), or None when it holds a result."""
    try:
        _get_one(ref, call.role, call.rank, call.method)
    except WorkerGroupError as err:
        return err
    return None


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
    refs = list(refs)
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        assert timeout_s is not None  # without a deadline ray.get does not time out
        pending = set(ray.wait(refs, num_returns=len(refs), timeout=0)[1])
        if not pending:  # all finished between the get's deadline and this look: take the results
            return wait_for_calls(refs, calls, None, started)
        running = [calls[i] for i, ref in enumerate(refs) if ref in pending]
        first = running[0]
        stuck = sorted(c.rank for c in running if (c.role, c.method) == (first.role, first.method))
        raise WorkerGroupTimeoutError(
            first.role, first.method, stuck, timeout_s, time.perf_counter() - started
        ) from None
    except RayError:
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        if (
            pending
        ):  # a rank's death breaks its peers' collectives: give the death the moment it takes to show
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DEATH_GRACE_S)
        done = set(ready)
        errors = [
            e for i, ref in enumerate(refs) if ref in done and (e := _error_of(ref, calls[i])) is not None
        ]
        deaths = [e for e in errors if e.kind == "died"]
        first = (deaths or errors)[0]  # a death is the cause; else the first failure in call order
        raise first from first.__cause__  # the Ray error it names (checkpoint errors read the worker's from it)
