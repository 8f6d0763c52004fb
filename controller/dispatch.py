"""Dispatch modes: how one controller call becomes per-rank calls, and how the outputs come back.

A mode is a pair of functions:
  * ``dispatch_fn(worker_group, *args, **kwargs)`` returns ``(args, kwargs)`` (or a ``Dispatched``)
    where every positional argument and every keyword value is a list with one entry per rank;
  * ``collect_fn(worker_group, outputs)`` turns the list of per-rank outputs into the call's result.
Chunked modes (DP_COMPUTE_PROTO, n-D mesh) instead name the ranks whose outputs, concatenated in that
order, are the result; their futures can then be chained into another group chunk by chunk.

Every mode that concatenates DataProto outputs (chunked and split modes) merges their ``meta_info`` with
`dataproto.merge_meta_info`: per-rank metrics are combined by a rule their name decides (counts summed, means
weighted by each chunk's rows, ``*max*`` and ``timing_s/*`` the max, ``*min*`` the min; see
``dataproto/metrics_merge.py``), every other key keeps the first chunk's value.

Split modes (DP_SPLIT_PROTO, n-D split mesh) are for methods whose output has a different number of rows
than their input (a generation that returns ``n`` rows per prompt): the batch is cut into contiguous chunks
whose sizes differ by at most one row, with no padding rows, because a padded input row would come back as
an unknown number of output rows. A rank whose chunk would be empty (fewer rows than chunks) gets one copy
of row 0 flagged in ``meta_info[PAD_ROWS_KEY]``; the worker drops that row's outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import ray
import torch

from controller.future import DataProtoFuture
from dataproto import DataProto, merge_meta_info, pad_dataproto_to_divisor


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"  # same arguments to every rank; list of outputs
    ALL_TO_ALL = "all_to_all"  # every argument is a list, entry r goes to rank r; list of outputs
    ONE_TO_ALL_RANK_ZERO = "one_to_all_rank_zero"  # same arguments to every rank; rank 0's output
    DP_COMPUTE_PROTO = "dp_compute_proto"  # DataProto split into world_size chunks; outputs concatenated
    DP_SPLIT_PROTO = "dp_split_proto"  # DataProto split into world_size unpadded chunks; outputs concatenated
    RANK_ZERO = "rank_zero"  # only rank 0 is called; its output is the result


class Execute(Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass
class Dispatched:
    """Per-rank arguments: ``args[i][r]`` is positional argument i for rank r."""

    args: list[list]
    kwargs: dict[str, list]
    pad_size: int = 0  # rows appended to reach a multiple of the chunk count; stripped after collect


@dataclass(frozen=True)
class DispatchMode:
    name: str
    dispatch_fn: Callable
    collect_fn: Callable | None = None
    # Chunked modes: ranks whose outputs, concatenated in this order, form the result.
    chunk_ranks_fn: Callable | None = field(default=None)
    accepts_futures: bool = False  # False: DataProtoFuture arguments are resolved before dispatch

    @property
    def chunked(self) -> bool:
        return self.chunk_ranks_fn is not None

    def collect(self, wg, outputs: list):
        if self.chunk_ranks_fn is None:
            assert self.collect_fn is not None  # every mode has a collect_fn or a chunk_ranks_fn
            return self.collect_fn(wg, outputs)
        ranks = self.chunk_ranks_fn(wg)
        return concat_chunks(wg, [outputs[r] for r in ranks], ranks, self.name)


def concat_chunks(wg, chunks: list, ranks: list[int], mode_name: str) -> DataProto:
    for chunk, rank in zip(chunks, ranks):
        if not isinstance(chunk, DataProto):
            raise TypeError(
                f"{mode_name}: rank {rank} of worker group {wg.name!r} returned {type(chunk).__name__}; "
                "this mode concatenates DataProto outputs"
            )
    out = DataProto.concat(chunks)
    out.meta_info = merge_meta_info([c.meta_info for c in chunks], [len(c) for c in chunks])
    return out


# ---------------------------------------------------------------------- registry
_MODES: dict[str, DispatchMode] = {}


def register_dispatch_mode(
    name: str, dispatch_fn: Callable, collect_fn: Callable, override: bool = False
) -> DispatchMode:
    """Register a user dispatch/collect pair; use it as ``@register(dispatch_mode=name)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"dispatch mode name must be a non-empty string, got {name!r}")
    if name in _MODES and not override:
        raise ValueError(f"dispatch mode {name!r} is already registered (pass override=True to replace it)")
    if not callable(dispatch_fn) or not callable(collect_fn):
        raise TypeError(f"dispatch mode {name!r}: dispatch_fn and collect_fn must be callable")
    mode = DispatchMode(name, dispatch_fn, collect_fn)
    _MODES[name] = mode
    return mode


