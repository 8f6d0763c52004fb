"""Configs of the role workers. Recipes build these from their YAML (names follow verl's where they overlap,
so a verl user finds ``actor.ppo_mini_batch_size`` where they expect it); workers never import recipes."""

import math
from dataclasses import dataclass, field

from workers.engine.base import LoRAConfig, MegatronConfig, MoEConfig, OptimConfig


@dataclass
class ModelConfig:
    path: str  # local Hugging Face directory (config.json, weights, tokenizer)
    dtype: str = "float32"  # parameter dtype of the training engine
    attn_implementation: str = "auto"
    activation_checkpointing: bool = False
    # torch.compile the training engines' decoder layers (the rollout engine's: rollout.compile); compiles on
    # first use (~20 s). On a 2-core CPU a tiny model's train step is 1.06-1.12x as fast (BENCHMARKS.md)
    compile: bool = False
    # the samples of one prompt in a training micro-batch share one forward/backward of that prompt (exact: the
    # same log-probs and gradients; hyflow_varlen attention, i.e. not with flash_attention_2 or sliding windows)
    share_prompts: bool = True
    # the kernel that attends packed sequences (workers/models/packed_kernels.py): auto = sdpa on the CPU (fastest
    # there), flex on CUDA (FlexAttention over a block mask, compiled; takes shared prompts); flash = torch's varlen
    # FlashAttention (CUDA, bf16, turns share_prompts off); docs/recipes.md says which was measured faster
    packed_attention: str = "auto"
    trust_remote_code: bool = False


@dataclass
class ActorConfig:
    strategy: str = "fsdp"  # "fsdp" (FSDP2) or "megatron" (megatron-core TP x PP, the rest of the group DP)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # TP/PP sizes for strategy=megatron
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (multiplied by rollout.n, as in verl)
    ppo_micro_batch_size_per_gpu: int | None = 4  # rows per forward/backward when use_dynamic_bsz is off
    use_dynamic_bsz: bool = True  # micro-batches by token budget instead of row count
    # token budget per micro-batch (dynamic batch size); auto: on a GPU the largest the memory model
    # (workers/models/memory.py) fits on the device, resolved before Ray starts (docs/sizing.md); 4096 on the CPU
    ppo_max_token_len_per_gpu: int | str = 4096
    ppo_epochs: int = 1
    shuffle: bool = False
    policy_loss: str = "vanilla"  # algorithms registry: "vanilla" (PPO clip), "gspo", ...
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # None: clip_ratio
    clip_ratio_high: float | None = None  # None: clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False  # KL to the reference as a loss term (GRPO style)
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    # rank > 0: train LoRA adapters only; the frozen base is the reference (no reference model is loaded)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # mixture-of-experts models: routing replay and the router losses (docs/moe.md); a dense model ignores it
    moe: MoEConfig = field(default_factory=MoEConfig)
    seed: int = 0

    def __post_init__(self):
        _at_least(self, 0.0, "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
        budget = self.ppo_max_token_len_per_gpu
        if isinstance(budget, str) and budget.isdigit():
            self.ppo_max_token_len_per_gpu = budget = int(budget)  # a quoted number in a YAML file
        if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"ppo_max_token_len_per_gpu must be a token count >= 1 or auto, got {budget!r}")


@dataclass
class CriticConfig:
    strategy: str = "fsdp"  # "fsdp" or "megatron" (megatron-core TP x PP, the rest of the group DP)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # TP/PP sizes for strategy=megatron
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int | None = 4
    use_dynamic_bsz: bool = True
    ppo_max_token_len_per_gpu: int = 4096
    ppo_epochs: int = 1
    shuffle: bool = False
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    seed: int = 0

    def __post_init__(self):
        _at_least(self, 0.0, "cliprange_value")


ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class RolloutConfig:
    name: str = "native"  # "native" (our torch engine) or "sglang"
    n: int = 1  # samples per prompt (GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    prompt_length: int = 256  # longest prompt kept by the data loader
    response_length: int = 256  # max new tokens; responses are right-padded to this
    max_num_seqs: int = 64  # concurrent sequences in the engine
    log_prob_micro_batch_size_per_gpu: int | None = 8  # for old/ref log-prob passes
    log_prob_use_dynamic_bsz: bool = True
    log_prob_max_token_len_per_gpu: int = 8192
    weight_bucket_mb: int = 64  # weight-sync bucket size (disaggregated broadcast, SGLang)
    free_cache_engine: bool = True  # release KV cache between rollouts (time-sharing with training)
    tensor_parallel_size: int = 1  # SGLang only for now
    # Colocated Megatron actor: TP size of each native rollout replica (the 3D-HybridEngine reshards the
    # trainer's TP shards into it); must divide actor.megatron.tensor_model_parallel_size. FSDP: 1.
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5  # SGLang mem_fraction_static
    # weights and KV cache of the rollout engine: auto = bfloat16 on CUDA, model.dtype on CPU; or a dtype name
    dtype: str = "auto"
    # native engine: torch.compile the layer blocks around attention (~7 s on first use); on a 2-core CPU a tiny
    # model generates 0.77-0.86x as fast compiled (BENCHMARKS.md): it is for GPUs
    compile: bool = False
    # native engine: decode steps replayed as CUDA graphs (docs/rollout_engines.md): auto = on with CUDA for a model
    # the graphs can capture (not rollout.tensor_model_parallel_size>1, not a mixture of experts); true asks for them
    # (a config error where they cannot be had: no GPU, TP>1, MoE, SGLang); false: off
    cuda_graphs: bool | str = "auto"
    seed: int = 0
    # validation sampling: greedy by default so held-out accuracy is deterministic
    val_temperature: float = 0.0
    val_n: int = 1

    def __post_init__(self):
        _at_least(self, 0.0, "temperature", "val_temperature")
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"dtype must be one of {list(ROLLOUT_DTYPES)}, got {self.dtype!r}")
        if isinstance(self.cuda_graphs, str) and self.cuda_graphs.lower() in ("true", "false"):
            self.cuda_graphs = self.cuda_graphs.lower() == "true"  # a quoted 'true' in a YAML file
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "auto"):
            raise ValueError(f"cuda_graphs must be auto, true or false, got {self.cuda_graphs!r}")

    @property
    def engine_cuda_graphs(self) -> bool | None:
        """``cuda_graphs`` as the native engine's ``EngineConfig.cuda_graphs``: None for auto."""
        return None if self.cuda_graphs == "auto" else bool(self.cuda_graphs)


@dataclass
class RewardConfig:
    default_scorer: str | None = None  # scorer for data sources without a registered one (None: error)
    # "outcome": the score sits on the last response token
    reward_manager: str = "outcome"
    # the controller aborts a run when at least this fraction of a step's samples fails to score (raises or is
    # not finite); 1.0: only when every sample fails; None: never
    max_error_frac: float | None = 1.0

    def __post_init__(self):
        if self.max_error_frac is not None and not 0 < self.max_error_frac <= 1:
            raise ValueError(f"max_error_frac must be in (0, 1] or None, got {self.max_error_frac}")


def _at_least(cfg, low: float, *names: str) -> None:
    """Each named field (when not None) is a finite number >= ``low``; the error starts with the field name."""
    for name in names:
        v = getattr(cfg, name)
        if v is not None and not (math.isfinite(v) and v >= low):
            raise ValueError(f"{name} must be a finite number >= {low:g}, got {v}")
