"""FSDP2 training engine: packed log-probs/values, token-budget micro-batching, train steps, checkpoints.

See `fsdp_engine.py` for the gradient-reduction and loss-normalisation conventions."""

from workers.engine.checkpoint import (
    CheckpointError,
    export_hf,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from workers.engine.fsdp_engine import EngineConfig, FSDPEngine, LossContext, OptimConfig, as_tensor_dict
from workers.engine.packing import karmarkar_karp, pack_sequences, plan_micro_batches

__all__ = [
    "CheckpointError",
    "EngineConfig",
    "FSDPEngine",
    "LossContext",
    "OptimConfig",
    "as_tensor_dict",
    "export_hf",
    "karmarkar_karp",
    "load_checkpoint",
    "pack_sequences",
    "plan_micro_batches",
    "save_checkpoint",
    "verify_checkpoint",
]
