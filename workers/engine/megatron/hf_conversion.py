"""Hugging Face Qwen2/Llama <-> megatron-core GPTModel (local layer spec) weights, per (TP rank, PP stage).

Two steps, each a pure function of tensors:

1. HF full tensor -> this rank's TP chunk in HF naming: ``reshard_plan.ParamSpec.chunk`` (column-parallel
   weights cut along dim 0, row-parallel along dim 1, norms replicated, vocab along dim 0). These
   "HF chunks" are also what weight resharding moves (``workers/weight_sync/reshard.py``).
2. HF chunks of one stage <-> Megatron local state dict:

   ============================================  =====================================================
   Megatron (local names, layers renumbered      HF
   from 0 on every stage)
   ============================================  =====================================================
   embedding.word_embeddings.weight (stage 0)    model.embed_tokens.weight
   decoder.layers.i.input_layernorm.weight       model.layers.L.input_layernorm.weight
   decoder.layers.i.self_attention.linear_qkv.*  q_proj/k_proj/v_proj .weight/.bias, fused per query
                                                 group: [q heads of group g; k_g; v_g] for each local g
   decoder.layers.i.self_attention.linear_proj   o_proj.weight
   decoder.layers.i.pre_mlp_layernorm.weight     post_attention_layernorm.weight
   decoder.layers.i.mlp.linear_fc1.weight        [gate_proj chunk; up_proj chunk] (SwiGLU: act(first)*second)
   decoder.layers.i.mlp.linear_fc2.weight        down_proj.weight
   decoder.final_layernorm.weight (last stage)   model.norm.weight
   output_layer.weight (last stage)              lm_head.weight (tied: the embedding chunk)
   output_layer.weight/.bias (critic)            score.weight/.bias (value head, replicated over TP)
   ============================================  =====================================================

   with ``L = stage * layers_per_stage + i``. Fusions happen inside one TP chunk, so no communication.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from workers.models.shape import DecoderShape
from workers.weight_sync.reshard_plan import ParamSpec, hf_param_specs


@dataclass(frozen=True)
class ModelShape(DecoderShape):
    """The HF config facts the conversion needs."""

    tie_word_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    max_position_embeddings: int
    value_head: bool = False  # critic: HF score.weight/bias [1, hidden] instead of lm_head

    @classmethod
    def from_hf_config(cls, cfg, value_head: bool = False) -> ModelShape:
        arch = (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
        model_type = getattr(cfg, "model_type", "")
        if model_type not in ("qwen2", "llama", "mistral"):
            raise ValueError(
                f"Megatron conversion supports Qwen2/Llama/Mistral configs, got model_type={model_type!r} ({arch})"
            )
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ("default", None):
            raise ValueError(
                f"Megatron conversion: rope_type {rope_type!r} is not supported (only 'default')"
            )
        return cls(
            **DecoderShape.sizes_from_hf_config(cfg),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)) and not value_head,
            qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            rope_theta=float(theta),
            max_position_embeddings=cfg.max_position_embeddings,
            value_head=value_head,
        )

    def check_parallel(self, tp: int, pp: int) -> None:
        """Errors naming the config value that the TP/PP sizes cannot split."""
        for key, value in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ):
            if value % tp:
                raise ValueError(f"{key}={value} is not divisible by tensor_model_parallel_size={tp}")
        if self.num_layers % pp:
            raise ValueError(
                f"num_hidden_layers={self.num_layers} is not divisible by pipeline_model_parallel_size={pp}"
            )


def param_specs(shape: ModelShape, pp: int, dtype: torch.dtype = torch.float32) -> list[ParamSpec]:
    """HF parameter specs (names, full shapes, owner stage, TP split) in HF order; no tied ``lm_head``."""
    h, hd = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    named: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab_size, h))]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        named += [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
        ]
        if shape.qkv_bias:
            named += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,))]
            named += [(p + "self_attn.v_proj.bias", (kv,))]
        named += [
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (shape.intermediate_size, h)),
            (p + "mlp.up_proj.weight", (shape.intermediate_size, h)),
            (p + "mlp.down_proj.weight", (h, shape.intermediate_size)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    named.append(("model.norm.weight", (h,)))
    if shape.value_head:
        named += [("score.weight", (1, h)), ("score.bias", (1,))]
    elif not shape.tie_word_embeddings:
        named.append(("lm_head.weight", (shape.vocab_size, h)))
    return hf_param_specs(
        [(n, s, dtype) for n, s in named], shape.num_layers, pp, shape.num_heads, shape.num_kv_heads
    )


def hf_chunks(
    full: Mapping[str, torch.Tensor], specs: list[ParamSpec], tp_rank: int, tp: int, pp_rank: int
) -> dict[str, torch.Tensor]:
    """This rank's TP chunks (HF names) of the parameters its stage owns, cut from a full HF state dict."""
    out = {}
    for spec in specs:
        if spec.stage != pp_rank:
            continue
        if spec.name not in full:
            raise KeyError(f"HF state dict has no {spec.name!r}")
        tensor = full[spec.name]
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{spec.name}: HF shape {tuple(tensor.shape)} != expected {spec.shape}")
        out[spec.name] = spec.chunk(tensor, tp_rank, tp)
    return out


