"""What every training engine (FSDP2, Megatron-core) shares: its configs, the loss-function contract, how a
batch argument is read, and `TrainEngine`, the protocol that role workers and checkpointing program against.

An engine declares what it can do (`TrainEngine`'s ``ClassVar`` capabilities: LoRA, compile, resharding for
generation, a process-global parallel layout) and how its ranks form model replicas (``model_parallel_size``,
``dispatch_place``, ``replica_coords``); the roles and the config checks read those, never its class or its
name. A capability that is True brings the members of its own protocol (`CAPABILITY_CONTRACTS`).
`workers.engine.registry` maps ``<role>.strategy`` to the class and checks it against this contract."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist

# Keys every forward through an engine needs (dataproto/BATCH_LAYOUT.md).
FORWARD_KEYS = ("input_ids", "attention_mask", "responses")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay (or constant), global-norm gradient clipping."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = 0  # linear warm-up: lr * (step + 1) / warmup_steps for step < warmup_steps
    warmup_ratio: float = 0.0  # used when warmup_steps == 0: warmup_steps = ratio * total_steps
    lr_schedule: str = "constant"  # "constant" or "cosine" (needs total_steps)
    total_steps: int | None = None
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float | None = 1.0  # max global grad norm; None or <= 0 disables clipping

    def __post_init__(self):
        # OmegaConf gives a list for a YAML pair on Python 3.12 (a tuple on 3.11): one type either way
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(
                f"OptimConfig.lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}"
            )
        if self.lr_schedule == "cosine" and not self.total_steps:
            raise ValueError("OptimConfig.lr_schedule='cosine' needs total_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


ROUTING_REPLAY = ("none", "rollout", "old_log_prob")


@dataclass
class MoEConfig:
    """Mixture-of-experts training (docs/moe.md); a dense model ignores it."""

    # none: the trainer routes every token itself; rollout (R3): every forward of the update and the old log-prob
    # pass uses the experts the rollout engine chose (batch column routed_experts); old_log_prob (R2): the update
    # uses the experts the old log-prob pass chose (column old_routed_experts)
    routing_replay: str = "none"
    aux_loss_coef: float = (
        0.0  # Switch-style load-balancing loss (moe.load_balancing_loss), added to the loss
    )
    z_loss_coef: float = 0.0  # router z-loss (moe.router_z_loss): mean logsumexp(router logits)^2
    # the reference's forward (the KL term's log-probs) uses the experts the rollout engine chose too, so the KL
    # compares the two policies on the same experts; its routers choose otherwise
    reference_replay: bool = False

    def __post_init__(self):
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(
                f"routing_replay must be one of {list(ROUTING_REPLAY)}, got {self.routing_replay!r}"
            )
        for key in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{key} must be a finite number >= 0, got {value}")


@dataclass
class EngineConfig:
    model_path: str
    value_head: bool = False  # critic: scalar head, `compute_values` / values in train_step
    param_dtype: str = "float32"  # dtype the parameters (and optimizer state) are kept in
    mixed_precision: bool | None = None  # bf16 compute with fp32 reduce; None: on for CUDA, off on CPU
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each decoder layer (fsdp_engine.compile_layers)
    attn_implementation: str = "auto"  # auto: flash_attention_2 if installed on CUDA, else hyflow_varlen
    # rows of a micro-batch with one prompt share its forward/backward (hyflow_varlen attention only; exact)
    share_prompts: bool = True
    # the kernel of hyflow_varlen's packed rows (workers/models/packed_kernels.py): auto = sdpa on the CPU, flex
    # on CUDA; flash = torch's varlen FlashAttention (CUDA, bf16, no shared prompts)
    packed_attention: str = "auto"
    use_fsdp: bool | None = None  # None: FSDP2 when torch.distributed has world size > 1
    reshard_after_forward: bool = True
    seed: int = 0  # same on every rank: a fresh value head is initialised identically everywhere
    trust_remote_code: bool = False
    config_overrides: dict = field(default_factory=dict)
    optim: OptimConfig | None = field(default_factory=OptimConfig)  # None: forward-only (reference model)
    lora: LoRAConfig | None = None  # adapters only train (workers/engine/lora.py); None or rank 0: full model
    moe: MoEConfig = field(default_factory=MoEConfig)  # router losses (the update); replay is chosen per call


@dataclass
class LoRAConfig:
    """Low-rank adapters (peft's LoRA) on the training model: with ``rank > 0`` only the adapters train, the
    base weights stay frozen (and serve as the reference model, adapters disabled). ``rank = 0``: full
    fine-tuning."""

    rank: int = 0  # the adapters' rank r (A: r x in, B: out x r); 0: no LoRA, the whole model trains
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input while training
    # module names (or their last parts: q_proj, v_proj, ...) the adapters wrap; ["all-linear"]: every linear
    # layer except the output projection (peft's meaning)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be an int >= 0 (0: no LoRA, full fine-tuning), got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha must be a finite number > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        self.target_modules = [str(m) for m in self.target_modules]
        if not self.target_modules:
            raise ValueError("target_modules must name at least one module (or be ['all-linear'])")
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise ValueError(f"target_modules: 'all-linear' stands alone, got {self.target_modules}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class MegatronConfig:
    """Model-parallel sizes of the Megatron engine; data parallelism is the rest of the world
    (``world / (tp * pp)``)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def __post_init__(self):
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MegatronConfig.{key} must be a positive int, got {value!r}")


@dataclass
class LossContext:
    """What ``loss_fn`` needs besides the micro-batch tensors. Counts cover the whole mini-batch (one optimizer
    step) over all DP ranks; gradients are SUMMED over ranks, so losses are normalised by these counts only."""

    global_num_tokens: float  # sum of the loss mask over the mini-batch, all DP ranks
    global_num_seqs: int  # rows with at least one loss-mask token in the mini-batch, all DP ranks
    dp_size: int
    dp_rank: int
    epoch: int
    mini_batch_index: int
    micro_batch_index: int
    num_micro_batches: int
    temperature: float

    @property
    def global_batch_info(self) -> dict[str, Any]:
        """For ``algorithms.aggregation.agg_loss(..., global_batch_info=ctx.global_batch_info)``. ``dp_size`` is
        1 there on purpose: the engines SUM gradients over ranks instead of averaging them."""
        return {"global_tokens": self.global_num_tokens, "global_seqs": self.global_num_seqs, "dp_size": 1}


LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], LossContext], Any]