def get_dispatch_mode(key: Dispatch | str | DispatchMode) -> DispatchMode:
    if isinstance(key, DispatchMode):
        return key
    name = key.value if isinstance(key, Dispatch) else key
    if name not in _MODES:
        raise KeyError(f"unknown dispatch mode {name!r}; registered: {sorted(_MODES)}")
    return _MODES[name]


def normalize_dispatched(out, wg, mode_name: str) -> Dispatched:
    """Accept ``(args, kwargs)`` or a Dispatched and check every entry has one value per rank."""
    if isinstance(out, Dispatched):
        d = out
    elif isinstance(out, tuple) and len(out) == 2:
        d = Dispatched(list(out[0]), dict(out[1]))
    else:
        raise TypeError(f"dispatch mode {mode_name!r} must return (args, kwargs), got {type(out).__name__}")
    n = wg.world_size
    for label, values in [(f"positional arg {i}", v) for i, v in enumerate(d.args)] + list(d.kwargs.items()):
        if not isinstance(values, (list, tuple)) or len(values) != n:
            raise ValueError(
                f"dispatch mode {mode_name!r} produced {label} with "
                f"{len(values) if isinstance(values, (list, tuple)) else type(values).__name__} entries; "
                f"worker group {wg.name!r} has {n} ranks"
            )
    return d


# ---------------------------------------------------------------------- built-in modes
def _broadcast(wg, value) -> list:
    # Large values go to the object store once instead of once per rank.
    if wg.world_size > 1 and isinstance(value, (DataProto, torch.Tensor, np.ndarray)):
        value = ray.put(value)
    return [value] * wg.world_size


def dispatch_one_to_all(wg, *args, **kwargs):
    return [_broadcast(wg, a) for a in args], {k: _broadcast(wg, v) for k, v in kwargs.items()}


def dispatch_per_rank(wg, *args, **kwargs):
    n = wg.world_size
    for label, value in [(f"positional arg {i}", a) for i, a in enumerate(args)] + list(kwargs.items()):
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"a list of {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{label} must be a list with one entry per rank ({n}), got {got}")
    return [list(a) for a in args], {k: list(v) for k, v in kwargs.items()}


def dispatch_rank_zero(wg, *args, **kwargs):
    # Only rank 0 runs; the other entries are never sent.
    return [[a] * wg.world_size for a in args], {k: [v] * wg.world_size for k, v in kwargs.items()}


def collect_list(wg, outputs: list) -> list:
    return list(outputs)


def collect_rank_zero(wg, outputs: list):
    return outputs[0]


def chunk_proto_args(num_chunks: int, args: tuple, kwargs: dict, by_value: bool = False):
    """Split every DataProto argument into ``num_chunks`` object refs, each chunk put once, or with
    ``by_value`` into the chunks themselves (see ``ship_chunk``).

    A DataProtoFuture already made of ``num_chunks`` chunks is passed through ref by ref; any other
    future is resolved on the controller first. Returns (per-arg chunks, per-kwarg chunks, pad).
    """
    pads: dict[str, int] = {}
    lengths: dict[str, int] = {}

    def split(label: str, value) -> list:
        if isinstance(value, DataProtoFuture):
            if value.num_chunks == num_chunks:
                pads[label] = value.pad_size
                return value.chunk_refs()
            value = value.get()
        if not isinstance(value, DataProto):
            raise TypeError(f"{label} must be a DataProto or DataProtoFuture, got {type(value).__name__}")
        lengths[label] = len(value)
        padded, pads[label] = pad_dataproto_to_divisor(value, num_chunks)
        return [ship_chunk(chunk, by_value) for chunk in padded.chunk(num_chunks)]

    arg_chunks = [split(f"positional arg {i}", a) for i, a in enumerate(args)]
    kw_chunks = {k: split(f"keyword arg {k!r}", v) for k, v in kwargs.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"DataProto arguments have different lengths: {lengths}")
    if len(set(pads.values())) > 1:
        raise ValueError(f"DataProto arguments need different padding (rows added per argument: {pads})")
    return arg_chunks, kw_chunks, next(iter(pads.values()), 0)


