"""The sizes of a decoder-only Hugging Face language model (Qwen2/3, Llama, Mistral) read off its config: the
part that the Megatron conversion's `ModelShape` (workers/engine/megatron/hf_conversion.py) and the native
rollout forward's `ModelSpec` (workers/rollout/native/model.py) share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float

    @staticmethod
    def sizes_from_hf_config(cfg: Any) -> dict[str, Any]:
        """The fields above from a transformers config (key/value heads default to the query heads, the head
        size to hidden_size / heads), as keyword arguments for a subclass."""
        heads = cfg.num_attention_heads
        return {
            "num_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "num_heads": heads,
            "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.rms_norm_eps,
        }
