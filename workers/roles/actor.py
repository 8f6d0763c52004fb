"""ActorWorker: the policy being trained -- old log-probs, PPO updates, supervised warm-start steps, checkpoints.

One instance per rank of the actor's worker group; ``init_model`` joins the group's process group and builds
the training engine ``actor.strategy`` names (`workers.engine.registry`): `FSDPEngine` (FSDP2 over all ranks
when the group has more than one) by default, or with ``actor.strategy=megatron`` a `MegatronEngine`
(``actor.megatron``: TP x PP ranks per model replica, the rest data parallel). It uses the engine only through
the `TrainEngine` contract and what the engine declares (``supports_lora``, ...). The data
methods use the n-D dispatch on mesh "actor" (``ACTOR_MESH``): each data-parallel replica gets a contiguous
chunk of the batch (all of its TP/PP ranks the same chunk) and one rank per replica is collected, in order.

Its weights leave it two ways: in process, to a rollout role colocated with it (`workers.roles.rollout.
RolloutWorker` built with ``trainer=Shared("actor")`` reads ``hf_weight_stream`` and offloads the engine while
it generates), or over a weight-sync process group to a rollout pool of its own (``open_weight_sync_store``,
``init_weight_sync``, ``send_weights``: trainer rank 0 broadcasts size-bounded buckets of full tensors), driven
from the controller by `workers.weight_sync.WeightSync`.

Loss of `update_actor`, per PPO mini-batch (``actor.ppo_mini_batch_size * rollout.n`` rows in all)::

    policy_loss(old_log_probs, log_probs, advantages, response_mask)      # registry name actor.policy_loss
      - entropy_coeff * agg(entropy)
      + kl_loss_coef * agg(kl_penalty(log_probs, ref_log_prob))            # if actor.use_kl_loss

every term aggregated by ``actor.loss_agg_mode`` over the *global* mini-batch (``ctx.global_batch_info``),
so the gradient does not depend on the micro-batch size or the number of ranks.

A strictly on-policy update (one epoch, one mini-batch) may come without ``old_log_probs``
(``algorithm.old_log_prob=auto``): its only forward pass runs on the weights before its only optimizer step,
so its own log-probs, detached, are the old ones (a ``compute_log_prob`` pass first would compute the same
numbers); the call returns them as ``old_log_probs``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

from algorithms import KL_PENALTY_NAMES, agg_loss, compute_kl_loss, get_policy_loss_fn
from controller import Dispatch, Inputs, register
from dataproto import DataProto
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.engine import LossContext, TrainEngine
from workers.engine.base import as_lora_engine
from workers.engine.moe_forward import OLD_ROUTES, ROLLOUT_ROUTES
from workers.engine.registry import train_engine_class
from workers.roles.common import (
    ACTOR_MESH,
    FORWARD_KEYS,
    EngineRoleWorker,
    StepMetrics,
    engine_config,
    log_prob_settings,
    ppo_micro_batch_kwargs,
    token_share,
)
from workers.roles.reference import compute_ref_log_prob, compute_teacher_log_prob
from workers.roles.sync_member import WeightSyncMember
from workers.weight_sync import DEFAULT_GROUP_NAME, bucket_mb_to_bytes, hf_named_tensors, stream_metrics

# Optional per-token weights (rollout importance-sampling correction) passed to the policy loss when present.
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"
UPDATE_INPUTS = Inputs(
    batch=("input_ids", "attention_mask", "responses", "response_mask", "advantages"),
    # ref_log_prob: needed with actor.use_kl_loss; old_log_probs: unless the update is strictly on-policy
    optional=("old_log_probs", "ref_log_prob", ROLLOUT_IS_WEIGHTS, ROLLOUT_ROUTES, OLD_ROUTES),
)
ROW_INDEX = "_row"  # the row of each micro-batch row in the call's batch (on-policy old log-probs go there)


def replay_kwargs(routing_replay: str) -> dict[str, str]:
    """The update's ``replay_routes`` for ``actor.moe.routing_replay`` (none: no argument, which any engine takes)."""
    column = {"rollout": ROLLOUT_ROUTES, "old_log_prob": OLD_ROUTES}.get(routing_replay)
    return {"replay_routes": column} if column else {}


