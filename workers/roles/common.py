"""Shared pieces of the role workers (actor, reference, critic).

* `EngineRoleWorker`: the base of every role that holds a training engine in ``self.engine`` (the class
  ``<role>.strategy`` names in `workers.engine.registry`, used only through the `TrainEngine` contract). It gives the
  roles their common group methods (checkpoint save/load, Hugging Face export, ``worker_info``) and error
  messages that name the role and rank.
* `engine_config`: an `EngineConfig` from the shared role configs (`workers.config.ModelConfig`).
* `StepMetrics`: loss-function metrics summed per optimizer step, then over the data-parallel group, so
  that a metric means the same thing whatever the micro-batch layout or the number of ranks (the engine
  SUMS gradients over ranks and normalises every loss by global counts; the metrics follow that rule).

Data-parallel layout of a data method (n-D dispatch on the role's mesh, ``ACTOR_MESH`` / ``CRITIC_MESH``):
the batch is split into ``dp`` contiguous chunks; dp rank d's chunk goes to every rank of replica d (all of
its TP x PP ranks under Megatron; with FSDP each rank is its own replica) and only one rank per replica
(``mesh_info``) is collected. A PPO mini-batch of ``M`` rows globally is ``M / dp`` rows of each chunk, so
global mini-batch k is the k-th block of ``M / dp`` rows of every chunk (verl's layout too).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, TypedDict

import torch

from algorithms import LOSS_AGG_MODES
from controller import Dispatch, Worker, register
from controller.dispatch import make_nd_compute_dataproto_dispatch_fn
from dataproto import DataProto
from workers.config import ModelConfig, RolloutConfig
from workers.device_memory import PeakDeviceMemory
from workers.engine import (
    EngineConfig,
    LoRAConfig,
    LossContext,
    MegatronConfig,
    MoEConfig,
    OptimConfig,
    TrainEngine,
    export_hf,
    load_checkpoint,
    save_checkpoint,
)
from workers.engine.registry import build_train_engine, train_engine_class
from workers.models import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Keys every forward through the engine needs (dataproto/BATCH_LAYOUT.md).
FORWARD_KEYS = ("input_ids", "attention_mask", "responses")

# Dispatch modes of the roles' data methods: one chunk per data-parallel replica. Distinct mesh names per role
# so colocated roles (one process, several engines) never share a layout.
ACTOR_MESH = make_nd_compute_dataproto_dispatch_fn("actor")
CRITIC_MESH = make_nd_compute_dataproto_dispatch_fn("critic")


def engine_config(
    model: ModelConfig,
    *,
    optim: OptimConfig | None,
    seed: int = 0,
    value_head: bool = False,
    lora: LoRAConfig | None = None,
    moe: MoEConfig | None = None,
) -> EngineConfig:
    """The training-engine config of one role: the model's settings plus its optimizer (None: forward only)
    and LoRA adapters (the actor's ``lora``)."""
    return EngineConfig(
        lora=lora,
        model_path=model.path,
        value_head=value_head,
        param_dtype=model.dtype,
        activation_checkpointing=model.activation_checkpointing,
        compile=model.compile,
        share_prompts=model.share_prompts,
        packed_attention=model.packed_attention,
        attn_implementation=model.attn_implementation,
        seed=seed,
        trust_remote_code=model.trust_remote_code,
        optim=optim,
        moe=moe or MoEConfig(),
    )


def model_parallel_size(strategy: str, megatron=None, section: str = "actor") -> int:
    """Ranks that hold one model replica together, as the engine ``strategy`` names declares it
    (`TrainEngine.model_parallel_size`): tensor x pipeline parallel size for Megatron, 1 for FSDP (FSDP shards
    parameters but every rank computes on its own data chunk)."""
    engine = train_engine_class(strategy, f"{section}.strategy")
    return engine.model_parallel_size(megatron or MegatronConfig())


def data_parallel_size(world_size: int, strategy: str, megatron=None, *, section: str, tag: str) -> int:
    """Data-parallel size of a role group: ``world_size / (tp * pp)`` (Megatron) or ``world_size`` (FSDP).
    A world size that is not a multiple of tp * pp is an error naming ``<section>.megatron.*``."""
    mp = model_parallel_size(strategy, megatron, section)
    if world_size % mp:
        assert megatron is not None  # only model-parallel sizes make a replica of several ranks
        raise ValueError(
            f"{tag}: the group has {world_size} rank(s), not a multiple of {section}.megatron."
            f"tensor_model_parallel_size * {section}.megatron.pipeline_model_parallel_size = "
            f"{megatron.tensor_model_parallel_size} * {megatron.pipeline_model_parallel_size} = {mp}"
        )
    return world_size // mp


def build_engine(
    config: EngineConfig, strategy: str = "fsdp", megatron=None, tag: str = "engine", section: str = "actor"
) -> TrainEngine:
    """The training engine of a role by ``<section>.strategy`` (`workers.engine.registry`): "fsdp" (FSDP2 over
    every rank of the group), "megatron" (``workers/engine/megatron``; ``megatron``: its ``MegatronConfig``
    with the TP/PP sizes; the rest of the group is data parallel) or a ``"module:Class"`` of the `TrainEngine`
    contract. The role then declares its layout (`mesh_info`, `_register_mesh`)."""
    try:
        train_engine_class(strategy, f"{section}.strategy")
    except (ValueError, TypeError) as e:
        raise type(e)(f"{tag}: {e}") from e
    return build_train_engine(config, strategy, megatron, key=f"{section}.strategy")


def mesh_info(engine: TrainEngine, rank: int) -> tuple[int, bool]:
    """(dp rank, is_collect) of this rank for the n-D dispatch of its role's data methods, as the engine
    declares it (`TrainEngine.dispatch_place`). FSDP: every rank computes on its own chunk (dp rank = group
    rank, all collected). Megatron: the ranks of one TP x PP group share a chunk and one rank per replica is
    collected."""
    return engine.dispatch_place(rank)


class MicroBatchKwargs(TypedDict):
    """The micro-batching keyword arguments of an engine call (`micro_batch_kwargs`)."""

    max_token_len: int | None
    micro_batch_size: int | None


def micro_batch_kwargs(
    use_dynamic_bsz: bool, micro_batch_size: int | None, max_token_len: int | None
) -> MicroBatchKwargs:
    """Engine micro-batching arguments: a token budget (dynamic batch size) or a row count."""
    if use_dynamic_bsz:
        return {"max_token_len": max_token_len, "micro_batch_size": None}
    return {"max_token_len": None, "micro_batch_size": micro_batch_size}


def ppo_micro_batch_kwargs(section) -> MicroBatchKwargs:
    """`micro_batch_kwargs` of a trained role's section (actor / critic: ``ppo_*_per_gpu``)."""
    if not isinstance(section.ppo_max_token_len_per_gpu, int):
        raise ValueError(
            f"ppo_max_token_len_per_gpu={section.ppo_max_token_len_per_gpu!r} reached a worker unresolved: the "
            "recipe driver turns auto into a token count (recipes/trainer/sizing.py); pass a number"
        )
    return micro_batch_kwargs(
        section.use_dynamic_bsz, section.ppo_micro_batch_size_per_gpu, section.ppo_max_token_len_per_gpu
    )


def log_prob_settings(tag: str, rollout: RolloutConfig, meta: Mapping) -> tuple[float, MicroBatchKwargs]:
    """(temperature, micro-batch kwargs) of a log-prob pass (old or reference log-probs): the rollout
    temperature and rollout.log_prob_* settings, each overridden by the same-named ``meta_info`` key
    (``temperature``, ``use_dynamic_bsz``, ``max_token_len``, ``micro_batch_size``)."""
    temperature = float(meta.get("temperature", rollout.temperature))
    if not temperature > 0:
        raise ValueError(
            f"{tag}: log-probs need a temperature > 0 (meta_info['temperature'] or rollout.temperature), got "
            f"{temperature}; score greedy rollouts at temperature 1"
        )
    micro = micro_batch_kwargs(
        bool(meta.get("use_dynamic_bsz", rollout.log_prob_use_dynamic_bsz)),
        meta.get("micro_batch_size", rollout.log_prob_micro_batch_size_per_gpu),
        meta.get("max_token_len", rollout.log_prob_max_token_len_per_gpu),
    )
    return temperature, micro


def token_share(mean_value: torch.Tensor | float, mask: torch.Tensor, ctx: LossContext) -> float:
    """This micro-batch's part of a token-mean over the whole mini-batch (all ranks): summed over micro-batches
    and ranks these give the mini-batch's token-mean of the quantity whose local masked mean is ``mean_value``."""
    local_tokens = float(mask.sum())
    return float(mean_value) * local_tokens / max(float(ctx.global_num_tokens), 1.0)


class StepMetrics:
    """Per-optimizer-step sums of metric contributions from a loss function, reduced over the DP group.

    A loss function adds, for each micro-batch, contributions normalised by the *global* counts of its
    mini-batch (``agg_loss`` values with ``ctx.global_batch_info``, or `token_share` of local means). Summed
    over micro-batches and ranks they are the mini-batch's value; `reduce` returns their mean over the
    optimizer steps of the call. Every rank must call `reduce` (it is collective).
    """

    def __init__(self, names: Iterable[str], num_mini_batches: int, epochs: int):
        self.names = list(names)
        self._index = {n: i for i, n in enumerate(self.names)}
        self.num_mini_batches = num_mini_batches
        self.sums = torch.zeros(num_mini_batches * epochs, len(self.names), dtype=torch.float64)

    def add(self, ctx: LossContext, **values) -> None:
        row = ctx.epoch * self.num_mini_batches + ctx.mini_batch_index
        for name, value in values.items():
            self.sums[row, self._index[name]] += float(value)

    def reduce(self, engine: TrainEngine) -> dict[str, float]:
        total = engine.dp_all_reduce(self.sums.clone())
        return {name: float(total[:, i].mean()) for name, i in self._index.items()}


class EngineRoleWorker(Worker):
    """Base of the roles that hold a `TrainEngine` (``self.engine``, built by the subclass's ``init_model``).

    Every method that uses the engine gets it through `_require_engine` first, which reloads an engine that a
    colocated role offloaded (`offload_engine`: the rollout role, before it generates on the same device)."""

    engine: TrainEngine | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    model_config: ModelConfig  # set by the subclass's __init__
    rollout_config: RolloutConfig
    _engine_offloaded = False
    # the reference forward replays the rollout's expert routes (actor.moe.reference_replay; docs/moe.md)
    reference_replay = False

    # -- messages and checks ---------------------------------------------------------------------------------

    def _register_mesh(self, mesh_name: str) -> None:
        """Declare this rank's place on ``mesh_name`` (after the engine is built): see `mesh_info`."""
        assert self.engine is not None  # built first
        dp_rank, is_collect = mesh_info(self.engine, self.rank)
        self.register_dispatch_collect_info(mesh_name, dp_rank, is_collect)

    def _check_ppo_section(self, name: str, section, rollout_n: int) -> None:
        """What the actor and critic sections share: a known loss aggregation, at least one epoch, and PPO
        mini-batches (``ppo_mini_batch_size * rollout.n`` rows) that divide among the data-parallel replicas."""
        if section.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"{self.tag}: {name}.loss_agg_mode={section.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}"
            )
        if section.ppo_epochs < 1:
            raise ValueError(f"{self.tag}: {name}.ppo_epochs must be >= 1, got {section.ppo_epochs}")
        dp = data_parallel_size(
            self.world_size, section.strategy, section.megatron, section=name, tag=self.tag
        )
        rows = section.ppo_mini_batch_size * rollout_n
        if rows < 1 or rows % dp:
            raise ValueError(
                f"{self.tag}: {name}.ppo_mini_batch_size * rollout.n = {section.ppo_mini_batch_size} * "
                f"{rollout_n} = {rows} rows per optimizer step must be a positive multiple of the "
                f"data-parallel size {dp}"
            )

    def _init_engine(self, config: EngineConfig, section=None, mesh_name: str | None = None) -> None:
        """Join the group's process group, build the engine (by ``section.strategy``; FSDP without a section),
        declare its layout on ``mesh_name`` (n-D dispatch) and load the tokenizer."""
        self.init_distributed()
        strategy, megatron = ("fsdp", None) if section is None else (section.strategy, section.megatron)
        self.engine = build_engine(config, strategy, megatron, tag=self.tag, section=mesh_name or "actor")
        if mesh_name is not None:
            self._register_mesh(mesh_name)
        self.tokenizer = load_tokenizer(
            self.model_config.path, trust_remote_code=self.model_config.trust_remote_code
        )

    def _reference_log_probs(
        self,
        method: str,
        inputs: Mapping[str, torch.Tensor],
        temperature: float,
        micro: MicroBatchKwargs,
        replay_routes: str | None = None,
    ) -> torch.Tensor:
        """The reference's log-probs of ``inputs`` (`workers.roles.reference.compute_ref_log_prob`): this
        role's engine in its `_reference_mode`; ``replay_routes``: the column of expert routes its routers use
        (None: they choose)."""
        engine = self._require_engine(method)
        with self._reference_mode(engine, method):
            out = engine.compute_log_prob(
                inputs, temperature=temperature, replay_routes=replay_routes, **micro
            )
        return out["log_probs"]

    def _reference_mode(self, engine: TrainEngine, method: str) -> AbstractContextManager:
        """How this role's engine scores as the reference: as it is (a LoRA actor: its frozen base model)."""
        return nullcontext()

    def _require_engine(self, method: str) -> TrainEngine:
        """The engine, brought back first if a colocated role offloaded it (`offload_engine`)."""
        if self.engine is None:
            raise RuntimeError(f"{self.tag}: {method} called before init_model()")
        if self._engine_offloaded:
            self.engine.reload()
            self._engine_offloaded = False
        return self.engine

    def offload_engine(self) -> float:
        """Move the engine's parameters and optimizer state off the device until its next use (a colocated
        rollout role calls it in process before it generates); returns the seconds it took."""
        t0 = time.perf_counter()
        if self.engine is not None and not self._engine_offloaded:
            self.engine.offload()
            self._engine_offloaded = True
        return time.perf_counter() - t0

    def _require_keys(self, data: DataProto, keys: Iterable[str], method: str) -> None:
        if not isinstance(data, DataProto):
            raise TypeError(f"{self.tag}: {method} takes a DataProto, got {type(data).__name__}")
        missing = [k for k in keys if k not in data.batch]
        if missing:
            raise KeyError(
                f"{self.tag}: {method} needs batch key(s) {missing}; the batch has {sorted(data.batch)} "
                "(see dataproto/BATCH_LAYOUT.md)"
            )

    def _ppo_mini_batch_rows(self, name: str, section, local_rows: int, method: str) -> int:
        """Rows of this rank's chunk per optimizer step: ``<name>.ppo_mini_batch_size * rollout.n`` rows per step
        over the DP group."""
        global_rows = section.ppo_mini_batch_size * self.rollout_config.n
        what = f"{name}.ppo_mini_batch_size * rollout.n"
        assert self.engine is not None  # the caller's _require_engine checked it
        dp = self.engine.dp_size
        if global_rows < 1 or global_rows % dp:
            raise ValueError(
                f"{self.tag}: {method}: {what} = {global_rows} rows per optimizer step is not a positive "
                f"multiple of the data-parallel size {dp}"
            )
        per_rank = global_rows // dp
        if local_rows % per_rank:
            raise ValueError(
                f"{self.tag}: {method}: this rank holds {local_rows} rows, not a multiple of {per_rank} "
                f"({what} = {global_rows} rows per optimizer step over {dp} rank(s)); send a batch of a "
                f"multiple of {global_rows} rows"
            )
        return per_rank

    def _ppo_train_step(
        self, data: DataProto, loss_fn, section, mini_batch_rows: int, *, stage: str, **engine_kwargs
    ) -> dict:
        """``section.ppo_epochs`` passes of optimizer steps on ``mini_batch_rows`` rows each over ``data``; the
        engine's metrics plus ``device_memory``: the call's peak device memory, named after ``stage``."""
        assert self.engine is not None  # the caller's _require_engine checked it
        with PeakDeviceMemory(stage) as peak:
            m = self.engine.train_step(
                data.batch,
                loss_fn,
                mini_batch_size=mini_batch_rows,
                epochs=section.ppo_epochs,
                shuffle=section.shuffle,
                **engine_kwargs,
                **ppo_micro_batch_kwargs(section),
            )
        return {**m, "device_memory": peak.metrics}

    def _train_result(self, method: str, prefix: str, train_metrics: dict, losses: dict) -> DataProto:
        """What a training call returns: ``meta_info["metrics"]`` with ``losses`` and the engine's grad norm, LR
        and skipped-step count, named ``<prefix>/<name>``. Warns when the engine dropped optimizer steps of this
        call (non-finite gradient norm)."""
        engine = self.engine
        assert engine is not None  # the caller's _require_engine checked it
        if train_metrics["skipped"]:
            logger.warning(
                "%s: %s skipped %d of %d optimizer step(s) for a non-finite loss/gradient norm (grad norms %s); "
                "%d skipped in total",
                self.tag, method, train_metrics["skipped"], len(train_metrics["grad_norms"]),
                train_metrics["grad_norms"], engine.skipped_steps,
            )  # fmt: skip
        metrics = {
            **losses,
            "grad_norm": float(train_metrics["grad_norm"]),
            "lr": float(train_metrics["lr"]),
            "skipped_steps": float(engine.skipped_steps),
        }
        named = {f"{prefix}/{k}": v for k, v in metrics.items()}
        return DataProto(meta_info={"metrics": named | train_metrics.get("device_memory", {})})

    # -- group methods shared by every engine role -----------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def worker_info(self) -> dict:
        """Where this rank runs and what its engine holds (for logs and tests)."""
        info = {
            "role": type(self).__name__,
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
        }
        if self.engine is not None:
            info.update(
                dp_size=self.engine.dp_size,
                dp_rank=self.engine.dp_rank,
                use_fsdp=self.engine.use_fsdp,
                device=str(self.engine.device),
                global_step=self.engine.global_step,
                skipped_steps=self.engine.skipped_steps,
                num_params=self.engine.num_params,
            )
            info.update(
                self.engine.replica_coords()
            )  # Megatron: its place in the TP x PP group of its replica
        return info

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root_dir: str, step: int, extra: dict | None = None) -> str:
        """Save model, optimizer, LR schedule, RNG and ``extra`` (e.g. the data position) to
        ``root_dir/step_<step>`` with torch.distributed.checkpoint; every rank takes part. Returns the path."""
        engine = self._require_engine("save_checkpoint")
        return save_checkpoint(engine, str(root_dir), extra=extra, step=step)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        """Restore from a checkpoint directory ``.../step_N`` (verified first); returns its ``extra``."""
        engine = self._require_engine("load_checkpoint")
        return load_checkpoint(engine, str(path))

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> str:
        """Write the full model (and the tokenizer) as a Hugging Face directory; rank 0 writes, every rank
        takes part in gathering the weights. Returns ``out_dir`` on every rank."""
        engine = self._require_engine("export_hf")
        export_hf(engine, str(out_dir), tokenizer=self.tokenizer)
        return str(out_dir)
