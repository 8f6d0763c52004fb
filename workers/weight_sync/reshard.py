"""3D-HybridEngine weight resharding: training shards (pp, tp, dp) -> generation shards (tp_g, dp_g) on
the same ranks, streamed in size-bounded buckets, with byte and memory accounting.

Two paths over the same ``ReshardPlan`` (``reshard_plan.py`` says who holds and who needs what):

* ``regrouped`` (HybridFlow's zero-redundancy path): each rank broadcasts its training chunks inside its
  micro-DP group only; the received chunks plus its own are exactly its generation chunk. Per rank it
  receives ``M/tp_g - M/(tp*pp)`` bytes (M: model bytes) and nothing it already has or does not need.
* ``naive`` (gather everything, then slice): each rank broadcasts its chunks to its whole model-parallel
  group (the pp*tp ranks of one training replica), so every rank receives the whole model (``M -
  M/(tp*pp)`` bytes) and cuts its generation chunk from it; the gathered bytes of a bucket are all in
  memory at once (``bucket_bytes=None``: the whole model, HybridFlow's "peak memory M").

Transport: per bucket, every group member that contributes something broadcasts one flat ``uint8`` buffer
(its pieces back to back at ``ALIGN_BYTES`` offsets) to the group. Sizes and offsets follow from the plan,
which every rank knows, so no metadata travels. A broadcast per member, not one all-gather, because
members on different pipeline stages contribute different amounts (an all-gather would pad to the
largest). Works on any torch.distributed backend (gloo on CPU, NCCL on GPU) with groups from
``dist.new_group``; create the ``Resharder`` on every rank at the same time (group creation is collective).

Buckets: consecutive parameters are grouped so that the bucket's transient bytes (regrouped: the
generation chunks being assembled, which is exactly what travels; naive: the full tensors, which is what
it gathers) stay within ``bucket_bytes`` (a larger parameter travels alone); ``bucket_bytes=None``: the
whole model at once. Peak transient memory (the send and receive buffers) is counted exactly; the
generation chunks handed to the caller are counted apart (``gen_shard_bytes``: they are the result).

Byte counts are logical payload: ``bytes_received`` = bytes of the buffers other members broadcast to
this rank; ``bytes_sent`` = own buffer x (group size - 1), what direct sends would cost (a ring or tree
broadcast spreads the same total over the members differently).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from workers.weight_sync.buckets import ALIGN_BYTES, TensorMeta
from workers.weight_sync.reshard_plan import ParamSpec, Piece, ReshardPlan

MODES = ("regrouped", "naive")


@dataclass
class ReshardStats:
    mode: str
    rank: int
    group_size: int
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_transient_bytes: int = 0
    gen_shard_bytes: int = 0
    held_bytes: int = 0
    buckets: int = 0
    broadcasts: int = 0
    time_s: float = 0.0
    bucket_bytes: list[int] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("bucket_bytes")
        return out


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _layout(pieces: list[Piece]) -> tuple[list[TensorMeta], int]:
    """Byte offsets of ``pieces`` in one flat buffer (the same on every rank: derived from the plan)."""
    metas, offset = [], 0
    for piece in pieces:
        offset = _align(offset)
        metas.append(TensorMeta(piece.spec.name, piece.shape, piece.spec.dtype, offset, piece.nbytes))
        offset += piece.nbytes
    return metas, offset


def _views(buffer: torch.Tensor, metas: list[TensorMeta]) -> dict[str, torch.Tensor]:
    return {m.name: buffer[m.offset : m.end].view(m.dtype).reshape(m.shape) for m in metas}


def _new_groups(groups: Sequence[Sequence[int]], rank: int, backend: str | None):
    """Create every group (collective: all ranks, same order) and return the one holding ``rank``."""
    mine = None
    for ranks in groups:
        pg = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
        if rank in ranks:
            mine = pg
    return mine


class Resharder:
    """One rank's side of resharding under ``plan`` (``mode``: "regrouped" or "naive").

    Construct on every rank at once (it creates the process groups). ``device``: where buffers live
    (default: the current CUDA device for NCCL, else CPU)."""

    def __init__(
        self,
        plan: ReshardPlan,
        mode: str = "regrouped",
        backend: str | None = None,
        device: torch.device | str | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"reshard mode must be one of {MODES}, got {mode!r}")
        if not dist.is_initialized():
            raise RuntimeError("resharding needs an initialised torch.distributed default group")
        if dist.get_world_size() != plan.train.world:
            raise ValueError(
                f"reshard plan is for {plan.train.world} ranks, the process group has {dist.get_world_size()}"
            )
        self.plan, self.mode = plan, mode
        self.rank = dist.get_rank()
        if mode == "regrouped":
            self.members = plan.micro_dp_group(self.rank)
            self.group = _new_groups(plan.micro_dp_groups(), self.rank, backend)
        else:
            self.members = plan.model_parallel_group(self.rank)
            self.group = _new_groups(plan.model_parallel_groups(), self.rank, backend)
        if device is None:
            use_cuda = dist.get_backend() == "nccl" and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        self.device = torch.device(device)
        self.stats: ReshardStats | None = None  # counts of the latest stream

    # ---- buckets
    def _transient_nbytes(self, spec: ParamSpec) -> int:
        if self.mode == "regrouped":
            return self.plan.needed(self.rank, spec).nbytes  # identical on every member of the group
        return spec.nbytes

    def buckets(self, bucket_bytes: int | None) -> list[list[ParamSpec]]:
        """Consecutive parameters grouped by transient bytes (the same split on every group member)."""
        if bucket_bytes is not None and bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1 or None, got {bucket_bytes}")
        out: list[list[ParamSpec]] = []
        current: list[ParamSpec] = []
        filled = 0
        for spec in self.plan.specs:
            size = self._transient_nbytes(spec)
            if current and bucket_bytes is not None and filled + size > bucket_bytes:
                out.append(current)
                current, filled = [], 0
            current.append(spec)
            filled += size
        if current:
            out.append(current)
        return out

    # ---- streaming
    def _check_local(self, local: Mapping[str, torch.Tensor]) -> None:
        for spec in self.plan.specs:
            piece = self.plan.held(self.rank, spec)
            if piece is None:
                continue
            if spec.name not in local:
                raise KeyError(
                    f"rank {self.rank}: training shard of {spec.name!r} (stage {spec.stage}) is missing"
                )
            got = tuple(local[spec.name].shape)
            if got != piece.shape:
                raise ValueError(
                    f"rank {self.rank}: training shard of {spec.name!r} has shape {got}, the plan expects "
                    f"{piece.shape} (chunk {piece.index} of {piece.parts})"
                )

    def stream(
        self, local: Mapping[str, torch.Tensor], bucket_bytes: int | None = 64 << 20
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield this rank's generation chunks bucket by bucket as ``[(hf_name, tensor), ...]``.

        ``local``: this rank's training chunks by HF name (``held`` pieces of its stage). Every member of
        the group must iterate the stream to the end (each bucket is a collective). ``self.stats`` holds
        the counts once the stream is exhausted. A rank alone in its group (``tp_g == tp``, ``pp == 1``)
        gets its training tensors themselves (detached, not copied): copy before modifying them."""
        self._check_local(local)
        plan, me, members = self.plan, self.rank, self.members
        stats = ReshardStats(self.mode, me, len(members))
        stats.gen_shard_bytes = plan.gen_shard_bytes(me)
        stats.held_bytes = plan.held_bytes(me)
        self.stats = stats
        t0 = time.perf_counter()
        for specs in self.buckets(bucket_bytes):
            if len(members) == 1:
                # alone in the group (tp_g == tp, pp == 1): the training shard IS the generation shard;
                # hand out the tensors in place, nothing is copied or sent
                stats.buckets += 1
                stats.bucket_bytes.append(0)
                yield [(s.name, local[s.name].detach()) for s in specs]
                continue
            layouts = {}
            for m in members:
                pieces = [p for s in specs if (p := plan.contribution(m, s, self.mode)) is not None]
                layouts[m] = _layout(pieces)
            received: dict[int, dict[str, torch.Tensor]] = {}
            transient = 0
            for m in members:
                metas, nbytes = layouts[m]
                if nbytes == 0:
                    continue
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                transient += nbytes
                if m == me:
                    for meta in metas:
                        src = local[meta.name].detach().to(self.device, meta.dtype).contiguous()
                        buffer[meta.offset : meta.end].copy_(src.reshape(-1).view(torch.uint8))
                    stats.bytes_sent += nbytes * (len(members) - 1)
                else:
                    stats.bytes_received += nbytes
                if len(members) > 1:
                    dist.broadcast(buffer, src=m, group=self.group)
                    stats.broadcasts += 1
                received[m] = _views(buffer, metas)
            out = self._assemble(specs, received)
            stats.peak_transient_bytes = max(stats.peak_transient_bytes, transient)
            stats.buckets += 1
            stats.bucket_bytes.append(transient)
            del received
            yield out
        stats.time_s = time.perf_counter() - t0

    def _assemble(
        self, specs: list[ParamSpec], received: dict[int, dict[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Generation chunks of one bucket, cut from the received training chunks (own included). Both
        paths cut the same way; the naive one simply received every other chunk as well."""
        plan, me = self.plan, self.rank
        out = []
        for spec in specs:
            need = plan.needed(me, spec)
            chunks: dict[int, torch.Tensor] = {}  # training chunk index -> received view
            for m, views in received.items():
                piece = plan.contribution(m, spec, self.mode)
                if piece is not None:
                    chunks[piece.index] = views[spec.name]
            if spec.split_dim is None:
                out.append((spec.name, chunks[0].clone()))
                continue
            first = need.index * plan.mu  # training chunks first .. first+mu-1 make generation chunk need
            parts = [chunks[i] for i in range(first, first + plan.mu)]
            out.append((spec.name, parts[0].clone() if len(parts) == 1 else torch.cat(parts, spec.split_dim)))
        return out

    def reshard(
        self, local: Mapping[str, torch.Tensor], bucket_bytes: int | None = 64 << 20
    ) -> dict[str, torch.Tensor]:
        """The whole generation shard as a dict (``self.stats`` holds the counts)."""
        return {name: t for bucket in self.stream(local, bucket_bytes) for name, t in bucket}

    def named_tensors(
        self, local: Mapping[str, torch.Tensor], bucket_bytes: int | None = 64 << 20
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, generation chunk)`` one at a time, for a rollout engine's ``update_weights`` (with
        ``tp_g == 1`` the full tensors, which the native engine takes as they are)."""
        for bucket in self.stream(local, bucket_bytes):
            yield from bucket

    def destroy(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def paper_volume_bytes(model_bytes: int, plan: ReshardPlan, mode: str) -> float:
    """Per-rank communication volume HybridFlow derives (Sec. 5.4, Table 2), for comparison with
    ``bytes_received``: 3D-HybridEngine ``(t*p - t_g*p_g)/(t_g*p_g*t*p) * M`` (here ``p_g = 1``);
    "HybridFlow-V" (gather the whole model over the model-parallel group) ``(t*p - 1)/(t*p) * M``."""
    t, p, tg = plan.train.tp, plan.train.pp, plan.gen.tp_g
    if mode == "regrouped":
        return (t * p - tg) / (tg * t * p) * model_bytes
    return (t * p - 1) / (t * p) * model_bytes
