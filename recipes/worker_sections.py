"""The checks of the role sections whose dataclasses are the workers' own (``workers/config.py``): ``actor`` (its
strategy and Megatron sizes against its devices, PPO batches, LoRA, a mixture of experts' routing replay) and
``rollout`` (samples per prompt, lengths, the engine, its tensor parallelism and CUDA graphs).
``recipes.config.validate`` runs them beside the recipe sections' own ``check`` methods (``recipes.sections``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from recipes.sections import (
    RecipeConfig,
    check_ppo_batches,
    data_parallel_sizes,
    device_worlds,
    engine_can,
    megatron_replicas,
    needs_reference,
    samples_per_prompt,
    train_engine_can,
    uses_critic,
    uses_gpu,
)
from workers.rollout.registry import rollout_engine_class


def _check_rollout_tp(errors: list[str], cfg: RecipeConfig) -> None:
    """``rollout.tensor_model_parallel_size``: TP rollout replicas resharded from a colocated Megatron actor."""
    tp_g, a = cfg.rollout.tensor_model_parallel_size, cfg.actor
    if not isinstance(tp_g, int) or tp_g < 1:
        errors.append(f"rollout.tensor_model_parallel_size must be an int >= 1, got {tp_g!r}")
        return
    if tp_g == 1:
        return
    if not train_engine_can(a.strategy, "reshards_for_generation"):
        errors.append(
            f"rollout.tensor_model_parallel_size={tp_g} needs actor.strategy=megatron: the 3D-HybridEngine "
            f"reshards the trainer's Megatron TP shards into the rollout replicas, and an FSDP trainer "
            f"(actor.strategy={a.strategy!r}) has no TP layout to reshard from; use 1"
        )
    elif a.megatron.tensor_model_parallel_size % tp_g:
        errors.append(
            f"rollout.tensor_model_parallel_size={tp_g} must divide actor.megatron.tensor_model_parallel_size="
            f"{a.megatron.tensor_model_parallel_size} (a generation shard is a union of whole training shards)"
        )
    if cfg.trainer.placement == "disaggregated":
        errors.append(
            f"rollout.tensor_model_parallel_size={tp_g} is for the colocated actor-rollout worker; "
            "trainer.placement=disaggregated runs full rollout replicas on their own pool: use 1"
        )
    if not engine_can(cfg, "accepts_tp_group"):
        errors.append(
            f"rollout.tensor_model_parallel_size={tp_g} is for an engine that can be a tensor-parallel replica on "
            f"the trainer's ranks (rollout.name=native), got {cfg.rollout.name!r} (SGLang: "
            "rollout.tensor_parallel_size)"
        )


def _check_rollout_engine(errors: list[str], cfg: RecipeConfig) -> None:
    """``rollout.name``: a registered engine or an importable ``RolloutEngine`` subclass, and what that engine
    says about the config (SGLang: the package installed); checked before Ray starts."""
    try:
        engine = rollout_engine_class(cfg.rollout.name)
    except (ValueError, TypeError) as e:
        errors.append(str(e))
        return
    errors.extend(engine.config_errors(cfg.model, cfg.rollout))


def _check_rollout_graphs(errors: list[str], cfg: RecipeConfig) -> None:
    """``rollout.cuda_graphs=true`` where the native engine cannot capture its decode step (no GPU, tensor
    parallelism, a mixture of experts: ``workers.rollout.native.graphs.graph_refusal``); auto leaves them off
    there. SGLang refuses the key itself (its ``config_errors``)."""
    r = cfg.rollout
    if r.cuda_graphs is not True:
        return
    if not uses_gpu(cfg):
        errors.append(
            f"rollout.cuda_graphs=true replays decode steps as CUDA graphs, but the run has no GPU "
            f"(trainer.device={cfg.trainer.device}, torch sees no CUDA device); use rollout.cuda_graphs=auto or false"
        )
    if isinstance(r.tensor_model_parallel_size, int) and r.tensor_model_parallel_size > 1:
        errors.append(
            f"rollout.cuda_graphs=true cannot capture a tensor-parallel replica (rollout.tensor_model_parallel_size="
            f"{r.tensor_model_parallel_size}: its all-reduces would be captured too); use rollout.cuda_graphs=auto "
            "or false, or rollout.tensor_model_parallel_size=1"
        )
    if model_is_moe(cfg):
        errors.append(
            "rollout.cuda_graphs=true cannot capture a mixture of experts' decode step (expert groups of "
            "data-dependent sizes); use rollout.cuda_graphs=auto or false"
        )


def check_actor(errors: list[str], cfg: RecipeConfig) -> None:
    """``actor``: its strategy and Megatron sizes against its devices, its PPO batches, and LoRA."""
    _, error = megatron_replicas("actor", cfg.actor, device_worlds(cfg)["train"])
    if error:
        errors.append(error)
    _check_lora(errors, cfg)
    _check_moe(errors, cfg)
    _check_auto_token_budget(errors, cfg)
    for role in ("actor", "critic"):
        strategy = getattr(cfg, role).strategy
        if cfg.model.compile and not train_engine_can(strategy, "supports_compile"):
            errors.append(
                f"model.compile=true compiles the FSDP engine's layers; {role}.strategy={strategy!r} does not "
                f"compile (use {role}.strategy=fsdp or model.compile=false)"
            )
    if cfg.data.train_batch_size >= 1:
        check_ppo_batches(
            errors,
            "actor",
            cfg.actor,
            cfg.data.train_batch_size,
            samples_per_prompt(cfg),
            data_parallel_sizes(cfg).train,
        )


def _check_auto_token_budget(errors: list[str], cfg: RecipeConfig) -> None:
    """``actor.ppo_max_token_len_per_gpu: auto`` sizes a colocated FSDP actor beside the native rollout engine
    (workers/models/memory.py models those): refused where the run holds what the model does not count."""
    if cfg.actor.ppo_max_token_len_per_gpu != "auto" or not uses_gpu(cfg):
        return  # on the CPU auto is a fixed budget (recipes/trainer/sizing.py)
    unmodelled = []
    if cfg.actor.strategy != "fsdp":
        unmodelled.append(
            f"actor.strategy={cfg.actor.strategy!r} (the model counts the FSDP engine's memory)"
        )
    if cfg.rollout.name != "native":
        unmodelled.append(f"rollout.name={cfg.rollout.name!r} (the model counts the native engine's memory)")
    if uses_critic(cfg) and cfg.trainer.placement == "colocated":
        unmodelled.append("a colocated critic (the model counts no critic)")
    if unmodelled:
        errors.append(
            "actor.ppo_max_token_len_per_gpu=auto sizes a colocated FSDP actor beside the native rollout engine; "
            f"this run has {', '.join(unmodelled)}: set a token count"
        )


def model_is_moe(cfg: RecipeConfig) -> bool | None:
    """Whether the policy is a mixture of experts: the tiny model's ``model.tiny_arch``, or its folder's config.json
    naming experts; None when that cannot be told before the model is fetched (a Hub id not yet cached)."""
    if cfg.model.path is None:
        return cfg.model.tiny_arch == "moe"
    config = Path(cfg.model.path) / "config.json"
    if not config.is_file():
        return None
    hf = json.loads(config.read_text())
    return any(int(hf.get(key) or 0) > 0 for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def _check_moe(errors: list[str], cfg: RecipeConfig) -> None:
    """A mixture-of-experts policy: engines that train and generate it, and ``actor.moe.routing_replay``'s source of
    routes (docs/moe.md)."""
    moe, replay = model_is_moe(cfg), cfg.actor.moe.routing_replay
    if moe is False and replay != "none":
        errors.append(
            f"actor.moe.routing_replay={replay} replays a mixture of experts' routes, but the model is dense "
            f"({cfg.model.path or 'model.tiny_arch=' + cfg.model.tiny_arch}); set actor.moe.routing_replay=none"
        )
    if cfg.actor.moe.reference_replay:
        if moe is False:
            errors.append(
                "actor.moe.reference_replay=true replays a mixture of experts' routes in the reference, but the "
                "model is dense; set it to false"
            )
        if not needs_reference(cfg):
            errors.append(
                "actor.moe.reference_replay=true, but no reference loads (actor.use_kl_loss and "
                "algorithm.use_kl_in_reward are false); set it to false"
            )
        if not engine_can(cfg, "records_routes"):
            errors.append(
                f"actor.moe.reference_replay=true replays the experts the rollout engine chose, which "
                f"rollout.name={cfg.rollout.name!r} does not record (records_routes=False)"
            )
    if not moe:
        return
    roles = ["actor", "critic"] if uses_critic(cfg) else ["actor"]
    for role in roles:
        strategy = getattr(cfg, role).strategy
        if not train_engine_can(strategy, "supports_moe"):
            errors.append(
                f"the model is a mixture of experts, which {role}.strategy={strategy!r} does not train "
                f"(supports_moe=False); use {role}.strategy=fsdp"
            )
    tp_g = cfg.rollout.tensor_model_parallel_size
    if isinstance(tp_g, int) and tp_g > 1:
        errors.append(
            f"the model is a mixture of experts, which rollout.tensor_model_parallel_size={tp_g} does not split "
            "(the native engine's tensor parallelism cuts dense MLPs only); use rollout.tensor_model_parallel_size=1"
        )
    if replay == "rollout" and not engine_can(cfg, "records_routes"):
        errors.append(
            f"actor.moe.routing_replay=rollout replays the experts the rollout engine chose, which "
            f"rollout.name={cfg.rollout.name!r} does not record (records_routes=False); use rollout.name=native "
            "or sglang, or actor.moe.routing_replay=old_log_prob"
        )


def _check_lora(errors: list[str], cfg: RecipeConfig) -> None:
    """``actor.lora``: on the FSDP engine, and target modules the model has (read from its config on the meta
    device when the model directory exists already; a model a recipe builds later is checked when it loads)."""
    lora = cfg.actor.lora
    if not lora.enabled:
        return
    if not train_engine_can(cfg.actor.strategy, "supports_lora"):
        errors.append(
            f"actor.lora.rank={lora.rank} needs actor.strategy=fsdp (LoRA on the Megatron engine is not "
            f"supported), got actor.strategy={cfg.actor.strategy!r}"
        )
    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        from workers.engine.lora import target_module_errors

        errors.extend(
            target_module_errors(cfg.model.path, lora, trust_remote_code=cfg.model.trust_remote_code)
        )


def check_rollout(errors: list[str], cfg: RecipeConfig) -> None:
    """``rollout``: samples per prompt, lengths that follow ``data.*``, the engine, its tensor parallelism and its
    CUDA graphs."""
    r, d = cfg.rollout, cfg.data
    if r.n < 1:
        errors.append(f"rollout.n must be >= 1, got {r.n}")
    for data_key, roll_key in (
        ("max_prompt_length", "prompt_length"),
        ("max_response_length", "response_length"),
    ):
        dv, rv = getattr(d, data_key), getattr(r, roll_key)
        if dv >= 1 and dv != rv:  # dv < 1: the data check reports it
            errors.append(
                f"rollout.{roll_key}={rv} differs from data.{data_key}={dv}; set data.{data_key} "
                f"(the YAML makes rollout.{roll_key} follow it)"
            )
    _check_rollout_tp(errors, cfg)
    _check_rollout_graphs(errors, cfg)
    _check_rollout_engine(errors, cfg)


# The checks of the sections whose dataclasses are the workers' own (workers/config.py).
WORKER_SECTION_CHECKS: dict[str, Callable[[list[str], RecipeConfig], None]] = {
    "actor": check_actor,
    "rollout": check_rollout,
}
