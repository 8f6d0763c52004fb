"""Our own forward pass for Hugging Face decoder-only LMs (Qwen2, Qwen3, Llama, Mistral) over a slot KV cache.

The engine copies the Hugging Face module parameters into one flat buffer laid out for decoding
(q/k/v fused into one matrix, gate/up fused into one matrix, all of them views into that buffer) and runs
the transformer itself:

* RMSNorm, rotary embeddings, grouped-query attention and the gated MLP follow the Hugging Face modules
  operation for operation (float32 RMSNorm statistics, ``q*cos + rotate_half(q)*sin`` with the cos/sin
  table produced by the model's own rotary module, so every static RoPE scaling type HF supports works).
* The KV cache is static: ``[layers, slots, kv_heads, max_model_len, head_dim]`` for keys and for values.
  A running request owns one slot; the running batch always occupies slots ``0..B-1`` (the engine
  compacts slots when requests leave), so a decode step reads the cache as a plain view, with no gather.
* ``prefill`` runs a packed batch of prompts, right-padded per group only for attention (causal attention
  alone keeps real tokens from seeing the padding that follows them) and writes their keys/values into
  consecutive slots; ``decode`` runs one token per running request at its own position, with a per-row
  mask over the cache positions.
* Sliding-window attention (Mistral's ``sliding_window``; Qwen2/Qwen3's ``use_sliding_window`` /
  ``max_window_layers`` / ``layer_types``, local and global layers mixed) follows the installed transformers'
  masks: a query at position q sees keys q - window < k <= q on a sliding layer (``ModelSpec.layer_windows``).
  The cache still holds every position; prefill gives a sliding layer a banded causal mask, decode masks the
  positions that left a row's window and reads a group's keys from the first position one of its rows still
  sees. Layers with full attention (every layer of most models) run exactly as before, with no extra mask.

Parameter names (for ``update_weights``) are the Hugging Face state-dict names; tied embeddings map
``lm_head.weight`` and ``model.embed_tokens.weight`` to the same storage.

Tensor parallelism (``tp_group``: a torch.distributed group of ``tp`` ranks, gloo on CPU, NCCL on GPU):
Megatron-style, with plain local shards and explicit collectives (no DTensor: the forward is hand-written
over one flat buffer of views, and DTensor would add dispatch overhead to every small decode op for no gain).

* Column parallel: q/k/v split by heads (rank i holds query heads ``i*nh/tp ..`` and kv heads
  ``i*nkv/tp ..``, i.e. chunk i of each HF weight along dim 0, which keeps every GQA group on one rank) and
  gate/up split along the intermediate dimension. Row parallel: o_proj and down_proj split along their input
  dimension, each followed by one ``all_reduce(SUM)``; their biases are added once, after it.
* Embeddings, norms and lm_head are replicated (simplest; the vocabulary is small next to the layers for the
  models this engine serves), so every rank computes the same logits from the same all-reduced stream.
* The KV cache holds only the local kv heads. ``spec`` is the per-rank (local) spec; ``full_spec`` the model's.

The per-rank slices are exactly ``workers/weight_sync/reshard_plan.py``'s generation chunks (HF tensor cut in
``tp`` equal chunks along the split dimension), so a resharded generation shard loads as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers.models.shape import DecoderShape
from workers.models.tp_split import LAYER_TP_SPLIT

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "qwen3_moe")


@dataclass(frozen=True)
class ModelSpec(DecoderShape):
    """The shape facts of a decoder-only LM that the forward pass needs."""

    model_type: str
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    # mixture of experts (qwen3_moe): the layers whose MLP is a router over experts, and their sizes
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # sliding-window attention: each layer's window (a query at position q sees the keys at positions k with
    # q - window < k <= q), None for full attention; empty: every layer full. spec_from_hf writes None for a
    # window that no position below max_model_len can exceed, so a model whose windows never bind runs the
    # full-attention path.
    layer_windows: tuple[int | None, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def spec_from_hf(model: torch.nn.Module, max_model_len: int) -> ModelSpec:
    """Read a ModelSpec off a Hugging Face ``*ForCausalLM``; raise for what this forward does not implement."""
    cfg = cast("PretrainedConfig", model.config)
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"native engine supports model types {SUPPORTED_MODEL_TYPES}, got {cfg.model_type!r}"
        )
    layer_windows = _layer_windows(cfg, max_model_len)
    # get_submodule: the HF decoder's submodules typed as modules (attribute access types them Tensor | Module)
    rope_type = getattr(model.get_submodule("model.rotary_emb"), "rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        raise NotImplementedError(f"RoPE type {rope_type!r} depends on the sequence length")
    layer0 = model.get_submodule("model.layers.0")
    attn = layer0.get_submodule("self_attn")
    moe_layers = tuple(
        i
        for i in range(cfg.num_hidden_layers)
        if hasattr(model.get_submodule(f"model.layers.{i}.mlp"), "experts")
    )
    dense = [i for i in range(cfg.num_hidden_layers) if i not in moe_layers]
    mlp = model.get_submodule(f"model.layers.{dense[0]}.mlp") if dense else None
    return ModelSpec(
        **DecoderShape.sizes_from_hf_config(cfg),
        model_type=cfg.model_type,
        hidden_act=cfg.hidden_act,
        qkv_bias=attn.get_submodule("q_proj").bias is not None,
        o_bias=attn.get_submodule("o_proj").bias is not None,
        mlp_bias=mlp is not None and mlp.get_submodule("gate_proj").bias is not None,
        qk_norm=hasattr(attn, "q_norm"),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        moe_layers=moe_layers,
        num_experts=getattr(cfg, "num_experts", 0) if moe_layers else 0,
        experts_per_token=getattr(cfg, "num_experts_per_tok", 0) if moe_layers else 0,
        moe_intermediate_size=getattr(cfg, "moe_intermediate_size", 0) if moe_layers else 0,
        norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)),
        layer_windows=layer_windows if any(w is not None for w in layer_windows) else (),
    )


def _layer_windows(cfg: PretrainedConfig, max_model_len: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as the installed transformers' modeling code applies it (None: full attention).

    * qwen2, qwen3: per layer, ``config.layer_types[i] == "sliding_attention"`` slides by ``config.sliding_window``
      (the configs derive ``layer_types`` from ``use_sliding_window`` and ``max_window_layers`` when it is not
      given, and set ``sliding_window`` to None unless ``use_sliding_window``); the decoder builds one sliding
      mask for those layers (``create_sliding_window_causal_mask``).
    * mistral, qwen3_moe: every layer slides by ``config.sliding_window`` when it is set (qwen3_moe: with
      ``use_sliding_window``); ``layer_types`` is not read.
    * llama: full attention.

    The window, as ``transformers/masking_utils.py``'s ``sliding_window_overlay`` has it: a query at position q
    sees key position k when ``k > q - window`` (and k <= q), i.e. itself and the ``window - 1`` before it."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type in ("qwen2", "qwen3"):
        layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
        odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if odd or len(layer_types) != n:
            raise NotImplementedError(
                f"layer_types {layer_types}: the native engine runs 'full_attention' and 'sliding_attention' "
                f"layers, one type per layer ({n} layers)"
            )
        if "sliding_attention" in layer_types and window is None:
            raise ValueError(
                "config.layer_types has 'sliding_attention' layers but config.sliding_window is None "
                "(use_sliding_window=False); Hugging Face cannot build their mask either"
            )
        windows = [window if t == "sliding_attention" else None for t in layer_types]
    elif cfg.model_type in ("mistral", "qwen3_moe"):
        windows = [window] * n
    else:
        windows = [None] * n
    for w in windows:
        if w is not None and w < 1:
            raise ValueError(f"sliding_window {w}: a window must hold at least the query's own position")
    # a query at position q < max_model_len sees every key k <= q when q - window < 0, i.e. window >= max_model_len
    return tuple(w if w is not None and w < max_model_len else None for w in windows)


VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def tp_split_dim(name: str) -> int | None:
    """The dimension tensor parallelism cuts HF parameter ``name`` along (None: replicated)."""
    if not name.startswith("model.layers."):
        return None
    return LAYER_TP_SPLIT.get(name.split(".", 3)[3])


def tp_local_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The spec of one of ``tp`` ranks' shards; raise naming the sizes that ``tp`` does not divide."""
    if tp == 1:
        return spec
    if spec.moe_layers:
        raise ValueError(
            f"tensor-parallel size tp={tp}: the native engine runs a mixture-of-experts model ({spec.model_type}) "
            "on one rank per replica (no expert or tensor parallelism); use rollout.tensor_model_parallel_size=1"
        )
    bad = [
        f"{key}={value}"
        for key, value in (
            ("num_attention_heads", spec.num_heads),
            ("num_key_value_heads", spec.num_kv_heads),
            ("intermediate_size", spec.intermediate_size),
        )
        if value % tp
    ]
    if bad:
        raise ValueError(
            f"tensor-parallel size tp={tp} must divide the model's head counts and intermediate size; "
            f"it does not divide {', '.join(bad)}"
        )
    return replace(
        spec,
        num_heads=spec.num_heads // tp,
        num_kv_heads=spec.num_kv_heads // tp,
        intermediate_size=spec.intermediate_size // tp,
    )


