"""Wait for one result per rank, failing on the first error instead of blocking on the others.

A single ``ray.get(refs)`` would block until every rank returns; if one rank dies, the others may be
stuck forever in a collective waiting for it. Waiting ref by ref with ``ray.wait`` surfaces the first
failure at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from controller.errors import WorkerGroupError, WorkerGroupTimeoutError


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
    started = time.perf_counter() if started is None else started
    position = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            stuck = sorted(ranks[position[ref]] for ref in pending)
            raise WorkerGroupTimeoutError(role, method, stuck, timeout_s, time.perf_counter() - started)
        if pending:  # pick up everything else already finished in the same pass
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready += more
        for ref in ready:
            i = position[ref]
            results[i] = _get_one(ref, role, ranks[i], method)
    return results