def as_tensor_dict(data: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, meta_info) from a dict of tensors or a DataProto-like object with ``.batch``/``.meta_info``."""
    if isinstance(data, Mapping):
        return {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}, {}
    if hasattr(data, "batch"):
        batch = data.batch
        keys = batch.keys() if hasattr(batch, "keys") else []
        return {k: batch[k] for k in keys}, dict(getattr(data, "meta_info", None) or {})
    raise TypeError(f"expected a dict of tensors or a DataProto, got {type(data).__name__}")


def require_keys(tensors: Mapping[str, torch.Tensor], *keys: str, where: str) -> None:
    """A KeyError naming ``where`` and the keys the batch lacks."""
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise KeyError(
            f"{where}: batch is missing {missing} (has {sorted(tensors)}); see dataproto/BATCH_LAYOUT.md"
        )


@runtime_checkable
class TrainEngine(Protocol):
    """One model (actor, critic or reference) with its optimizer on this rank: what role workers call and
    what checkpointing (`workers.engine.checkpoint`) saves, like torchtitan's ``Stateful`` components.

    ``state_dict()`` / ``load_state_dict()`` round-trip the whole training state (model, optimizer, LR
    schedule, step counters) in DCP form: keys are unique per distinct shard, replicas share keys, and every
    entry exists before the first step (DCP loads in place; `train_steps.module_state` gives that). Methods
    that run the model, `full_state_dict_iter` and the state dict are collective over the engine's ranks.

    Members annotated ``ClassVar`` are capabilities the class declares; the other annotated members are set on
    each instance (`workers.engine.registry.check_train_engine` checks both)."""

    # -- what the engine can do (the roles and the config checks before Ray read these, never the class) -------
    supports_lora: ClassVar[
        bool
    ]  # LoRA adapters (EngineConfig.lora, actor.lora): `LoRATrainEngine`'s members
    supports_compile: ClassVar[bool]  # torch.compile of its layers (EngineConfig.compile, model.compile)
    # its tensor-parallel shards reshard into TP generation replicas on its own ranks (the 3D-HybridEngine,
    # rollout.tensor_model_parallel_size > 1): `ReshardingTrainEngine`'s members
    reshards_for_generation: ClassVar[bool]
    # its model-parallel layout is process-global state (Megatron's parallel_state): roles that share a process
    # (colocated actor and critic) must use the same model-parallel sizes
    process_global_parallel_state: ClassVar[bool]
    # it trains mixture-of-experts models: EngineConfig.moe's router losses, ``replay_routes`` (the batch column of
    # expert routes its forwards replay) and the routes it chose in ``compute_log_prob``'s result (docs/moe.md)
    supports_moe: ClassVar[bool]

    config: EngineConfig
    device: torch.device
    dp_size: int
    dp_rank: int
    is_value_model: bool
    global_step: int  # applied optimizer steps
    skipped_steps: int  # steps dropped for a non-finite gradient norm
    hf_config: Any  # the model's transformers config; ``architectures`` names the class it was loaded as
    generation_config: Any  # transformers GenerationConfig of a causal LM, None for a critic
    use_fsdp: bool  # parameters sharded by FSDP2 (reported by the roles' worker_info)

    @classmethod
    def from_config(cls, config: EngineConfig, parallel: MegatronConfig) -> TrainEngine:
        """The engine of this rank, in the role's process group (joined before); ``parallel``: the role's
        model-parallel sizes (``<role>.megatron``), which an engine without model parallelism ignores."""

    @classmethod
    def model_parallel_size(cls, parallel: MegatronConfig) -> int:
        """Ranks that hold one model replica together under ``parallel`` (1: each rank is a replica); the rest
        of a role's group is data parallel. Read before Ray starts (the config checks) and by the roles."""

    def dispatch_place(self, rank: int) -> tuple[int, bool]:
        """(data-parallel replica, collected?) of group rank ``rank`` for the roles' n-D dispatch: the ranks of
        one replica get the same chunk of a batch and one of them is collected."""

    def replica_coords(self) -> dict[str, int]:
        """This rank's coordinates inside its model replica, for logs (e.g. ``tp_rank``, ``pp_rank``); empty
        where a rank is a replica alone."""

    @property
    def num_params(self) -> int:
        """Parameter count of the full model."""

    def offload(self, optimizer: bool = True) -> None:
        """Move parameters (and optimizer state) off the accelerator until `reload`."""

    def reload(self, optimizer: bool = True) -> None: ...

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group; None: one replica, nothing to reduce over."""

    def dp_all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """``t`` reduced over ``dp_group`` (identity without one), on CPU."""

    def compute_log_prob(
        self,
        data,
        *,
        temperature: float | None = None,
        calculate_entropy: bool = False,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        replay_routes: str | None = None,
    ) -> dict[str, torch.Tensor]: ...

    def compute_values(
        self, data, *, micro_batch_size: int | None = None, max_token_len: int | None = None
    ) -> dict[str, torch.Tensor]: ...

    def train_step(
        self,
        data,
        loss_fn: LossFn,
        *,
        mini_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        epochs: int = 1,
        shuffle: bool = False,
        temperature: float | None = None,
        calculate_entropy: bool = False,
        loss_mask_key: str = "response_mask",
        replay_routes: str | None = None,
    ) -> dict[str, Any]: ...

    def full_state_dict_iter(
        self, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight; collective: every rank consumes it to the end."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The ranks that save one checkpoint together; None: this process alone (replicas: rank 0 saves)."""

    def checkpoint_layout(self) -> dict:
        """Facts a checkpoint must share with the engine that loads it (e.g. TP/PP sizes)."""


