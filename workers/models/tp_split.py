"""How tensor parallelism cuts the per-layer parameters of a decoder-only Hugging Face model (Qwen2/3, Llama).

``LAYER_TP_SPLIT`` maps a parameter name after ``model.layers.<i>.`` to the dimension its shards split:
0 for Megatron's column-parallel layers (q/k/v, gate/up projections), 1 for row-parallel ones (o_proj,
down_proj), None for what every rank holds whole (norms, and the row-parallel biases, which are added once
after the all-reduce). The native rollout's TP shards (``workers/rollout/native/model.py``) and the weight
resharding plan (``workers/weight_sync/reshard_plan.py``) both follow it.
"""

from __future__ import annotations

LAYER_TP_SPLIT: dict[str, int | None] = {
    "self_attn.q_proj.weight": 0,
    "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.v_proj.bias": 0,
    "self_attn.o_proj.weight": 1,
    "self_attn.o_proj.bias": None,
    "mlp.gate_proj.weight": 0,
    "mlp.gate_proj.bias": 0,
    "mlp.up_proj.weight": 0,
    "mlp.up_proj.bias": 0,
    "mlp.down_proj.weight": 1,
    "mlp.down_proj.bias": None,
    "input_layernorm.weight": None,
    "post_attention_layernorm.weight": None,
    "self_attn.q_norm.weight": None,  # Qwen3: per-head norms
    "self_attn.k_norm.weight": None,
}