class WeightStore:
    """All weights in one flat buffer of views: freeing the buffer frees every weight at once.

    ``entries`` maps a key (``"embed"``, ``"3.qkv_w"``, ...) to a shape. ``names`` maps each Hugging Face
    parameter name to ``(key, row_start, row_end)``: the rows of that entry the parameter fills.
    """

    def __init__(
        self, entries: dict[str, tuple[int, ...]], names: dict[str, tuple[str, int, int]], dtype, device
    ):
        self.entries = entries
        self.names = names
        self.dtype = dtype
        self.device = torch.device(device)
        self.flat: torch.Tensor | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    @property
    def allocated(self) -> bool:
        return self.flat is not None

    ALIGN = 64  # elements; every entry starts on a 128/256-byte boundary (vector loads, cuBLAS)

    def _layout(self) -> tuple[dict[str, int], int]:
        offsets, offset = {}, 0
        for key, shape in self.entries.items():
            offsets[key] = offset
            n = 1
            for s in shape:
                n *= s
            offset += -(-n // self.ALIGN) * self.ALIGN
        return offsets, offset

    def numel(self) -> int:
        """Elements of real weights (alignment padding excluded)."""
        total = 0
        for shape in self.entries.values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    def nbytes(self) -> int:
        return self.numel() * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self) -> None:
        offsets, total = self._layout()
        self.flat = torch.empty(total, dtype=self.dtype, device=self.device)
        self.tensors = {}
        for key, shape in self.entries.items():
            n = 1
            for s in shape:
                n *= s
            self.tensors[key] = self.flat[offsets[key] : offsets[key] + n].view(shape)

    def free(self) -> None:
        self.flat = None
        self.tensors = {}

    def target(self, name: str) -> torch.Tensor:
        key, start, end = self.names[name]
        return self.tensors[key][start:end]