@runtime_checkable
class LoRATrainEngine(TrainEngine, Protocol):
    """What an engine that ``supports_lora`` adds: with ``lora`` set only the adapters train, and the frozen base
    is the reference model."""

    lora: LoRAConfig | None  # None: this instance trains the full model

    def adapter_state_iter(
        self, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(PEFT name, full tensor) of the adapter weights alone; collective like ``full_state_dict_iter``."""

    def base_model_mode(self) -> AbstractContextManager:
        """A context in which the model computes the frozen base's outputs (adapters disabled)."""


@runtime_checkable
class ReshardingTrainEngine(TrainEngine, Protocol):
    """What an engine that ``reshards_for_generation`` adds: its weights as ``tp_g``-way generation shards on
    the same ranks (`workers.roles.hybrid_engine`)."""

    def reshard_plan(self, tp_g: int = 1) -> Any:
        """The plan (`workers.weight_sync.reshard_plan.ReshardPlan`) from its layout to ``tp_g``-way replicas."""

    def generation_shard_iter(
        self, tp_g: int = 1, bucket_bytes: int = 64 << 20
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, this rank's generation shard); collective: every rank consumes it to the end."""

    def reshard_stats(self, tp_g: int = 1) -> Any:
        """Byte and memory counts of the last ``generation_shard_iter(tp_g)`` on this rank."""


# capability -> the protocol whose members an engine declaring it True must have
CAPABILITY_CONTRACTS: dict[str, type] = {
    "supports_lora": LoRATrainEngine,
    "reshards_for_generation": ReshardingTrainEngine,
}


def as_lora_engine(engine: TrainEngine, what: str) -> LoRATrainEngine:
    """``engine`` as a `LoRATrainEngine`, or a RuntimeError naming ``what`` needed it when its class does not
    declare ``supports_lora`` or this instance has no adapters."""
    lora_engine = cast(LoRATrainEngine, engine)  # its members, where the class declares supports_lora
    if not engine.supports_lora or lora_engine.lora is None:
        raise RuntimeError(
            f"{what} needs LoRA adapters (actor.lora), and this {type(engine).__name__} has none "
            f"(supports_lora={engine.supports_lora})"
        )
    return lora_engine


def as_resharding_engine(engine: TrainEngine, what: str) -> ReshardingTrainEngine:
    """``engine`` as a `ReshardingTrainEngine`, or a RuntimeError naming ``what`` needed it."""
    if not engine.reshards_for_generation:
        raise RuntimeError(
            f"{what} needs a training engine that reshards for generation; {type(engine).__name__} does not "
            "(reshards_for_generation=False)"
        )
    return cast(ReshardingTrainEngine, engine)
