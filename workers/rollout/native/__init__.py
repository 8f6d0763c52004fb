"""Native torch rollout engine: static slot KV cache, continuous batching, batched sampling (issue 4).

``NativeEngine(hf_model, tokenizer, EngineConfig(...))`` serves ``generate_sequences(DataProto)`` for the
controller and ``await generate(prompt_ids, SamplingParams)`` for concurrent agents.
"""

from workers.rollout.native.engine import EngineConfig, NativeEngine, Request
from workers.rollout.native.model import SUPPORTED_MODEL_TYPES, NativeCausalLM
from workers.rollout.native.sampler import BatchSampler

__all__ = [
    "BatchSampler",
    "EngineConfig",
    "NativeCausalLM",
    "NativeEngine",
    "Request",
    "SUPPORTED_MODEL_TYPES",
]
