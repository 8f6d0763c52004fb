"""DataProtoFuture: the result of a ``blocking=False`` group call.

It holds one object ref per called rank and knows how to collect them. When the call's result is a
concatenation of per-rank DataProto chunks (DP_COMPUTE_PROTO, n-D mesh modes), ``chunk_refs`` are those
chunks in order; a receiving group with that many dp ranks hands chunk i straight to dp rank i without
the data passing through the controller. ``wait_all`` waits on several futures at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import ray

from controller.errors import WorkerGroupError
from controller.wait import RankCall, wait_for_calls, wait_for_results
from dataproto import DataProto, unpad_dataproto


class DataProtoFuture:
    def __init__(
        self,
        role: str,
        method: str,
        refs: Sequence[ray.ObjectRef],
        ranks: Sequence[int],
        collect: Callable[[list], object],
        pad_size: int = 0,
        chunk_positions: Sequence[int] | None = None,
        timeout_s: float | None = None,
        started: float | None = None,
        process_of: Callable[[int], str] | None = None,
    ):
        self.role, self.method = role, method
        self._process_of = process_of  # rank -> its process, pool and roles (named when a rank dies)
        self.refs, self.ranks = list(refs), list(ranks)
        self.pad_size = pad_size
        self._collect = collect
        self._chunk_positions = None if chunk_positions is None else list(chunk_positions)
        self._timeout_s = timeout_s
        self._started = time.perf_counter() if started is None else started
        self._result: object = None
        self.resolved = False  # True once the controller fetched and collected the outputs

    @property
    def num_chunks(self) -> int | None:
        """Number of DataProto chunks the result is made of, or None if it is not chunked."""
        return None if self._chunk_positions is None else len(self._chunk_positions)

    def chunk_refs(self) -> list[ray.ObjectRef]:
        """Refs of the output chunks in order (padding rows, ``pad_size`` of them, sit in the last ones)."""
        if self._chunk_positions is None:
            raise TypeError(f"the result of {self.role}.{self.method} is not made of DataProto chunks")
        return [self.refs[i] for i in self._chunk_positions]

    def restart_clock(self) -> None:
        """Count the call's time limit from now: a call sent behind another on the same workers (e.g. a weight
        sync queued behind the update) starts its work only when that one ends."""
        self._started = time.perf_counter()

    def get(self, timeout_s: float | None = None):
        """Wait for every rank, collect on the controller and strip padding (cached)."""
        if not self.resolved:
            timeout = self._timeout_s if timeout_s is None else timeout_s
            try:
                outputs = wait_for_results(
                    self.refs, self.ranks, self.role, self.method, timeout, self._started
                )
            except WorkerGroupError as err:
                self.name_process(err)
                raise
            self._resolve(outputs)
        return self._result

    def name_process(self, err: WorkerGroupError) -> None:
        """Name the lost process in ``err`` when one of this call's ranks died."""
        rank = err.rank
        if rank is None or err.process or err.kind != "died" or err.role != self.role:
            return
        if self._process_of is not None:
            err.name_process(self._process_of(rank))

    def _resolve(self, outputs: list) -> None:
        """Collect the per-rank ``outputs`` into the result and strip padding."""
        result = self._collect(outputs)
        # A row-less result (metrics only in meta_info, e.g. an update step) has no padding to strip.
        if self.pad_size and not (isinstance(result, DataProto) and len(result) == 0):
            if not isinstance(result, DataProto):
                raise TypeError(
                    f"{self.role}.{self.method}: padded call returned {type(result).__name__}, "
                    "expected a DataProto to strip padding from"
                )
            result = unpad_dataproto(result, self.pad_size)
        self._result, self.resolved = result, True

    def selecting(self, select: Callable[[DataProto], DataProto]) -> DataProtoFuture:
        """This future as the argument of a call that reads only some columns (``Inputs.select``): its chunk
        refs pass through as they are (the receiving worker selects), but resolved on the controller (a group
        of another size) only ``select``'s columns travel on."""
        return SelectedFuture(self, select)

    def __repr__(self) -> str:
        return (
            f"DataProtoFuture({self.role}.{self.method}, ranks={self.ranks}, chunks={self.num_chunks}, "
            f"pad_size={self.pad_size}, resolved={self.resolved})"
        )


class SelectedFuture(DataProtoFuture):
    """`DataProtoFuture.selecting`: the same call's chunks, resolved through ``select``."""

    def __init__(self, future: DataProtoFuture, select: Callable[[DataProto], DataProto]):
        self._future, self._select = future, select
        self.role, self.method, self.pad_size = future.role, future.method, future.pad_size
        self.refs, self.ranks, self._timeout_s = future.refs, future.ranks, future._timeout_s
        self._process_of = future._process_of

    @property
    def num_chunks(self) -> int | None:
        return self._future.num_chunks

    def chunk_refs(self) -> list[ray.ObjectRef]:
        return self._future.chunk_refs()

    @property
    def resolved(self) -> bool:  # type: ignore[override]
        return self._future.resolved

    def get(self, timeout_s: float | None = None):
        return self._select(self._future.get(timeout_s))


def wait_all(futures: Sequence[DataProtoFuture], timeout_s: float | None = None) -> list:
    """Results of several group calls in flight at once (e.g. the two sides of a collective that spans two
    groups); the first error of any of them is raised at once, naming its group and rank, instead of
    waiting on the others. ``timeout_s`` bounds the whole wait (default: the longest of the calls' own
    limits, none if any call has none)."""
    pending = [f for f in futures if not f.resolved]
    limits = [f._timeout_s for f in pending if f._timeout_s is not None]
    if timeout_s is None and limits and len(limits) == len(pending):
        timeout_s = max(limits)
    refs = [ref for f in pending for ref in f.refs]
    calls = [RankCall(f.role, f.method, rank) for f in pending for rank in f.ranks]
    started = min((f._started for f in pending), default=None)
    try:
        outputs = wait_for_calls(refs, calls, timeout_s, started)
    except WorkerGroupError as err:
        for f in pending:
            f.name_process(err)
        raise
    start = 0
    for f in pending:
        f._resolve(outputs[start : start + len(f.refs)])
        start += len(f.refs)
    return [f.get() for f in futures]
