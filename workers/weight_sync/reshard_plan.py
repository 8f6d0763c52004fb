"""Who holds and who needs which shard of every parameter when weights move from the training layout
(pp, tp, dp) to the generation layout (tp_g, dp_g) on the same ranks: the bookkeeping half of the
3D-HybridEngine (HybridFlow, Sheng et al. 2024). No process groups here; ``reshard.py`` moves the bytes.

Ranks
-----
Training rank ``r = tp_rank + tp * (dp_rank + dp * pp_rank)``: tensor parallelism fastest, then data, then
pipeline (Megatron-core's default ``tp-cp-ep-dp-pp`` order without context/expert parallelism).

Shards are Hugging Face tensors cut along one dimension
------------------------------------------------------
Every parameter is described by a ``ParamSpec``: its HF name, full shape, dtype, the pipeline stage that
owns it and ``split_dim``: the dimension tensor parallelism cuts it along (``None``: replicated on every TP
rank, e.g. norms). TP rank ``i`` of ``t`` holds chunk ``i`` of ``t`` equal chunks. A Megatron fused QKV or
gate/up shard is a per-rank rearrangement of exactly these chunks (``workers/engine/megatron/
hf_conversion.py``), so resharding works on HF-named chunks and needs no Megatron knowledge.

Generation layout and micro-DP groups
-------------------------------------
Generation uses the same ``world = pp * tp * dp`` ranks as ``tp_g * dp_g`` with ``tp % tp_g == 0`` (a
generation shard must be a union of whole training shards) and no pipeline stages: every replica needs
all layers. With ``mu = tp // tp_g``:

* micro-DP group of a rank: the ``pp * mu`` ranks with the same ``dp_rank`` and the same ``tp_rank // mu``
  (i.e. ``mu`` consecutive training TP ranks, on every stage). Their training chunks ``j*mu .. j*mu+mu-1``
  of every parameter (on its owner stage) are exactly generation chunk ``j = tp_rank // mu``;
* generation TP rank = ``tp_rank // mu``; generation TP group: the ranks with the same
  ``(dp_rank, pp_rank, tp_rank % mu)``, i.e. training TP ranks ``u, u+mu, u+2mu, ...`` (stride ``mu``);
* generation replica (DP) index: ``tp_rank % mu + mu * (dp_rank + dp * pp_rank)``.

So every rank already holds ``M / (pp * tp)`` of the ``M / tp_g`` bytes it needs, and an all-gather inside
its micro-DP group brings exactly the rest: ``M/tp_g - M/(tp*pp)`` received per rank, the HybridFlow
volume ``(tp*pp - tp_g) / (tp_g * tp * pp) * M`` (with ``pp_g = 1``). Replicated parameters (norms) are
sent by the group member with ``tp_rank % mu == 0`` only, so nothing is sent twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from workers.models.tp_split import LAYER_TP_SPLIT

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class TrainLayout:
    """Training parallel sizes; ``world = pp * tp * dp``."""

    pp: int = 1
    tp: int = 1
    dp: int = 1

    def __post_init__(self):
        for key in ("pp", "tp", "dp"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainLayout.{key} must be a positive int, got {value!r}")

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of a training rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} out of range for training layout {self} (world {self.world})")
        return rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)


@dataclass(frozen=True)
class GenLayout:
    """Generation parallel sizes on the same ranks: ``tp_g`` tensor-parallel ranks per replica, ``dp_g``
    replicas."""

    tp_g: int = 1
    dp_g: int = 1

    def __post_init__(self):
        for key in ("tp_g", "dp_g"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GenLayout.{key} must be a positive int, got {value!r}")

    @property
    def world(self) -> int:
        return self.tp_g * self.dp_g


@dataclass(frozen=True)
class ParamSpec:
    """One parameter in HF naming: full shape, dtype, owner pipeline stage, TP split dimension (None:
    replicated) and ``split_units``: indivisible units along that dimension (attention heads for q/k/v,
    else the dimension's length); the TP degree must divide it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stage: int
    split_dim: int | None
    split_units: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def chunk_shape(self, parts: int) -> tuple[int, ...]:
        """Shape of one of ``parts`` equal TP chunks (the full shape when replicated)."""
        if self.split_dim is None or parts == 1:
            return self.shape
        shape = list(self.shape)
        shape[self.split_dim] //= parts
        return tuple(shape)

    def chunk_nbytes(self, parts: int) -> int:
        return math.prod(self.chunk_shape(parts)) * self.dtype.itemsize

    def chunk(self, full: torch.Tensor, index: int, parts: int) -> torch.Tensor:
        """Chunk ``index`` of ``parts`` of the full tensor (a view; the full tensor when replicated)."""
        if self.split_dim is None or parts == 1:
            return full
        return full.chunk(parts, dim=self.split_dim)[index]


# ------------------------------------------------------------------ HF Qwen2 / Llama parameter specs

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TOP_SPLIT = {
    "model.embed_tokens.weight": 0,
    "lm_head.weight": 0,
    "model.norm.weight": None,
    "score.weight": None,  # critic value head (HF *ForTokenClassification, 1 label): replicated, last stage
    "score.bias": None,
}


def stage_of_layer(layer: int, num_layers: int, pp: int) -> int:
    """Pipeline stage of decoder layer ``layer``: equal consecutive blocks, as Megatron splits them."""
    if num_layers % pp:
        raise ValueError(f"num_hidden_layers={num_layers} is not divisible by the pipeline size pp={pp}")
    return layer // (num_layers // pp)


def hf_param_specs(
    named_shapes: Iterable[tuple[str, torch.Size | tuple[int, ...], torch.dtype]],
    num_layers: int,
    pp: int,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> list[ParamSpec]:
    """``ParamSpec``s for a Qwen2/Qwen3/Llama-style HF state dict, in the given order.

    Stages: decoder layers in ``pp`` equal blocks, embeddings on stage 0, final norm and ``lm_head`` on the
    last stage. Head counts (when given) become the split units of q/k/v so that a TP degree that would cut
    through a head is rejected. An unknown parameter name is an error naming it."""
    specs = []
    for name, shape, dtype in named_shapes:
        shape = tuple(int(s) for s in shape)
        units = None
        match = _LAYER.match(name)
        if match:
            layer, rest = int(match.group(1)), match.group(2)
            if rest not in LAYER_TP_SPLIT:
                raise ValueError(f"parameter {name!r}: no tensor-parallel rule for {rest!r}")
            split, stage = LAYER_TP_SPLIT[rest], stage_of_layer(layer, num_layers, pp)
            if rest.startswith("self_attn.q_proj"):
                units = num_heads
            elif rest.startswith(("self_attn.k_proj", "self_attn.v_proj")):
                units = num_kv_heads
        elif name in _TOP_SPLIT:
            split = _TOP_SPLIT[name]
            stage = 0 if name == "model.embed_tokens.weight" else pp - 1
        else:
            raise ValueError(f"parameter {name!r}: not a Qwen2/Llama parameter name this plan knows")
        specs.append(ParamSpec(name, shape, dtype, stage, split, units))
    return specs


def specs_from_model(model: torch.nn.Module, pp: int) -> list[ParamSpec]:
    """``ParamSpec``s of an HF ``*ForCausalLM`` (tied ``lm_head`` left out: it is the embedding)."""
    # torch types Module attributes as Tensor | Module; an HF model's ``config`` is a PretrainedConfig
    cfg = cast("PretrainedConfig", model.config)
    named = [
        (name, p.shape, p.dtype)
        for name, p in model.named_parameters()  # named_parameters() skips the tied duplicate
    ]
    return hf_param_specs(
        named,
        cfg.num_hidden_layers,
        pp,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
    )


# ------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class Piece:
    """One training chunk of one parameter that a sender contributes: chunk ``index`` of ``parts``
    (``parts == 1``: the whole tensor)."""

    spec: ParamSpec
    index: int
    parts: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.chunk_shape(self.parts)

    @property
    def nbytes(self) -> int:
        return self.spec.chunk_nbytes(self.parts)


class ReshardPlan:
    """Everything each rank must know to reshard ``specs`` from ``train`` to ``gen``: groups, the chunk each
    rank holds and the chunk it needs, and which group member contributes which pieces."""

    def __init__(self, specs: list[ParamSpec], train: TrainLayout, gen: GenLayout):
        if gen.world != train.world:
            raise ValueError(
                f"generation layout tp_g*dp_g={gen.tp_g}*{gen.dp_g}={gen.world} must use the same ranks as "
                f"training pp*tp*dp={train.pp}*{train.tp}*{train.dp}={train.world}"
            )
        if train.tp % gen.tp_g:
            raise ValueError(
                f"generation TP tp_g={gen.tp_g} must divide training TP tp={train.tp} (a generation shard "
                f"is a union of whole training shards)"
            )
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate parameter names in the reshard plan: {dup}")
        for spec in specs:
            if not 0 <= spec.stage < train.pp:
                raise ValueError(f"parameter {spec.name!r}: stage {spec.stage} outside pp={train.pp}")
            if spec.split_dim is not None:
                length = spec.shape[spec.split_dim]
                units = spec.split_units or length
                if length % units or units % train.tp:
                    raise ValueError(
                        f"parameter {spec.name!r}: {units} units along dim {spec.split_dim} (size {length}) "
                        f"cannot be split evenly over tp={train.tp}"
                    )
        self.specs, self.train, self.gen = specs, train, gen
        self.mu = train.tp // gen.tp_g  # training TP ranks per generation TP rank

    # ---- per-rank roles
    def gen_coords(self, rank: int) -> tuple[int, int]:
        """``(dp_g_rank, tp_g_rank)``: the rank's generation replica and its TP rank inside it."""
        pp_rank, dp_rank, tp_rank = self.train.coords(rank)
        return tp_rank % self.mu + self.mu * (dp_rank + self.train.dp * pp_rank), tp_rank // self.mu

    def micro_dp_group(self, rank: int) -> list[int]:
        """The ranks that all-gather together (sorted): same dp_rank and generation TP rank, every stage."""
        _, dp_rank, tp_rank = self.train.coords(rank)
        j = tp_rank // self.mu
        return sorted(
            self.train.rank_of(s, dp_rank, j * self.mu + u)
            for s in range(self.train.pp)
            for u in range(self.mu)
        )

    def micro_dp_groups(self) -> list[tuple[int, ...]]:
        """All micro-DP groups, in a fixed order (every rank must create them in the same order)."""
        return sorted({tuple(self.micro_dp_group(r)) for r in range(self.train.world)}, key=lambda g: g[0])

    def gen_tp_group(self, rank: int) -> list[int]:
        """Ranks of this rank's generation replica, ordered by generation TP rank."""
        pp_rank, dp_rank, tp_rank = self.train.coords(rank)
        u = tp_rank % self.mu
        return [self.train.rank_of(pp_rank, dp_rank, j * self.mu + u) for j in range(self.gen.tp_g)]

    def model_parallel_group(self, rank: int) -> list[int]:
        """The pp*tp ranks holding one full training replica (the naive path gathers over these)."""
        _, dp_rank, _ = self.train.coords(rank)
        return sorted(
            self.train.rank_of(s, dp_rank, t) for s in range(self.train.pp) for t in range(self.train.tp)
        )

    def model_parallel_groups(self) -> list[tuple[int, ...]]:
        return sorted(
            {tuple(self.model_parallel_group(r)) for r in range(self.train.world)}, key=lambda g: g[0]
        )

    # ---- shards
    def held(self, rank: int, spec: ParamSpec) -> Piece | None:
        """The training chunk of ``spec`` this rank holds (None when another stage owns it)."""
        pp_rank, _, tp_rank = self.train.coords(rank)
        if spec.stage != pp_rank:
            return None
        if spec.split_dim is None:
            return Piece(spec, 0, 1)
        return Piece(spec, tp_rank, self.train.tp)

    def needed(self, rank: int, spec: ParamSpec) -> Piece:
        """The generation chunk of ``spec`` this rank needs (every stage's parameters)."""
        if spec.split_dim is None:
            return Piece(spec, 0, 1)
        return Piece(spec, self.gen_coords(rank)[1], self.gen.tp_g)

    def contribution(self, rank: int, spec: ParamSpec, mode: str = "regrouped") -> Piece | None:
        """What ``rank`` sends of ``spec`` to its group (micro-DP group for ``regrouped``, model-parallel
        group for ``naive``): its training chunk, except that a replicated parameter is sent by one holder
        only (the lowest TP rank among the holders in the group)."""
        piece = self.held(rank, spec)
        if piece is None or spec.split_dim is not None:
            return piece
        tp_rank = self.train.coords(rank)[2]
        first = (tp_rank // self.mu) * self.mu if mode == "regrouped" else 0
        return piece if tp_rank == first else None

    def gen_shard_bytes(self, rank: int) -> int:
        return sum(self.needed(rank, s).nbytes for s in self.specs)

    def held_bytes(self, rank: int) -> int:
        return sum(p.nbytes for s in self.specs if (p := self.held(rank, s)) is not None)


def training_shard(full: Mapping[str, torch.Tensor], plan: ReshardPlan, rank: int) -> dict[str, torch.Tensor]:
    """The training chunks ``rank`` holds, cut from a full HF state dict (clones: tests and benchmarks
    build training shards this way)."""
    out = {}
    for spec in plan.specs:
        piece = plan.held(rank, spec)
        if piece is not None:
            out[spec.name] = spec.chunk(full[spec.name], piece.index, piece.parts).clone()
    return out


def expected_gen_shard(
    full: Mapping[str, torch.Tensor], plan: ReshardPlan, rank: int
) -> dict[str, torch.Tensor]:
    """The generation chunks ``rank`` should end up with, cut from a full HF state dict (views)."""
    out = {}
    for spec in plan.specs:
        piece = plan.needed(rank, spec)
        out[spec.name] = spec.chunk(full[spec.name], piece.index, piece.parts)
    return out
