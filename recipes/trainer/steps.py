"""The pieces of one RL step that every recipe shares: sampling settings, reward (``score``), log-probs
(``log_probs``), advantages on the controller, the update (``update_actor``), when a periodic action is due,
reward-error checks, and the trainer state kept in checkpoints."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from algorithms import apply_kl_penalty, get_rollout_correction_fn
from dataproto import DataProto
from recipes.sections import AlgorithmConfig, RecipeConfig
from recipes.trainer import checkpoint as ckpt
from recipes.trainer.metrics import timer
from recipes.trainer.roles import Roles, metrics_of
from recipes.trainer.run import RunAborted
from recipes.trainer.sources import fill_rows, run_estimator_on_sources

logger = logging.getLogger("recipes")

SEED_STRIDE = 1_000_003  # seeds of step k: rollout.seed * 2**32 + k * SEED_STRIDE + row


def rollout_meta(cfg: RecipeConfig, step: int) -> dict:
    """Sampling settings of a training rollout; the seed depends only on (rollout.seed, step), and the engine
    gives row i ``seed + i``, so a resumed run samples exactly what the uninterrupted one did."""
    r = cfg.rollout
    return {
        "n": r.n,
        "do_sample": True,
        "validate": False,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "response_length": r.response_length,
        "seed": r.seed * 2**32 + step * SEED_STRIDE,
    }


def score(roles: Roles, batch: DataProto, timings: dict) -> DataProto:
    """The reward worker's scores (``token_level_scores``) of the generated samples; timed as ``reward``."""
    with timer("reward", timings):
        return batch.union(roles.reward.compute_rm_score(batch))


def log_probs(
    cfg: RecipeConfig, roles: Roles, batch: DataProto, timings: dict, *, old_log_probs_needed: bool = False
) -> DataProto:
    """What every policy-gradient step computes between scoring and advantages: the log-probs of the sampled
    tokens the policy loss divides by (``old_log_probs``, per ``algorithm.old_log_prob``: see
    `old_log_prob_source`) and, when a KL term needs them, the frozen reference's (``ref_log_prob``); timed
    as ``old_log_prob`` and ``ref``. ``old_log_probs_needed``: the recipe reads ``old_log_probs`` before the
    update (e.g. an off-policy correction or a distillation term in its advantages)."""
    source = old_log_prob_source(cfg, batch, old_log_probs_needed)
    if source == "recompute":
        with timer("old_log_prob", timings):
            batch = batch.union(roles.actor.compute_log_prob(batch))
    elif source == "rollout":
        if "rollout_log_probs" not in batch.batch:
            raise ValueError(
                "algorithm.old_log_prob=rollout takes the rollout engine's log-probs, but the generated batch "
                "has no rollout_log_probs column (this rollout path does not return them): use auto or recompute"
            )
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        with timer("ref", timings):
            batch = batch.union(roles.reference().compute_ref_log_prob(batch))
    return batch


def old_log_prob_source(cfg: RecipeConfig, batch: DataProto, needed_before_update: bool) -> str:
    """Where this step's ``old_log_probs`` come from: ``recompute`` (the actor's forward pass now),
    ``rollout`` (the engine's ``rollout_log_probs``) or ``update`` (the update's own forward pass, which runs on
    the same weights when the update is strictly on-policy: one epoch, one mini-batch of the whole batch; the
    update returns them, `update_actor`)."""
    alg, actor = cfg.algorithm, cfg.actor
    if alg.old_log_prob != "auto":
        return alg.old_log_prob
    on_policy = actor.ppo_epochs == 1 and len(batch) == actor.ppo_mini_batch_size * cfg.rollout.n
    read_before = needed_before_update or alg.use_kl_in_reward or alg.rollout_correction != "none"
    return "update" if on_policy and not read_before else "recompute"


def update_actor(
    roles: Roles, batch: DataProto, timings: dict, *, sync_weights: bool = False, version: int | None = None
) -> dict[str, float]:
    """The policy update (timed as ``update_actor``); its metrics. A batch without ``old_log_probs`` gets the
    ones the update's forward pass computed (`old_log_prob_source` ``update``), for the step's metrics.
    ``sync_weights``: then the new weights to the rollout engines as policy ``version`` (timed as
    ``update_weights``); an in-process sync is sent right behind the update (``WeightSync.submit``), so the
    trainer ranks start it without a controller round trip."""
    if sync_weights and version is None:  # the engines would go on tagging tokens with the previous version
        raise ValueError("update_actor(sync_weights=True) needs the policy version the new weights are")
    with timer("update_actor", timings):
        update = roles.actor.update_actor.with_options(blocking=False)(batch)
        chained = roles.weight_sync.submit(version) if sync_weights else None
        out = update.get()
    if "old_log_probs" not in batch.batch:
        batch.batch["old_log_probs"] = out.batch["old_log_probs"]
    metrics = metrics_of(out)
    if sync_weights:
        with timer("update_weights", timings):
            metrics |= chained() if chained is not None else roles.sync_weights(version)
    return metrics