# --------------------------------------------------------------------------- stage-local conversion

_LAYER_MAP = {  # one-to-one renames inside a decoder layer (Megatron suffix -> HF suffix)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _stage_layers(shape: ModelShape, pp_rank: int, pp: int) -> range:
    per = shape.num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape, tp: int) -> torch.Tensor:
    """[q heads of group g; k_g; v_g] for each local query group g (Megatron's linear_qkv layout)."""
    groups = shape.num_kv_heads // tp
    hd = shape.head_dim
    per_group = shape.num_heads // shape.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * hd, *rest)
    k = k.reshape(groups, hd, *rest)
    v = v.reshape(groups, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, shape: ModelShape, tp: int):
    groups = shape.num_kv_heads // tp
    hd = shape.head_dim
    per_group = shape.num_heads // shape.num_kv_heads
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, (per_group + 2) * hd, *rest)
    q, k, v = torch.split(g, [per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _qkv_kinds(shape: ModelShape) -> tuple[str, ...]:
    """The attention projections' parameters: weight, and bias where the model has one (Qwen2)."""
    return ("weight", "bias") if shape.qkv_bias else ("weight",)


def _layer_prefixes(shape: ModelShape, pp_rank: int, pp: int) -> list[tuple[str, str]]:
    """(HF name prefix, Megatron name prefix) of each decoder layer of stage ``pp_rank``."""
    return [
        (f"model.layers.{layer}.", f"decoder.layers.{local}.")
        for local, layer in enumerate(_stage_layers(shape, pp_rank, pp))
    ]


def megatron_from_hf_chunks(
    chunks: Mapping[str, torch.Tensor], shape: ModelShape, tp: int, pp_rank: int, pp: int
) -> dict[str, torch.Tensor]:
    """Megatron local state dict of stage ``pp_rank`` from its HF TP chunks (``hf_chunks``). On a tied
    model with pp > 1 the last stage's ``output_layer.weight`` is the embedding chunk, which the caller
    passes in ``chunks`` under ``model.embed_tokens.weight``."""
    out: dict[str, torch.Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = chunks["model.embed_tokens.weight"]
    for src, dst in _layer_prefixes(shape, pp_rank, pp):
        for meg, hf in _LAYER_MAP.items():
            out[dst + meg] = chunks[src + hf]
        for kind in _qkv_kinds(shape):
            q, k, v = (chunks[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _fuse_qkv(q, k, v, shape, tp)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [chunks[src + "mlp.gate_proj.weight"], chunks[src + "mlp.up_proj.weight"]], dim=0
        )
    if last:
        out["decoder.final_layernorm.weight"] = chunks["model.norm.weight"]
        if shape.value_head:
            out["output_layer.weight"], out["output_layer.bias"] = (
                chunks["score.weight"],
                chunks["score.bias"],
            )
        elif not shape.tie_word_embeddings:
            out["output_layer.weight"] = chunks["lm_head.weight"]
        elif pp > 1:  # Megatron keeps its own copy of the tied embedding on the last stage
            out["output_layer.weight"] = chunks["model.embed_tokens.weight"]
    return out


def hf_chunks_from_megatron(
    state: Mapping[str, torch.Tensor], shape: ModelShape, tp: int, pp_rank: int, pp: int
) -> dict[str, torch.Tensor]:
    """The inverse of ``megatron_from_hf_chunks``: this rank's HF TP chunks of its stage's parameters
    (the tied last-stage ``output_layer`` copy is dropped: stage 0's embedding is the HF weight)."""
    out: dict[str, torch.Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out["model.embed_tokens.weight"] = state["embedding.word_embeddings.weight"]
    for dst, src in _layer_prefixes(shape, pp_rank, pp):
        for kind in _qkv_kinds(shape):
            qkv = _split_qkv(state[f"{src}self_attention.linear_qkv.{kind}"], shape, tp)
            out.update({f"{dst}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", qkv, strict=True)})
        gate, up = state[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        for meg, hf in _LAYER_MAP.items():
            out[dst + hf] = state[src + meg]
    if last:
        out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
        if shape.value_head:
            out["score.weight"], out["score.bias"] = state["output_layer.weight"], state["output_layer.bias"]
        elif not shape.tie_word_embeddings:
            out["lm_head.weight"] = state["output_layer.weight"]
    return out