class ActorWorker(EngineRoleWorker, WeightSyncMember):
    # with LoRA the actor is also the reference: its frozen base model (`_reference_log_probs`)
    compute_ref_log_prob = compute_ref_log_prob
    compute_teacher_log_prob = compute_teacher_log_prob

    def __init__(self, model: ModelConfig, actor: ActorConfig, rollout: RolloutConfig):
        self.model_config = model
        self.actor_config = actor
        self.rollout_config = rollout
        self.reference_replay = actor.moe.reference_replay  # with LoRA, its base model is the reference
        self._check_config()

    def _check_config(self) -> None:
        a = self.actor_config
        get_policy_loss_fn(a.policy_loss)  # unknown name: ValueError listing the registered ones
        if a.use_kl_loss and a.kl_loss_type not in KL_PENALTY_NAMES:
            raise ValueError(
                f"{self.tag}: actor.kl_loss_type={a.kl_loss_type!r} is not one of {list(KL_PENALTY_NAMES)}"
            )
        self._check_ppo_section("actor", a, self.rollout_config.n)
        if a.lora.enabled and not train_engine_class(a.strategy, "actor.strategy").supports_lora:
            raise ValueError(
                f"{self.tag}: actor.lora needs a training engine that supports LoRA (actor.strategy=fsdp), got "
                f"actor.strategy={a.strategy!r}"
            )

    # -- setup ------------------------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, build the engine (model + AdamW + LR schedule) and load the tokenizer."""
        a = self.actor_config
        lora = a.lora if a.lora.enabled else None
        config = engine_config(self.model_config, optim=a.optim, seed=a.seed, lora=lora, moe=a.moe)
        self._init_engine(config, a, "actor")

    # -- the reference, with LoRA: the frozen base ---------------------------------------------------------------

    def _reference_mode(self, engine: TrainEngine, method: str) -> AbstractContextManager:
        if not self.actor_config.lora.enabled:
            raise RuntimeError(
                f"{self.tag}: {method}: the actor scores as the reference only with actor.lora (its frozen base "
                "model); without LoRA the reference is a RefWorker of its own"
            )
        return as_lora_engine(engine, f"{self.tag}: {method}").base_model_mode()

    # -- forward ----------------------------------------------------------------------------------------------

    @register(ACTOR_MESH, inputs=Inputs(batch=FORWARD_KEYS, optional=(ROLLOUT_ROUTES,)))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` [B, R] (and ``entropys`` unless ``meta_info["calculate_entropy"]`` is False) of the
        responses at ``meta_info["temperature"]`` (default rollout.temperature); zeros on response padding.
        Micro-batching: rollout.log_prob_* (meta_info use_dynamic_bsz / max_token_len / micro_batch_size win).
        A mixture of experts replays the rollout's routes with ``actor.moe.routing_replay=rollout``; with
        ``old_log_prob`` it returns its own routes as ``old_routed_experts``, which the update replays."""
        engine = self._require_engine("compute_log_prob")
        calc_entropy = bool(data.meta_info.get("calculate_entropy", True))
        temperature, micro = log_prob_settings(self.tag, self.rollout_config, data.meta_info)
        replay = self.actor_config.moe.routing_replay
        out = engine.compute_log_prob(
            data.batch,
            temperature=temperature,
            calculate_entropy=calc_entropy,
            **({"replay_routes": ROLLOUT_ROUTES} if replay == "rollout" else {}),
            **micro,
        )
        tensors = {"old_log_probs": out["log_probs"]}
        if calc_entropy:
            tensors["entropys"] = out["entropy"]
        if replay == "old_log_prob" and "routes" in out:
            tensors[OLD_ROUTES] = out["routes"]
        return DataProto.from_dict(tensors, meta_info={"temperature": temperature})

    # -- training ---------------------------------------------------------------------------------------------

    @register(ACTOR_MESH, inputs=UPDATE_INPUTS)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches of this rank's chunk; returns ``DataProto(meta_info={"metrics": ...})``
        with verl's names (``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``,
        ``actor/entropy``, ``actor/kl_loss``, ``actor/grad_norm``, ``actor/lr``, ``actor/skipped_steps``).
        Loss metrics are global (all ranks) and averaged over the call's optimizer steps. A batch without
        ``old_log_probs`` must be one epoch of one mini-batch (see the module docstring); the result then has
        the ``old_log_probs`` [B, R] its forward pass computed."""
        engine = self._require_engine("update_actor")
        a = self.actor_config
        if a.use_kl_loss:
            self._require_keys(data, ["ref_log_prob"], "update_actor")
        temperature, _ = log_prob_settings(self.tag, self.rollout_config, data.meta_info)
        mbs = self._ppo_mini_batch_rows("actor", a, len(data), "update_actor")
        own_old = self._on_policy_old_log_probs(data, mbs)
        if own_old is not None:
            data = DataProto(
                batch={**data.batch, ROW_INDEX: torch.arange(len(data))}, meta_info=data.meta_info
            )
        replay = replay_kwargs(a.moe.routing_replay)
        if own_old is not None and replay.get("replay_routes") == OLD_ROUTES:
            replay = {}  # strictly on-policy: this forward is the old log-prob pass, whose routes are its own
        policy_loss_fn = get_policy_loss_fn(a.policy_loss)
        names = ["pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "entropy"]
        if a.use_kl_loss:
            names.append("kl_loss")
        metrics = StepMetrics(names, num_mini_batches=len(data) // mbs, epochs=a.ppo_epochs)

        def loss_fn(outputs: dict, micro: dict, ctx: LossContext):
            log_prob, entropy = outputs["log_probs"], outputs["entropy"]
            mask = micro["response_mask"]
            info = ctx.global_batch_info
            if own_old is None:
                old_log_prob = micro["old_log_probs"]
            else:  # strictly on-policy: this forward's log-probs are the old ones
                old_log_prob = log_prob.detach()
                own_old[micro[ROW_INDEX].cpu()] = old_log_prob.float().cpu()
            pg_loss, clipfrac, ppo_kl, clipfrac_lower = policy_loss_fn(
                old_log_prob,
                log_prob,
                micro["advantages"],
                mask,
                a.loss_agg_mode,
                clip_ratio=a.clip_ratio,
                clip_ratio_low=a.clip_ratio_low,
                clip_ratio_high=a.clip_ratio_high,
                clip_ratio_c=a.clip_ratio_c,
                global_batch_info=info,
                rollout_is_weights=micro.get(ROLLOUT_IS_WEIGHTS),
            )
            if not a.entropy_coeff:
                entropy = entropy.detach()  # metric only: no graph through the softmax
            entropy_loss = agg_loss(entropy, mask, a.loss_agg_mode, global_batch_info=info)
            loss = pg_loss - a.entropy_coeff * entropy_loss if a.entropy_coeff else pg_loss
            parts = dict(
                pg_loss=pg_loss.detach(),
                pg_clipfrac=token_share(clipfrac, mask, ctx),
                ppo_kl=token_share(ppo_kl, mask, ctx),
                pg_clipfrac_lower=token_share(clipfrac_lower, mask, ctx),
                entropy=entropy_loss.detach(),
            )
            if a.use_kl_loss:
                kl_loss = compute_kl_loss(
                    log_prob, micro["ref_log_prob"], mask, a.kl_loss_type, a.loss_agg_mode, info
                )
                loss = loss + a.kl_loss_coef * kl_loss
                parts["kl_loss"] = kl_loss.detach()
            metrics.add(ctx, **parts)
            return loss

        m = self._ppo_train_step(
            data,
            loss_fn,
            a,
            mbs,
            stage="update_actor",
            temperature=temperature,
            calculate_entropy=True,
            **replay,
        )
        losses = metrics.reduce(engine)
        # mixture of experts (this rank's micro-batches): router losses, experts that differ from the rollout's
        losses.update({k: v for k, v in m.items() if k.startswith("moe/")})
        if a.use_kl_loss:
            losses["kl_coef"] = float(a.kl_loss_coef)
        result = self._train_result("update_actor", "actor", m, losses)
        if own_old is not None:
            result = DataProto.from_dict({"old_log_probs": own_old}, meta_info=result.meta_info)
        return result

    def _on_policy_old_log_probs(self, data: DataProto, mini_batch_rows: int) -> torch.Tensor | None:
        """None when the batch has ``old_log_probs``; else the [B, R] buffer the update's forward fills, after
        checking that the update is strictly on-policy (otherwise its later mini-batches and epochs would run
        on weights the samples did not come from)."""
        if "old_log_probs" in data.batch:
            return None
        a = self.actor_config
        if a.ppo_epochs != 1 or mini_batch_rows != len(data):
            raise ValueError(
                f"{self.tag}: update_actor: the batch has no old_log_probs, which only a strictly on-policy "
                f"update may leave out (actor.ppo_epochs=1 and one mini-batch); this one has actor.ppo_epochs="
                f"{a.ppo_epochs} and {len(data) // mini_batch_rows} mini-batches of {mini_batch_rows} rows "
                f"per rank: compute old_log_probs first (algorithm.old_log_prob=recompute)"
            )
        return torch.zeros(data.batch["responses"].shape, dtype=torch.float32)

    @register(ACTOR_MESH, inputs=Inputs(batch=(*FORWARD_KEYS, "response_mask")))
    def sft_step(self, data: DataProto) -> DataProto:
        """One supervised optimizer step on the whole batch: token-mean negative log-likelihood (temperature 1)
        of ``responses`` where ``response_mask`` is 1, over all ranks. Metrics ``sft/loss``, ``sft/grad_norm``,
        ``sft/lr``, ``sft/skipped_steps``."""
        engine = self._require_engine("sft_step")

        def loss_fn(outputs: dict, micro: dict, ctx: LossContext):
            nll = -outputs["log_probs"]
            return agg_loss(
                nll, micro["response_mask"], "token-mean", global_batch_info=ctx.global_batch_info
            )

        m = engine.train_step(
            data.batch, loss_fn, temperature=1.0, **ppo_micro_batch_kwargs(self.actor_config)
        )
        return self._train_result("sft_step", "sft", m, {"loss": float(m["loss"])})

    # -- weights out ------------------------------------------------------------------------------------------

    def hf_weight_stream(
        self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, adapter_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` for every parameter (and persistent buffer) of the training model (with
        LoRA: the adapters merged in), one all-gather at a time; ``adapter_only`` (LoRA): the adapter's tensors
        alone, under PEFT's names. Collective: every rank of the trainer group must consume it to the end."""
        engine = self._require_engine("hf_weight_stream")
        if adapter_only:
            lora_engine = as_lora_engine(engine, f"{self.tag}: hf_weight_stream(adapter_only=True)")
            return lora_engine.adapter_state_iter(device=device, dtype=dtype)
        tied = bool(getattr(engine.hf_config, "tie_word_embeddings", False))
        return hf_named_tensors(
            engine.full_state_dict_iter(device=device, dtype=dtype), tie_word_embeddings=tied
        )

    @register(Dispatch.RANK_ZERO)
    def open_weight_sync_store(
        self, world_size: int, group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = 300.0
    ) -> tuple[str, int]:
        """Host the weight-sync group's TCPStore on this process (trainer rank 0) on a port the OS picks;
        returns ``(node address, port)`` for the rollout ranks to dial. ``init_weight_sync`` then joins
        through it."""
        return self.weight_sync_groups.host_store(group_name, world_size, timeout_s)

    @register(Dispatch.ONE_TO_ALL_RANK_ZERO)
    def send_weights(
        self,
        bucket_bytes: int | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        adapter_only: bool = False,
    ) -> dict:
        """Broadcast the full weights (``adapter_only``: the LoRA adapter alone) to the weight-sync group; every
        trainer rank must run it (each takes part in gathering every parameter), rank 0 sends. Buckets hold at
        most ``bucket_bytes`` (default ``rollout.weight_bucket_mb`` MiB); a larger tensor travels alone.
        Returns rank 0's metrics."""
        t0 = time.perf_counter()
        if bucket_bytes is None:
            bucket_bytes = bucket_mb_to_bytes(self.rollout_config.weight_bucket_mb)
        group = self.weight_sync_groups.get(group_name) if self.rank == 0 else None
        if self.rank == 0 and group is None:
            # Still consume the stream so the other ranks' gathers do not hang, then fail.
            for _ in self.hf_weight_stream(adapter_only=adapter_only):
                pass
            self.weight_sync_groups.require(group_name, f"{self.tag}: send_weights")
        if group is None:  # ranks > 0: take part in the gathers only (full tensors stay where they are made)
            device = self._require_engine("send_weights").device
            for _ in self.hf_weight_stream(device=device, adapter_only=adapter_only):
                pass
            return {}
        stream = self.hf_weight_stream(device=group.device, adapter_only=adapter_only)
        try:
            stats = group.send(stream, bucket_bytes)
        finally:
            for _ in stream:  # a failed broadcast must not leave the other trainer ranks in a gather
                pass
        return stream_metrics(stats, time.perf_counter() - t0) | {
            "weight_sync/max_bucket_bytes": stats["max_bucket_bytes"],
            "weight_sync/bucket_bytes": bucket_bytes,
        }
