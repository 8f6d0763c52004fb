"""CriticWorker: the value model for GAE -- values of the response tokens and PPO value-loss updates.

The engine holds the model with a scalar head (``<Arch>ForTokenClassification(num_labels=1)`` or
`workers.models.ValueHeadModel`); the value of response token j is the head's output at the position that
predicts it. ``update_critic`` minimises ``algorithms.compute_value_loss`` (clipped around the rollout-time
``values``) toward ``returns`` on the tokens of ``response_mask``, aggregated over the global mini-batch
(``critic.ppo_mini_batch_size * rollout.n`` rows over the group per optimizer step).
"""

from __future__ import annotations

from algorithms import LOSS_AGG_MODES, compute_value_loss, masked_mean
from controller import Dispatch, register
from dataproto import DataProto
from workers.config import CriticConfig, ModelConfig, RolloutConfig
from workers.engine import FSDPEngine, LossContext
from workers.models import load_tokenizer
from workers.roles.common import (
    CRITIC_MESH,
    FORWARD_KEYS,
    EngineRoleWorker,
    StepMetrics,
    build_engine,
    data_parallel_size,
    engine_config,
    micro_batch_kwargs,
    token_share,
)

UPDATE_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "values", "returns")


class CriticWorker(EngineRoleWorker):
    def __init__(self, model: ModelConfig, critic: CriticConfig, rollout: RolloutConfig):
        self.model_config = model
        self.critic_config = critic
        self.rollout_config = rollout
        self.engine: FSDPEngine | None = None
        self.tokenizer = None
        c = critic
        if c.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"{self.tag}: critic.loss_agg_mode={c.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}"
            )
        if c.cliprange_value is None or c.cliprange_value < 0:
            raise ValueError(f"{self.tag}: critic.cliprange_value must be >= 0, got {c.cliprange_value!r}")
        if c.ppo_epochs < 1:
            raise ValueError(f"{self.tag}: critic.ppo_epochs must be >= 1, got {c.ppo_epochs}")
        dp = data_parallel_size(self.world_size, c.strategy, c.megatron, section="critic", tag=self.tag)
        rows = c.ppo_mini_batch_size * rollout.n
        if rows < 1 or rows % dp:
            raise ValueError(
                f"{self.tag}: critic.ppo_mini_batch_size * rollout.n = {rows} rows per optimizer step must be a "
                f"positive multiple of the data-parallel size {dp}"
            )

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group and build the value-head engine (the head is initialised from critic.seed,
        identically on every rank)."""
        self.init_distributed()
        cfg = engine_config(
            self.model_config, optim=self.critic_config.optim, seed=self.critic_config.seed, value_head=True
        )
        c = self.critic_config
        self.engine = build_engine(cfg, c.strategy, c.megatron, tag=self.tag)
        self._register_mesh("critic")
        self.tokenizer = load_tokenizer(
            self.model_config.path, trust_remote_code=self.model_config.trust_remote_code
        )

    def _micro(self) -> dict:
        c = self.critic_config
        return micro_batch_kwargs(
            c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu
        )

    @register(CRITIC_MESH)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` [B, R]: 0 on response padding, and (when the batch has ``response_mask``) on every token the
        policy did not produce (environment observations), as verl does."""
        engine = self._require_engine("compute_values")
        self._require_keys(data, FORWARD_KEYS, "compute_values")
        values = engine.compute_values(self._select(data, FORWARD_KEYS), **self._micro())["values"]
        if "response_mask" in data.batch:
            values = values * (data.batch["response_mask"] != 0).to(values.dtype)
        return DataProto.from_dict({"values": values})

    @register(CRITIC_MESH)
    def update_critic(self, data: DataProto) -> DataProto:
        """PPO epochs of clipped value-loss steps; ``meta_info["metrics"]``: ``critic/vf_loss``,
        ``critic/vf_clipfrac``, ``critic/vpred_mean`` (global, mean over the call's optimizer steps),
        ``critic/grad_norm``, ``critic/lr``, ``critic/skipped_steps``."""
        engine = self._require_engine("update_critic")
        c = self.critic_config
        self._require_keys(data, UPDATE_KEYS, "update_critic")
        mbs = self._local_mini_batch_rows(
            c.ppo_mini_batch_size * self.rollout_config.n,
            len(data),
            "update_critic",
            "critic.ppo_mini_batch_size * rollout.n",
        )
        metrics = StepMetrics(
            ["vf_loss", "vf_clipfrac", "vpred_mean"], num_mini_batches=len(data) // mbs, epochs=c.ppo_epochs
        )

        def loss_fn(outputs: dict, micro: dict, ctx: LossContext):
            vpreds, mask = outputs["values"], micro["response_mask"]
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds,
                micro["returns"],
                micro["values"],
                mask,
                c.cliprange_value,
                c.loss_agg_mode,
                global_batch_info=ctx.global_batch_info,
            )
            metrics.add(
                ctx,
                vf_loss=vf_loss.detach(),
                vf_clipfrac=token_share(vf_clipfrac, mask, ctx),
                vpred_mean=token_share(masked_mean(vpreds.detach(), mask), mask, ctx),
            )
            return vf_loss

        m = engine.train_step(
            self._select(data, UPDATE_KEYS),
            loss_fn,
            mini_batch_size=mbs,
            epochs=c.ppo_epochs,
            shuffle=c.shuffle,
            **self._micro(),
        )
        out = {f"critic/{k}": v for k, v in metrics.reduce(engine).items()}
        out.update(
            {
                "critic/grad_norm": float(m["grad_norm"]),
                "critic/lr": float(m["lr"]),
                "critic/skipped_steps": float(engine.skipped_steps),
            }
        )
        self._warn_skipped("update_critic", m)
        return DataProto(meta_info={"metrics": out})