def build_store(spec: ModelSpec, dtype, device) -> WeightStore:
    """Lay out the engine's weights for ``spec`` and map every HF parameter name onto them."""
    H, inter, V, q, kv = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.q_size, spec.kv_size
    entries: dict[str, tuple[int, ...]] = {"embed": (V, H)}
    names: dict[str, tuple[str, int, int]] = {"model.embed_tokens.weight": ("embed", 0, V)}
    if spec.tie_word_embeddings:
        names["lm_head.weight"] = ("embed", 0, V)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        entries[f"{i}.ln1"] = (H,)
        names[p + "input_layernorm.weight"] = (f"{i}.ln1", 0, H)
        entries[f"{i}.qkv_w"] = (q + 2 * kv, H)
        for proj, start, end in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
            names[p + f"self_attn.{proj}_proj.weight"] = (f"{i}.qkv_w", start, end)
            if spec.qkv_bias:
                names[p + f"self_attn.{proj}_proj.bias"] = (f"{i}.qkv_b", start, end)
        if spec.qkv_bias:
            entries[f"{i}.qkv_b"] = (q + 2 * kv,)
        if spec.qk_norm:
            entries[f"{i}.q_norm"] = (spec.head_dim,)
            entries[f"{i}.k_norm"] = (spec.head_dim,)
            names[p + "self_attn.q_norm.weight"] = (f"{i}.q_norm", 0, spec.head_dim)
            names[p + "self_attn.k_norm.weight"] = (f"{i}.k_norm", 0, spec.head_dim)
        entries[f"{i}.o_w"] = (H, q)
        names[p + "self_attn.o_proj.weight"] = (f"{i}.o_w", 0, H)
        if spec.o_bias:
            entries[f"{i}.o_b"] = (H,)
            names[p + "self_attn.o_proj.bias"] = (f"{i}.o_b", 0, H)
        entries[f"{i}.ln2"] = (H,)
        names[p + "post_attention_layernorm.weight"] = (f"{i}.ln2", 0, H)
        if i in spec.moe_layers:
            E, moe_inter = spec.num_experts, spec.moe_intermediate_size
            entries[f"{i}.router_w"] = (E, H)
            names[p + "mlp.gate.weight"] = (f"{i}.router_w", 0, E)
            entries[f"{i}.experts_gu_w"] = (E, 2 * moe_inter, H)  # HF's fused layout: gate rows, then up rows
            names[p + "mlp.experts.gate_up_proj"] = (f"{i}.experts_gu_w", 0, E)
            entries[f"{i}.experts_down_w"] = (E, H, moe_inter)
            names[p + "mlp.experts.down_proj"] = (f"{i}.experts_down_w", 0, E)
            continue
        entries[f"{i}.gu_w"] = (2 * inter, H)
        names[p + "mlp.gate_proj.weight"] = (f"{i}.gu_w", 0, inter)
        names[p + "mlp.up_proj.weight"] = (f"{i}.gu_w", inter, 2 * inter)
        entries[f"{i}.down_w"] = (H, inter)
        names[p + "mlp.down_proj.weight"] = (f"{i}.down_w", 0, H)
        if spec.mlp_bias:
            entries[f"{i}.gu_b"] = (2 * inter,)
            entries[f"{i}.down_b"] = (H,)
            names[p + "mlp.gate_proj.bias"] = (f"{i}.gu_b", 0, inter)
            names[p + "mlp.up_proj.bias"] = (f"{i}.gu_b", inter, 2 * inter)
            names[p + "mlp.down_proj.bias"] = (f"{i}.down_b", 0, H)
    entries["norm"] = (H,)
    names["model.norm.weight"] = ("norm", 0, H)
    if not spec.tie_word_embeddings:
        entries["lm_head"] = (V, H)
        names["lm_head.weight"] = ("lm_head", 0, V)
    return WeightStore(entries, names, dtype, device)