def apply_rollout_correction(batch: DataProto, alg: AlgorithmConfig) -> dict[str, float]:
    """The off-policy correction ``algorithm.rollout_correction`` (``algorithms.off_policy``) of samples the
    rollout engines produced (behaviour: ``rollout_log_probs``) against the trainer's policy before this
    update (proximal: ``old_log_probs``): ``rollout_is_weights`` into ``batch`` for the policy loss, and the
    ``off_policy/*`` metrics (how far behaviour and proximal policy are apart, logged also with ``none``)."""
    b = batch.batch
    weights, metrics = get_rollout_correction_fn(alg.rollout_correction)(
        b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], cap=alg.rollout_correction_cap
    )
    if weights is not None:
        b["rollout_is_weights"] = weights
    return {k: float(v) for k, v in metrics.items()}


def compute_advantage(batch: DataProto, alg: AlgorithmConfig, kl_ctrl) -> dict[str, float]:
    """token_level_rewards (= scores, minus beta * KL to the reference when algorithm.use_kl_in_reward), then
    ``advantages`` / ``returns`` from the estimator ``algorithm.adv_estimator``, grouped by ``uid``; written
    into ``batch``. Rows that take their advantage from another row (``advantage_source``: step-wise turns,
    RLM children) are left out of the groups and inherit it (``recipes/trainer/sources.py``)."""
    b = batch.batch
    metrics: dict[str, float] = {}
    if alg.use_kl_in_reward:
        rewards, metrics = apply_kl_penalty(
            b["token_level_scores"],
            b["old_log_probs"],
            b["ref_log_prob"],
            b["response_mask"],
            kl_ctrl,
            alg.kl_penalty,
        )
        b["token_level_rewards"] = rewards
    else:
        b["token_level_rewards"] = b["token_level_scores"]
    advantages, returns = run_estimator_on_sources(
        batch,
        alg.adv_estimator,
        values=b.get("values"),
        gamma=alg.gamma,
        lam=alg.lam,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
    )
    b["advantages"], b["returns"] = advantages.float(), returns.float()
    return metrics


def fill_mini_batches(cfg: RecipeConfig, batch: DataProto, with_critic: bool) -> DataProto:
    """A generated batch whose row count varies (step-wise turns, children as rows) filled up to whole PPO
    mini-batches of the actor (and critic) with rows that carry no loss (`sources.fill_rows`)."""
    rows = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    if with_critic:
        rows = math.lcm(rows, cfg.critic.ppo_mini_batch_size * cfg.rollout.n)
    return fill_rows(batch, rows)


def check_env_errors(batch: DataProto, step: int) -> None:
    """RunAborted when every trajectory of an agent environment's step ended with status "error" (no sandbox,
    no engine, a broken loop): training on it would only see reward 0. One failed trajectory fails only
    itself."""
    nt = batch.non_tensor_batch
    if "status" not in nt or not len(batch) or any(s != "error" for s in nt["status"]):
        return
    ranks = nt.get("env_rank")
    first: dict[str, str] = {}
    for i, tid in enumerate(nt["traj_id"]):
        if tid not in first and len(first) < 3:
            where = f"env rank {ranks[i]} " if ranks is not None and len(ranks) else ""
            first[tid] = f"{where}trajectory {tid}: {nt['error'][i] if 'error' in nt else '?'}"
    raise RunAborted(
        f"step {step}: every one of the {len(set(nt['traj_id']))} trajectories of the env role failed "
        f"(status 'error'); first errors: " + "; ".join(first.values())
    )


def due(step: int, freq: int, total: int) -> bool:
    """Every ``freq`` steps and at the last step; never when ``freq <= 0``."""
    return freq > 0 and (step % freq == 0 or step == total)


# ----------------------------------------------------------------------------------------------------------------
# Trainer state (in every checkpoint's ``extra``) and resuming
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TrainerState:
    step: int = 0
    skipped: dict[str, float] = field(default_factory=dict)  # cumulative skipped updates per role
    resumed_from: str | None = None  # the actor checkpoint this run continued from
    skipped_in_a_row: dict[str, int] = field(default_factory=dict)  # steps in a row with a skipped update
    # asynchronous recipes: prompts pulled from the loader but not trained on when the checkpoint was taken
    pending_prompts: list = field(default_factory=list)

    def check_skipped(self, metrics: dict, tracker=None, max_in_a_row: int | None = None) -> None:
        """Surface updates the engine skipped for a non-finite loss/gradient (it keeps a running count); raise
        RunAborted when a role's update was skipped in ``max_in_a_row`` steps in a row."""
        bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
        for role in ("actor", "critic"):
            key = f"{role}/skipped_steps"
            if key not in metrics:
                continue
            now, before = metrics[key], self.skipped.get(role, 0.0)
            in_a_row = self.skipped_in_a_row.get(role, 0) + 1 if now > before else 0
            self.skipped_in_a_row[role] = in_a_row
            if in_a_row and max_in_a_row is not None and in_a_row >= max_in_a_row:
                raise RunAborted(
                    f"step {self.step}: the {role} update was skipped in {in_a_row} steps in a row "
                    f"(trainer.max_consecutive_skipped_updates={max_in_a_row}): its gradient norm is not finite; "
                    f"non-finite metrics this step: {bad}"
                )
            if now > before:
                msg = (
                    f"WARNING step {self.step}: {role} update skipped (non-finite loss or gradient norm); "
                    f"{int(now)} skipped so far"
                )
                (tracker.write if tracker is not None else logger.warning)(msg)
            self.skipped[role] = now
            metrics[f"training/{role}_skipped_updates"] = now
        if bad and tracker is not None:
            tracker.write(f"WARNING step {self.step}: non-finite metrics {bad}")