def ship_chunk(chunk: DataProto, by_value: bool):
    """How a chunk that goes to ONE rank travels: an object ref (one ``ray.put``), or with ``by_value`` the
    chunk itself inside the call, which Ray inlines in the task when it is small (under Ray's
    ``max_direct_call_object_size``, 100 KiB by default) and puts in the object store itself otherwise. The
    inlined chunk skips the object store's round trips (put, then the worker's fetch), which dominate a group
    call on small batches. A chunk shared by several ranks is always put once."""
    return chunk if by_value else ray.put(chunk)


def dispatch_dp_compute_proto(wg, *args, **kwargs) -> Dispatched:
    arg_chunks, kw_chunks, pad = chunk_proto_args(wg.world_size, args, kwargs, wg.chunks_by_value)
    return Dispatched(arg_chunks, kw_chunks, pad)


def _all_ranks(wg) -> list[int]:
    return list(range(wg.world_size))


# ---------------------------------------------------------------------- split modes
# meta_info key set by the split modes on a chunk: rows at its end that are placeholders (outputs dropped)
PAD_ROWS_KEY = "_hyflow_pad_rows"


def _split_rows(num_rows: int, num_chunks: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) row ranges, one per chunk, sizes differing by at most one (larger ones first)."""
    base, extra = divmod(num_rows, num_chunks)
    bounds, start = [], 0
    for i in range(num_chunks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _split_proto_arg(args: tuple, kwargs: dict, num_chunks: int, by_value: bool) -> tuple[DataProto, list]:
    """(the single DataProto argument, its ``num_chunks`` contiguous chunks shipped as ``ship_chunk`` says;
    a chunk that would be empty is one copy of row 0 flagged as a placeholder)."""
    protos = [a for a in (*args, *kwargs.values()) if isinstance(a, DataProto)]
    if len(protos) != 1:
        raise TypeError(f"split dispatch takes exactly one DataProto argument, got {len(protos)}")
    data = protos[0]
    if len(data) == 0:
        raise ValueError("split dispatch: the batch is empty")
    chunks = []
    for start, end in _split_rows(len(data), num_chunks):
        if end > start:
            chunk = data.slice(start, end)
            chunk.meta_info[PAD_ROWS_KEY] = 0
        else:  # fewer rows than chunks: a placeholder row whose output is dropped
            chunk = data.slice(0, 1)
            chunk.meta_info[PAD_ROWS_KEY] = 1
        chunks.append(ship_chunk(chunk, by_value))
    return data, chunks


def _split_dispatched(wg, args: tuple, kwargs: dict, chunk_of_rank: list[int], num_chunks: int) -> Dispatched:
    """Rank r gets chunk ``chunk_of_rank[r]`` of the DataProto argument; other arguments go to every rank."""
    # Chunks go by value only when each goes to one rank (tensor-parallel replicas share theirs).
    by_value = len(chunk_of_rank) == num_chunks and wg.chunks_by_value
    data, chunks = _split_proto_arg(args, kwargs, num_chunks, by_value)

    def per_rank(value) -> list:
        return [chunks[c] for c in chunk_of_rank] if value is data else [value] * wg.world_size

    return Dispatched([per_rank(a) for a in args], {k: per_rank(v) for k, v in kwargs.items()})


def dispatch_dp_split_proto(wg, *args, **kwargs) -> Dispatched:
    return _split_dispatched(wg, args, kwargs, _all_ranks(wg), wg.world_size)


def collect_dp_split_proto(wg, outputs: list) -> DataProto:
    return concat_chunks(wg, outputs, _all_ranks(wg), Dispatch.DP_SPLIT_PROTO.value)


# ---------------------------------------------------------------------- n-D mesh modes
def mesh_layout(wg, mesh_name: str) -> tuple[list[int], list[int]]:
    """(dp rank of every rank, collecting rank of every dp rank) from the workers' registered info."""
    info = wg.dispatch_info(mesh_name)
    dp_of_rank = [dp for dp, _ in info]
    dp_size = max(dp_of_rank) + 1
    collectors: dict[int, list[int]] = {}
    for rank, (dp, is_collect) in enumerate(info):
        if is_collect:
            collectors.setdefault(dp, []).append(rank)
    missing = sorted(set(range(dp_size)) - set(dp_of_rank))
    bad = {dp: ranks for dp, ranks in collectors.items() if len(ranks) != 1}
    no_collector = sorted(set(range(dp_size)) - set(collectors))
    if missing or bad or no_collector:
        raise ValueError(
            f"mesh {mesh_name!r} of worker group {wg.name!r} is inconsistent: dp ranks per rank {dp_of_rank}; "
            f"dp ranks missing {missing}, dp ranks with several collect ranks {bad}, "
            f"dp ranks with no collect rank {no_collector}"
        )
    return dp_of_rank, [collectors[dp][0] for dp in range(dp_size)]


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> DispatchMode:
    """Mode for workers on a named (dp x tp x pp ...) mesh: chunk by dp size, every replica of a dp rank
    gets the same chunk ref, outputs come only from the ranks registered with ``is_collect=True``."""
    name = f"nd_compute_dataproto[{mesh_name}]"
    if name in _MODES:
        return _MODES[name]

    def dispatch(wg, *args, **kwargs) -> Dispatched:
        dp_of_rank, collect_ranks = mesh_layout(wg, mesh_name)
        # By value only with one rank per dp rank: a chunk shared by replicas is put once.
        by_value = len(collect_ranks) == wg.world_size and wg.chunks_by_value
        arg_chunks, kw_chunks, pad = chunk_proto_args(len(collect_ranks), args, kwargs, by_value)
        return Dispatched(
            [[chunks[dp] for dp in dp_of_rank] for chunks in arg_chunks],
            {k: [chunks[dp] for dp in dp_of_rank] for k, chunks in kw_chunks.items()},
            pad,
        )

    def chunk_ranks(wg) -> list[int]:
        return mesh_layout(wg, mesh_name)[1]

    mode = DispatchMode(name, dispatch, chunk_ranks_fn=chunk_ranks, accepts_futures=True)
    _MODES[name] = mode
    return mode