def _rms_norm_hf(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # The HF RMSNorm modules' operations: float32 statistics, scale, cast back, multiply by the weight.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32.to(dtype) if weight is None else weight * x32.to(dtype)


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # One fused op; in float32 it computes the same as _rms_norm_hf (checked bit-exact by the tests).
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # HF: x*cos + rotate_half(x)*sin with rotate_half(x) = cat(-x2, x1). roll(x) = cat(x2, x1), and the
    # sign of the first half lives in sin_signed = cat(-sin1, sin2): the same products, bit for bit.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [n, in] grouped by expert (group e ends at row ``ends[e]``) times their expert's
    ``weight[e]`` [out, in]^T: one grouped GEMM where torch has it for this device, dtype and alignment (CUDA's
    kernel takes bf16; every kernel needs 16-byte-aligned strides), else a matmul per expert."""
    if _grouped_mm_fits(x, weight):
        return F.grouped_mm(x, weight.transpose(1, 2), offs=ends)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):  # one host read of the group sizes
        if end > start:
            torch.mm(x[start:end], weight[e].t(), out=out[start:end])
        start = end
    return out


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm") or (x.device.type != "cpu" and x.dtype != torch.bfloat16):
        return False
    align = 16 // x.element_size()
    return x.shape[1] % align == 0 and weight.shape[1] % align == 0


class _Layer:
    """One decoder layer's weights (views into the WeightStore buffer)."""

    __slots__ = (
        "ln1",
        "qkv_w",
        "qkv_b",
        "q_norm",
        "k_norm",
        "o_w",
        "o_b",
        "ln2",
        "gu_w",
        "gu_b",
        "down_w",
        "down_b",
        "router_w",
        "experts_gu_w",
        "experts_down_w",
    )

    def __init__(self, t: dict[str, torch.Tensor], i: int):
        self.ln1 = t[f"{i}.ln1"]
        self.qkv_w = t[f"{i}.qkv_w"]
        self.qkv_b = t.get(f"{i}.qkv_b")
        self.q_norm = t.get(f"{i}.q_norm")
        self.k_norm = t.get(f"{i}.k_norm")
        self.o_w = t[f"{i}.o_w"]
        self.o_b = t.get(f"{i}.o_b")
        self.ln2 = t[f"{i}.ln2"]
        self.gu_w = t.get(f"{i}.gu_w")  # a mixture-of-experts layer has router and expert weights instead
        self.gu_b = t.get(f"{i}.gu_b")
        self.down_w = t.get(f"{i}.down_w")
        self.down_b = t.get(f"{i}.down_b")
        self.router_w = t.get(f"{i}.router_w")
        self.experts_gu_w = t.get(f"{i}.experts_gu_w")
        self.experts_down_w = t.get(f"{i}.experts_down_w")


class NativeCausalLM:
    """Weights + static slot KV cache + the prefill/decode forward passes. Not thread-safe by itself."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        max_model_len: int,
        max_num_seqs: int,
        dtype=None,
        device=None,
        tp_group=None,
    ):
        first = next(hf_model.parameters())
        self.dtype = dtype or first.dtype
        self.device = torch.device(device) if device is not None else first.device
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        # tp_group None (or of size 1): no tensor parallelism, no collectives at all.
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.tp_group = tp_group if self.tp_size > 1 else None
        self.full_spec = spec_from_hf(hf_model, max_model_len)
        self.spec = tp_local_spec(self.full_spec, self.tp_size)
        # each layer's sliding window (None: full attention); the mask depends on positions only, not on heads,
        # so it is the same on every tensor-parallel rank
        self.windows: list[int | None] = list(self.spec.layer_windows) or [None] * self.spec.num_layers
        self.hf_config = hf_model.config
        if self.spec.hidden_act == "silu":
            self._act = F.silu
        else:
            from transformers.activations import ACT2FN

            self._act = ACT2FN[self.spec.hidden_act]
        self._norm = _rms_norm_fp32 if self.dtype == torch.float32 else _rms_norm_hf
        self.store = build_store(self.spec, self.dtype, self.device)
        self.store.allocate()
        params = dict(hf_model.named_parameters(remove_duplicate=False))
        missing = sorted(set(self.store.names) - set(params))
        unmapped = sorted(set(params) - set(self.store.names))
        if missing or unmapped:
            raise NotImplementedError(
                f"parameter layout not understood: missing {missing[:8]}, unexpected {unmapped[:8]}"
            )
        with torch.no_grad():
            for name, tensor in params.items():
                self.store.target(name).copy_(self.local_shard(name, tensor))
        self._bind()
        # cos/sin for every position, from the model's own rotary module (same values HF computes per call).
        with torch.no_grad():
            rotary = hf_model.get_submodule("model.rotary_emb")
            inv_freq = cast(torch.Tensor, rotary.inv_freq)
            pos = torch.arange(max_model_len, device=inv_freq.device)[None]
            probe = torch.empty(0, dtype=self.dtype, device=inv_freq.device)
            cos, sin = rotary(probe, pos)
        half = self.spec.head_dim // 2
        self.cos = cos[0].to(self.device)
        self.sin_signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1).to(self.device)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # Mixture of experts: with record_routes set, each forward leaves its tokens' expert ids in last_routes,
        # [tokens, MoE layers, top-k] (uint8), the tokens in the order the forward took them.
        self.record_routes = bool(self.spec.moe_layers)
        self.last_routes: torch.Tensor | None = None
        self._routes: list[torch.Tensor] | None = None
        # decode_static's attention: "bmm" (scores, float32 softmax, weighted sum: three batched kernels) or
        # "sdpa" (torch's fused attention with the length mask); which is faster on a GPU is for the GPU check's
        # rollout_decode step to tell (benchmarks/bench_rollout.py --cuda-graphs on,on-sdpa)
        self.static_attention = "bmm"
        # a layer's two blocks around attention, as the forward passes call them (compile_blocks swaps them)
        self.qkv_block: Callable = self._layer_qkv
        self.out_block: Callable = self._layer_out

    # ---- weights -------------------------------------------------------------------------------------

    def _bind(self) -> None:
        t = self.store.tensors
        self.layers = [_Layer(t, i) for i in range(self.spec.num_layers)]
        # None while the weights are released (free_weights)
        self.embed: torch.Tensor | None = t["embed"]
        self.norm: torch.Tensor | None = t["norm"]
        self.lm_head: torch.Tensor | None = t["embed"] if self.spec.tie_word_embeddings else t["lm_head"]

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The unsharded HF shape of parameter ``name``."""
        local = tuple(self.store.target(name).shape)
        dim = tp_split_dim(name)
        if dim is None:
            return local
        return local[:dim] + (local[dim] * self.tp_size,) + local[dim + 1 :]

    def local_shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of HF parameter ``name`` from ``tensor``: the full tensor (sliced here) or already
        this rank's shard (as the resharder delivers it; returned as is). A vocabulary shard of the
        embedding / lm_head (``vocab/tp`` rows, the resharder's layout) is all-gathered in the TP group into
        the replicated table: a collective, so every TP rank must load the same names in the same order."""
        local = tuple(self.store.target(name).shape)
        shape = tuple(tensor.shape)
        if shape == local:
            return tensor
        dim, full = tp_split_dim(name), self.full_shape(name)
        if dim is not None and shape == full:
            return tensor.narrow(dim, self.tp_rank * local[dim], local[dim])
        if self.tp_size > 1 and name in VOCAB_NAMES and local[0] % self.tp_size == 0:
            if shape == (local[0] // self.tp_size,) + local[1:]:
                return self._gather_vocab(tensor)
        if self.tp_size == 1:
            raise ValueError(f"{name}: shape {shape} != expected {local}")
        raise ValueError(
            f"{name}: shape {shape} is neither the full tensor {full} nor TP rank {self.tp_rank}'s shard "
            f"{local} (tp={self.tp_size})"
        )

    def _gather_vocab(self, shard: torch.Tensor) -> torch.Tensor:
        shard = shard.to(self.device, self.dtype).contiguous()
        parts = [torch.empty_like(shard) for _ in range(self.tp_size)]
        dist.all_gather(parts, shard, group=self.tp_group)
        return torch.cat(parts, dim=0)

    def free_weights(self) -> None:
        self.store.free()
        self.layers, self.embed, self.norm, self.lm_head = [], None, None, None

    def allocate_weights(self) -> None:
        self.store.allocate()
        self._bind()

    def weight_bytes(self) -> int:
        return self.store.nbytes()

    # ---- KV cache ------------------------------------------------------------------------------------

    def kv_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (s.num_layers, self.max_num_seqs, s.num_kv_heads, self.max_model_len, s.head_dim)

    def allocate_kv(self) -> None:
        if self.k_cache is None:
            self.k_cache = torch.zeros(self.kv_shape(), dtype=self.dtype, device=self.device)
            self.v_cache = torch.zeros(self.kv_shape(), dtype=self.dtype, device=self.device)

    def free_kv(self) -> None:
        self.k_cache = None
        self.v_cache = None

    def kv_bytes_per_token(self) -> int:
        s = self.spec
        return (
            2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.empty((), dtype=self.dtype).element_size()
        )

    def _kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value caches, which a forward pass or a slot move needs allocated (allocate_kv)."""
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not allocated"
        return self.k_cache, self.v_cache

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cache positions of slot ``src`` into slot ``dst`` (all layers)."""
        self.copy_slot(src, [dst], length)

    def copy_slot(self, src: int, dsts: list[int], length: int) -> None:
        """Copy the first ``length`` cache positions of slot ``src`` into each slot of ``dsts`` (all layers, one
        copy per cache)."""
        k_cache, v_cache = self._kv_cache()
        index = torch.tensor(dsts, device=k_cache.device)
        k_cache[:, index, :, :length] = k_cache[:, src : src + 1, :, :length]
        v_cache[:, index, :, :length] = v_cache[:, src : src + 1, :, :length]

    # ---- forward passes ------------------------------------------------------------------------------

    def compile_blocks(self) -> None:
        """``torch.compile`` the two blocks of a layer around attention (norms, projections, RoPE, the MLP, the
        residuals): one graph each, with a dynamic token count, for every layer, prefill and decode. Attention
        stays eager (its key length changes every step); so does the row-parallel block under tensor
        parallelism (its all-reduce). Same tokens as eager, log-probs within float rounding (the ``compiled``
        cases of tests/workers/rollout/test_native_engine.py); compiles on first use."""
        self.qkv_block = torch.compile(self._layer_qkv, dynamic=True)
        # a mixture of experts' out block stays eager too: its expert groups have data-dependent sizes and it
        # appends the routes it chose to a list
        if self.tp_group is None and not self.spec.moe_layers:
            self.out_block = torch.compile(self._layer_out, dynamic=True)

    def _layer_qkv(self, h, layer: _Layer, cos, sin_signed):
        """h [n, H] -> (q [n, nq, hd], k [n, nkv, hd], v [n, nkv, hd]) with Qwen3 q/k norms and RoPE."""
        s = self.spec
        n = h.shape[0]
        qkv = F.linear(self._norm(h, layer.ln1, s.rms_norm_eps), layer.qkv_w, layer.qkv_b)
        if layer.q_norm is None:
            qk = qkv[:, : s.q_size + s.kv_size].view(n, s.num_heads + s.num_kv_heads, s.head_dim)
        else:
            q = self._norm(qkv[:, : s.q_size].view(n, s.num_heads, s.head_dim), layer.q_norm, s.rms_norm_eps)
            k = qkv[:, s.q_size : s.q_size + s.kv_size].view(n, s.num_kv_heads, s.head_dim)
            qk = torch.cat((q, self._norm(k, layer.k_norm, s.rms_norm_eps)), dim=1)
        qk = _rope(qk, cos, sin_signed)  # q and k heads rotated in one go
        v = qkv[:, s.q_size + s.kv_size :].view(n, s.num_kv_heads, s.head_dim)
        return qk[:, : s.num_heads], qk[:, s.num_heads :], v

    def _layer_out(self, h, attn, layer: _Layer):
        """Residual + o_proj, then the MLP block with its residual; all tokens flattened to [n, ...]."""
        if self.tp_group is not None:
            return self._layer_out_tp(h, attn, layer)
        s = self.spec
        if layer.o_b is None:
            h = torch.addmm(h, attn, layer.o_w.t())
        else:
            h = h + F.linear(attn, layer.o_w, layer.o_b)
        if layer.router_w is not None:
            return h + self._moe_mlp(self._norm(h, layer.ln2, s.rms_norm_eps), layer)
        assert layer.gu_w is not None and layer.down_w is not None
        gu = F.linear(self._norm(h, layer.ln2, s.rms_norm_eps), layer.gu_w, layer.gu_b)
        act = self._act(gu[:, : s.intermediate_size]) * gu[:, s.intermediate_size :]
        if layer.down_b is None:
            return torch.addmm(h, act, layer.down_w.t())
        return h + F.linear(act, layer.down_w, layer.down_b)

    def _moe_mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """x [n, H] (normed) -> the routed experts' weighted sum [n, H], choosing experts as HF's top-k router
        does (fp32 softmax, top-k, renormalised when norm_topk_prob). The (token, expert) pairs are sorted by
        expert so that each projection is one grouped matmul over every expert: no loop over tokens or experts.
        Each token's top-k expert ids go to ``self._routes`` while routes are recorded."""
        s = self.spec
        assert (
            layer.router_w is not None and layer.experts_gu_w is not None and layer.experts_down_w is not None
        )
        k, inter = s.experts_per_token, s.moe_intermediate_size
        probs = torch.softmax(F.linear(x, layer.router_w), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k, dim=-1)
        if s.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self._routes is not None:
            self._routes.append(ids)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        ends = torch.cumsum(torch.bincount(flat, minlength=s.num_experts), 0).to(torch.int32)
        gu = _grouped_linear(x[token], layer.experts_gu_w, ends)
        act = self._act(gu[:, :inter]) * gu[:, inter:]
        y = _grouped_linear(act, layer.experts_down_w, ends) * weights.to(x.dtype).reshape(-1)[order, None]
        # each token's experts are added in ascending expert order, as HF's per-expert loop adds them
        return torch.zeros_like(x).index_add_(0, token, y)

    def _row_parallel(self, x, weight, bias):
        """x [n, local in] @ weight [out, local in]^T summed over the TP ranks, then the (replicated) bias."""
        y = F.linear(x, weight)
        dist.all_reduce(y, group=self.tp_group)
        return y if bias is None else y + bias

    def _layer_out_tp(self, h, attn, layer: _Layer):
        # Same as _layer_out, with the row-parallel o_proj / down_proj partial sums all-reduced first.
        s = self.spec
        h = h + self._row_parallel(attn, layer.o_w, layer.o_b)
        assert layer.gu_w is not None and layer.down_w is not None  # tp_local_spec refuses MoE models
        gu = F.linear(self._norm(h, layer.ln2, s.rms_norm_eps), layer.gu_w, layer.gu_b)
        act = self._act(gu[:, : s.intermediate_size]) * gu[:, s.intermediate_size :]
        return h + self._row_parallel(act, layer.down_w, layer.down_b)

    def _logits(self, h):
        assert self.lm_head is not None, "weights released"
        return F.linear(self._norm(h, self.norm, self.spec.rms_norm_eps), self.lm_head).float()

    def prefill(self, prompts: list[list[int]], slot_start: int) -> torch.Tensor:
        """Run prompts from position 0 and store their keys/values in slots ``slot_start ...``; return the
        float32 logits of each prompt's last token, ``[N, vocab]``.

        Tokens are packed (no padding) for every matmul; only attention pads the queries, per group of
        prompts to the group's longest, ``[rows, P_g]``, and reads the keys/values back from the cache slots
        (causal masking keeps each query from the slot positions past its own, which hold stale entries of
        earlier requests)."""
        s = self.spec
        dev = self.device
        N = len(prompts)
        lengths = [len(p) for p in prompts]
        nkv, hd, T_max = s.num_kv_heads, s.head_dim, self.max_model_len
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
        lens = torch.tensor(lengths, dtype=torch.long, device=dev)
        starts = torch.cumsum(lens, 0) - lens
        row = torch.repeat_interleave(torch.arange(N, device=dev), lens)
        pos = torch.arange(tokens.shape[0], device=dev) - starts[row]
        cos = self.cos[pos][:, None, :]
        sin_signed = self.sin_signed[pos][:, None, :]
        # Attention runs per group of consecutive prompts, each padded only to its own longest prompt
        # (the engine passes prompts longest first): one group for the batch would pad every query row
        # to the longest prompt and attend over its full causal square.
        groups = self._row_groups(lengths, self.PREFILL_GROUP_COST, self.MIN_PREFILL_GROUP_ROWS, squared=True)
        token_starts = [0]
        for n in lengths:
            token_starts.append(token_starts[-1] + n)
        # per group: its packed token range and each token's row in its padded [rows * P_g] query layout
        spans = [
            (a, e, t, token_starts[a], token_starts[e], (row[token_starts[a] : token_starts[e]] - a) * t
             + pos[token_starts[a] : token_starts[e]])
            for a, e, t in groups
        ]  # fmt: skip
        cache_rows = (
            ((row + slot_start)[:, None] * nkv + torch.arange(nkv, device=dev)[None, :]) * T_max
            + pos[:, None]
        ).reshape(-1)
        gqa = s.num_kv_heads != s.num_heads
        # Sliding-window layers: every prompt starts at position 0, so query row i of a group is position i and
        # one banded causal mask [t, t] per (window, group length) serves every row (padding rows see their own
        # position at least: no empty softmax row).
        bands: dict[tuple[int, int], torch.Tensor] = {}
        for w in {w for w in self.windows if w is not None}:
            for _, _, t, _, _, _ in spans:
                if w < t and (w, t) not in bands:
                    i = torch.arange(t, device=dev)
                    diff = i[:, None] - i[None, :]
                    bands[w, t] = (diff >= 0) & (diff < w)
        k_cache, v_cache = self._kv_cache()
        assert self.embed is not None, "weights released"
        self._start_routes()
        h = F.embedding(tokens, self.embed)
        for li, layer in enumerate(self.layers):
            q, k, v = self.qkv_block(h, layer, cos, sin_signed)
            k_cache[li].view(-1, hd).index_copy_(0, cache_rows, k.reshape(-1, hd))
            v_cache[li].view(-1, hd).index_copy_(0, cache_rows, v.reshape(-1, hd))
            window = self.windows[li]
            parts = []
            for a, e, t, ta, tb, padded in spans:
                q_pad = q.new_zeros((e - a) * t, s.num_heads, hd).index_copy_(0, padded, q[ta:tb])
                q_pad = q_pad.view(e - a, t, s.num_heads, hd).transpose(1, 2)
                keys = k_cache[li, slot_start + a : slot_start + e, :, :t]
                values = v_cache[li, slot_start + a : slot_start + e, :, :t]
                band = None if window is None or window >= t else bands[window, t]
                attn = F.scaled_dot_product_attention(
                    q_pad,
                    keys,
                    values,
                    attn_mask=band,
                    is_causal=band is None,
                    scale=hd**-0.5,
                    enable_gqa=gqa,
                )
                parts.append(attn.transpose(1, 2).reshape((e - a) * t, s.q_size).index_select(0, padded))
            h = self.out_block(h, parts[0] if len(parts) == 1 else torch.cat(parts), layer)
        self._end_routes()
        return self._logits(h[starts + lens - 1])

    def _start_routes(self) -> None:
        self.last_routes = None
        self._routes = [] if self.record_routes and self.spec.moe_layers else None

    def _end_routes(self) -> None:
        if self._routes is not None:
            ids = torch.stack(self._routes, dim=1)
            self.last_routes = ids.to(torch.uint8 if self.spec.num_experts <= 256 else torch.int16)
            self._routes = None

    def _row_groups(
        self, lengths: list[int], group_cost: int, min_rows: int, squared: bool = False
    ) -> list[tuple[int, int, int]]:
        """Split rows 0..B-1 into contiguous groups ``(start, end, longest)`` whose attention reads only up
        to their own longest row: one group for the whole batch pads every row to the batch's longest.
        Cost of a group: rows * longest (decode: cache positions read) or rows * longest**2 with
        ``squared`` (prefill: the padded causal square), plus ``group_cost`` for its extra small ops.
        Tries halving group sizes down to ``min_rows`` and keeps the cheapest split."""
        B = len(lengths)
        power = 2 if squared else 1
        best, best_cost = [(0, B, max(lengths))], B * max(lengths) ** power
        size = B // 2
        while size >= min_rows:
            groups = [(s, min(s + size, B), max(lengths[s : s + size])) for s in range(0, B, size)]
            cost = sum((e - s) * t**power for s, e, t in groups) + len(groups) * group_cost
            if cost < best_cost:
                best, best_cost = groups, cost
            size //= 2
        return best

    MIN_GROUP_ROWS = 4
    GROUP_COST_TOKENS = 256  # decode: a group's extra ops cost about as much as reading this many positions
    MIN_PREFILL_GROUP_ROWS = 1
    # prefill: a group's extra ops (padding, one more attention call) cost about as much as this many
    # query x key positions of attention (measured on CPU: ~0.1 ms)
    PREFILL_GROUP_COST = 8192

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token per running request: ``tokens[b]`` at ``positions[b]`` for the request in slot ``b``
        (slots ``0..B-1``); their keys/values are written at those positions. Returns float32 logits
        ``[B, vocab]``."""
        s = self.spec
        B = len(tokens)
        nkv, g, hd = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
        dev = self.device
        groups = self._row_groups([p + 1 for p in positions], self.GROUP_COST_TOKENS, self.MIN_GROUP_ROWS)
        T = max(t for _, _, t in groups)
        tokens_t = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        # Row b sees cache positions <= positions[b]; later ones are stale or belong to nobody.
        steps = torch.arange(T, device=dev)[None, :]
        mask = torch.zeros(B, T, dtype=self.dtype, device=dev)
        mask.masked_fill_(steps > pos[:, None], float("-inf"))
        # Per window (None: full attention), per group: (first cache position read, mask [rows*nkv, 1, keys]).
        # A sliding layer's row b also drops positions <= positions[b] - window, and its group reads the cache
        # only from the first position any of its rows still sees.
        masks: dict[int | None, list[tuple[int, torch.Tensor]]] = {}
        for w in {*self.windows}:
            m = mask if w is None else mask.masked_fill(steps <= pos[:, None] - w, float("-inf"))
            masks[w] = []
            for a, e, t in groups:
                lo = 0 if w is None else max(0, min(positions[a:e]) - w + 1)
                rows = m[a:e, None, None, lo:t].expand(e - a, nkv, 1, t - lo)
                masks[w].append((lo, rows.reshape((e - a) * nkv, 1, t - lo)))

        def attend(q, kc, vc, window):  # q [B*nkv, g, hd] -> [B*nkv, g, hd], group by group
            attn = torch.empty(B * nkv, g, hd, dtype=self.dtype, device=dev)
            for (a, e, t), (lo, m) in zip(groups, masks[window]):
                keys = kc[a:e, :, lo:t].flatten(0, 1)  # [rows*nkv, t - lo, hd], a view
                values = vc[a:e, :, lo:t].flatten(0, 1)
                self._attend_rows(q[a * nkv : e * nkv], keys, values, m, out=attn[a * nkv : e * nkv])
            return attn

        return self._decode_layers(tokens_t, pos, attend)

    def decode_static(self, tokens: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """``decode`` with fixed shapes and no host reads, the form a CUDA graph captures (``graphs.py``):
        ``tokens``/``pos`` are device tensors ``[B]`` (the rows of slots ``0..B-1``; padding rows too, which write
        their position of their free slot), attention reads cache positions ``0..kv_len-1`` of every row
        (``kv_len`` > every position) under a mask made on the device. Same logits as ``decode`` within float
        rounding (it pads every row to ``kv_len`` where ``decode`` groups rows by length)."""
        s = self.spec
        B = tokens.shape[0]
        nkv, g, hd = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
        steps = torch.arange(kv_len, device=self.device)[None, :]
        masks: dict[int | None, torch.Tensor] = {}  # per window: additive [B, 1, 1, kv_len], one per row
        for w in {*self.windows}:
            hide = steps > pos[:, None]
            if w is not None:
                hide = hide | (steps <= pos[:, None] - w)
            m = torch.zeros(B, kv_len, dtype=self.dtype, device=self.device).masked_fill_(hide, float("-inf"))
            masks[w] = m[:, None, None, :]

        def attend(q, kc, vc, window):
            keys, values = kc[:B, :, :kv_len], vc[:B, :, :kv_len]  # [B, nkv, kv_len, hd] views
            if self.static_attention == "sdpa":  # a kv head's g query heads as g query rows: no GQA expansion
                out = F.scaled_dot_product_attention(
                    q.view(B, nkv, g, hd), keys, values, attn_mask=masks[window], scale=hd**-0.5
                )
                return out.reshape(B * nkv, g, hd)
            mask = masks[window].expand(B, nkv, 1, kv_len).reshape(B * nkv, 1, kv_len)
            return self._attend_rows(q, keys.flatten(0, 1), values.flatten(0, 1), mask)

        return self._decode_layers(tokens, pos, attend)

    def _attend_rows(self, q, keys, values, mask, out=None):
        """One query per (row, kv head): ``q [R, g, hd]`` over ``keys``/``values`` ``[R, t, hd]`` with an additive
        ``mask [R, 1, t]``; softmax statistics in float32."""
        scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=self.spec.head_dim**-0.5)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
        return torch.bmm(probs, values, out=out)

    def _decode_layers(self, tokens: torch.Tensor, pos: torch.Tensor, attend: Callable) -> torch.Tensor:
        """The decode forward of one token per row (slots ``0..B-1``) at positions ``pos``: writes each row's
        keys/values at its position, ``attend(q, k_cache[layer], v_cache[layer], window)`` does the rest of
        attention; float32 logits ``[B, vocab]``."""
        s = self.spec
        B = tokens.shape[0]
        nkv, g, hd, T_max = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim, self.max_model_len
        dev = self.device
        cos = self.cos[pos][:, None, :]
        sin_signed = self.sin_signed[pos][:, None, :]
        # Flat row index of (slot b, kv head j, position p) in a layer's cache viewed as [-1, head_dim].
        cache_rows = (
            (torch.arange(B, device=dev)[:, None] * nkv + torch.arange(nkv, device=dev)[None, :]) * T_max
            + pos[:, None]
        ).reshape(-1)
        k_cache, v_cache = self._kv_cache()
        assert self.embed is not None, "weights released"
        self._start_routes()
        h = F.embedding(tokens, self.embed)
        for li, layer in enumerate(self.layers):
            q, k, v = self.qkv_block(h, layer, cos, sin_signed)
            kc, vc = k_cache[li], v_cache[li]
            kc.view(-1, hd).index_copy_(0, cache_rows, k.reshape(B * nkv, hd))
            vc.view(-1, hd).index_copy_(0, cache_rows, v.reshape(B * nkv, hd))
            attn = attend(q.reshape(B * nkv, g, hd), kc, vc, self.windows[li])
            h = self.out_block(h, attn.view(B, s.q_size), layer)
        self._end_routes()
        return self._logits(h)
