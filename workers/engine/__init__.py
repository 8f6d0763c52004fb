"""Training engines and what they share.

* `base`: the engine configs (`EngineConfig`, `OptimConfig`, `MegatronConfig`, `MoEConfig`), `LossContext`, and the
  `TrainEngine` protocol that role workers and checkpointing use, with the capabilities an engine declares.
* `registry`: ``<role>.strategy`` (``fsdp``, ``megatron`` or ``"module:Class"``) -> the engine class, checked
  against the contract; `build_train_engine` builds it (docs/training_engines.md).
* `fsdp_engine.FSDPEngine` (FSDP2, packed sequences) and `megatron.engine.MegatronEngine` (Megatron-core
  TP/PP/DP; imported on use: megatron-core is optional); both take the methods they share from
  `train_steps.EngineSteps` and their optimizer from `optim`.
* `checkpoint`: resumable DCP checkpoints and Hugging Face export of any `TrainEngine`.
* `moe` (routers: recorded routes, routing replay, router losses and route metrics) and `moe_forward` (one
  micro-batch forward of a mixture of experts in the FSDP engine).
* `packing` (unpadded micro-batches); the process-group helpers are `workers.distributed`. The varlen attention the
  engines run (``hyflow_varlen``) lives beside the models, in `workers.models.attention`.
"""

from workers.engine.base import (
    EngineConfig,
    LoRAConfig,
    LossContext,
    MegatronConfig,
    MoEConfig,
    OptimConfig,
    TrainEngine,
)
from workers.engine.checkpoint import (
    CheckpointError,
    export_hf,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from workers.engine.fsdp_engine import FSDPEngine
from workers.engine.packing import karmarkar_karp, pack_sequences, plan_micro_batches

__all__ = [
    "CheckpointError",
    "EngineConfig",
    "FSDPEngine",
    "LoRAConfig",
    "LossContext",
    "MegatronConfig",
    "MoEConfig",
    "OptimConfig",
    "TrainEngine",
    "export_hf",
    "karmarkar_karp",
    "load_checkpoint",
    "pack_sequences",
    "plan_micro_batches",
    "save_checkpoint",
    "verify_checkpoint",
]