def check_reward_errors(batch: DataProto, step: int, max_error_frac: float | None, tracker) -> None:
    """A console warning for each step in which samples failed to score (the scorer raised or returned a
    non-finite value: the sample got 0), with the count and the first error; RunAborted when at least
    ``reward.max_error_frac`` of the step's samples failed."""
    errors = [e for e in batch.non_tensor_batch.get("reward_error", ()) if e]
    if not errors:
        return
    what = (
        f"step {step}: {len(errors)} of {len(batch)} samples failed to score (reward 0); first: {errors[0]}"
    )
    if max_error_frac is not None and len(errors) >= max_error_frac * len(batch):
        raise RunAborted(f"{what} -- aborting (reward.max_error_frac={max_error_frac:g})")
    tracker.write(f"WARNING {what}")


@dataclass
class LearningSignalWatch:
    """Says once, loudly, when ``steps`` steps in a row gave every prompt group equal rewards
    (``reward/zero_variance_groups`` = 1): the reward then separates no sample from another and the policy does
    not learn from it, which a console of ``reward 0 | pg_loss 0`` lines would otherwise leave unexplained."""

    steps: int = 3
    flat_in_a_row: int = 0
    warned: bool = False

    def check(self, metrics: dict, step: int, tracker) -> None:
        if metrics.get("reward/zero_variance_groups", 0.0) < 1.0:
            self.flat_in_a_row = 0
            return
        self.flat_in_a_row += 1
        if self.warned or self.flat_in_a_row < self.steps:
            return
        self.warned = True
        mean = metrics.get("critic/score/mean", float("nan"))
        if metrics.get("train/accuracy", 0.0) >= 1.0:
            cause = "the task is saturated: every sample already earns the full score"
            fix = "a harder task (task.name / task.knobs) or fewer steps"
        else:
            entropy = metrics.get("actor/entropy")
            seen = f" (entropy {entropy:.2f})" if entropy is not None else ""
            cause = (
                f"the model cannot earn the reward yet{seen}: a randomly initialised model (model.path=null builds "
                "one) samples near-uniform tokens, whose entropy is about ln(vocabulary size)"
            )
            fix = (
                "start from a model that sometimes succeeds: keep the tiny model's warm start on (sft.enable, on "
                "by default when model.path is null) or give it more sft.total_steps, or set model.path to an SFT "
                "checkpoint (runs/quickstart/hf_model after `make demo`)"
            )
        tracker.write(
            f"WARNING steps {step - self.flat_in_a_row + 1}-{step}: every prompt group's samples got the same "
            f"score (mean {mean:.3g}), so the reward tells no sample from another (a group-relative advantage is 0 "
            f"everywhere; a critic has nothing to learn but its own errors) and the policy is not learning from "
            f"it. Likely cause: {cause}. Fix: {fix}. (Said once; reward/zero_variance_groups tracks it per step.)"
        )


def save_checkpoint(
    run, roles: Roles, state: TrainerState, loader, kl_ctrl, cfg: RecipeConfig, data_state: dict | None = None
) -> str:
    """``data_state``: the data position to save when the recipe's batch source has one of its own
    (``{"data": loader state, "async_pending": [prompt rows]}``, ``async_rl.RolloutStream``); default the
    loader's."""
    extra = {
        "step": state.step,
        "data": loader.state_dict(),
        "kl_coef": kl_ctrl.value,
        "skipped": dict(state.skipped),
    } | (data_state or {})
    return ckpt.save(
        run.checkpoint_dir, state.step, roles.checkpointed(), extra, keep=cfg.trainer.max_ckpt_to_keep
    )


def resume(run, roles: Roles, loader, kl_ctrl, cfg: RecipeConfig, mode: str | None = None) -> TrainerState:
    """Load the checkpoint ``mode`` (default ``trainer.resume_mode``) names (model, optimizer, schedule, RNG on
    the workers; step, data position and KL coefficient here); a fresh state when there is none."""
    t = cfg.trainer
    mode = t.resume_mode if mode is None else mode
    paths = ckpt.resolve_resume(mode, run.checkpoint_dir, list(roles.checkpointed()))
    if paths is None:
        return TrainerState()
    fallback = t.resume_fallback if mode == "auto" else None
    extra, paths = ckpt.load(paths, roles.checkpointed(), fallback=fallback)
    loader.load_state_dict(extra["data"])
    kl_ctrl.value = float(extra.get("kl_coef", kl_ctrl.value))
    return TrainerState(
        step=int(extra["step"]),
        skipped=dict(extra.get("skipped", {})),
        resumed_from=paths["actor"],
        pending_prompts=list(extra.get("async_pending", [])),
    )