def make_nd_split_dataproto_dispatch_fn(mesh_name: str) -> DispatchMode:
    """DP_SPLIT_PROTO over the dp ranks of ``mesh_name`` instead of over ranks: one unpadded chunk per dp
    rank, every rank of a dp rank gets its chunk (tensor-parallel ranks working in lockstep), outputs come
    only from the ranks registered with ``is_collect=True``, in dp order. With one rank per dp rank (all
    collected) it is exactly DP_SPLIT_PROTO."""
    name = f"nd_split_dataproto[{mesh_name}]"
    if name in _MODES:
        return _MODES[name]

    def dispatch(wg, *args, **kwargs) -> Dispatched:
        dp_of_rank, collect_ranks = mesh_layout(wg, mesh_name)
        return _split_dispatched(wg, args, kwargs, dp_of_rank, len(collect_ranks))

    def collect(wg, outputs: list) -> DataProto:
        collect_ranks = mesh_layout(wg, mesh_name)[1]
        return concat_chunks(wg, [outputs[r] for r in collect_ranks], collect_ranks, name)

    mode = DispatchMode(name, dispatch, collect)
    _MODES[name] = mode
    return mode


for _mode in [
    DispatchMode(Dispatch.ONE_TO_ALL.value, dispatch_one_to_all, collect_list),
    DispatchMode(Dispatch.ALL_TO_ALL.value, dispatch_per_rank, collect_list),
    DispatchMode(Dispatch.ONE_TO_ALL_RANK_ZERO.value, dispatch_one_to_all, collect_rank_zero),
    DispatchMode(Dispatch.RANK_ZERO.value, dispatch_rank_zero, collect_rank_zero),
    DispatchMode(
        Dispatch.DP_COMPUTE_PROTO.value,
        dispatch_dp_compute_proto,
        chunk_ranks_fn=_all_ranks,
        accepts_futures=True,
    ),
    # Not chunked: a placeholder rank returns no rows, so its output cannot feed another group's rank.
    DispatchMode(Dispatch.DP_SPLIT_PROTO.value, dispatch_dp_split_proto, collect_dp_split_proto),
]:
    _MODES[_mode.name] = _mode
