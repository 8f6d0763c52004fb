"""CriticWorker: the value model for GAE -- values of the response tokens and PPO value-loss updates.

The engine holds the model with a scalar head (``<Arch>ForTokenClassification(num_labels=1)`` or
`workers.models.ValueHeadModel`); the value of response token j is the head's output at the position that
predicts it. ``update_critic`` minimises ``algorithms.compute_value_loss`` (clipped around the rollout-time
``values``) toward ``returns`` on the tokens of ``response_mask``, aggregated over the global mini-batch
(``critic.ppo_mini_batch_size * rollout.n`` rows over the group per optimizer step).
"""

from __future__ import annotations

from algorithms import compute_value_loss, masked_mean
from controller import Dispatch, Inputs, register
from dataproto import DataProto
from workers.config import CriticConfig, ModelConfig, RolloutConfig
from workers.engine import LossContext
from workers.roles.common import (
    CRITIC_MESH,
    FORWARD_KEYS,
    EngineRoleWorker,
    StepMetrics,
    engine_config,
    ppo_micro_batch_kwargs,
    token_share,
)

UPDATE_INPUTS = Inputs(
    batch=("input_ids", "attention_mask", "responses", "response_mask", "values", "returns")
)


class CriticWorker(EngineRoleWorker):
    def __init__(self, model: ModelConfig, critic: CriticConfig, rollout: RolloutConfig):
        self.model_config = model
        self.critic_config = critic
        self.rollout_config = rollout
        if critic.cliprange_value is None or critic.cliprange_value < 0:
            raise ValueError(
                f"{self.tag}: critic.cliprange_value must be >= 0, got {critic.cliprange_value!r}"
            )
        self._check_ppo_section("critic", critic, rollout.n)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group and build the value-head engine (the head is initialised from critic.seed,
        identically on every rank)."""
        c = self.critic_config
        self._init_engine(
            engine_config(self.model_config, optim=c.optim, seed=c.seed, value_head=True), c, "critic"
        )

    @register(CRITIC_MESH, inputs=Inputs(batch=FORWARD_KEYS, optional=("response_mask",)))
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` [B, R]: 0 on response padding, and (when the batch has ``response_mask``) on every token the
        policy did not produce (environment observations), as verl does."""
        engine = self._require_engine("compute_values")
        batch = dict(data.batch)
        response_mask = batch.pop("response_mask", None)
        values = engine.compute_values(batch, **ppo_micro_batch_kwargs(self.critic_config))["values"]
        if response_mask is not None:
            values = values * (response_mask != 0).to(values.dtype)
        return DataProto.from_dict({"values": values})

    @register(CRITIC_MESH, inputs=UPDATE_INPUTS)
    def update_critic(self, data: DataProto) -> DataProto:
        """PPO epochs of clipped value-loss steps; ``meta_info["metrics"]``: ``critic/vf_loss``,
        ``critic/vf_clipfrac``, ``critic/vpred_mean`` (global, mean over the call's optimizer steps),
        ``critic/grad_norm``, ``critic/lr``, ``critic/skipped_steps``."""
        engine = self._require_engine("update_critic")
        c = self.critic_config
        mbs = self._ppo_mini_batch_rows("critic", c, len(data), "update_critic")
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

        m = self._ppo_train_step(data, loss_fn, c, mbs, stage="update_critic")
        return self._train_result("update_critic", "critic", m, metrics.reduce(engine))
