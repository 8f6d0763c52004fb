"""hyflow algorithms: pure tensor math for RL post-training (imports torch and numpy only).

Names and semantics follow verl's ``core_algos`` (also importable as ``algorithms.core_algos``):

* masked helpers: ``masked_sum``, ``masked_mean``, ``masked_var``, ``masked_whiten``
* advantage estimators, by name through ``get_adv_estimator_fn`` / ``run_adv_estimator``:
  ``gae``, ``grpo``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``,
  ``hybrid`` (GRPO + process-reward steps + hindsight on-policy distillation, ``algorithms.hybrid``);
  add more with ``@register_adv_est("name")``
* policy losses, by name through ``get_policy_loss_fn``: ``vanilla`` (PPO clip, dual-clip), ``gspo``;
  add more with ``@register_policy_loss("name")``
* off-policy rollout corrections for asynchronous RL, by name through ``get_rollout_correction_fn``:
  ``none``, ``tis``, ``seq_tis``, ``decoupled_ppo`` (``algorithms.off_policy``); their weights are the
  policy loss's ``rollout_is_weights``; add more with ``@register_rollout_correction("name")``
* ``compute_value_loss``, ``compute_entropy_loss``, ``entropy_from_logits``
* KL: ``kl_penalty``, ``compute_kl_loss``, ``apply_kl_penalty``, ``FixedKLController``,
  ``AdaptiveKLController``, ``get_kl_controller``
* loss aggregation: ``agg_loss`` and ``make_global_batch_info``; read ``algorithms.aggregation``'s
  docstring for the micro-batch / data-parallel convention (sum over micro-batches, AVG over DP).
"""

from algorithms.advantages import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    group_ids,
    run_adv_estimator,
)
from algorithms.aggregation import GLOBAL_BATCH_INFO_KEYS, LOSS_AGG_MODES, agg_loss, make_global_batch_info
from algorithms.entropy import compute_entropy_loss, entropy_from_logits
from algorithms.hybrid import compute_hybrid_advantage, normalize_step_rewards, step_index_from_mask
from algorithms.kl import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    get_kl_controller,
    kl_penalty,
)
from algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from algorithms.off_policy import (
    OFF_POLICY_METRICS,
    compute_rollout_correction_decoupled_ppo,
    compute_rollout_correction_none,
    compute_rollout_correction_seq_tis,
    compute_rollout_correction_tis,
)
from algorithms.policy_loss import (
    GSPO_CLIP_RATIO_HIGH,
    GSPO_CLIP_RATIO_LOW,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
)
from algorithms.registry import (
    ADV_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    ROLLOUT_CORRECTION_REGISTRY,
    AdvantageEstimator,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    get_rollout_correction_fn,
    list_adv_estimators,
    list_rollout_corrections,
    register_adv_est,
    register_policy_loss,
    register_rollout_correction,
)
from algorithms.value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "GLOBAL_BATCH_INFO_KEYS",
    "GSPO_CLIP_RATIO_HIGH",
    "GSPO_CLIP_RATIO_LOW",
    "KL_PENALTY_NAMES",
    "LOSS_AGG_MODES",
    "OFF_POLICY_METRICS",
    "POLICY_LOSS_REGISTRY",
    "ROLLOUT_CORRECTION_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_hybrid_advantage",
    "compute_kl_loss",
    "compute_policy_loss_gspo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_correction_decoupled_ppo",
    "compute_rollout_correction_none",
    "compute_rollout_correction_seq_tis",
    "compute_rollout_correction_tis",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "get_rollout_correction_fn",
    "group_ids",
    "kl_penalty",
    "list_adv_estimators",
    "list_rollout_corrections",
    "make_global_batch_info",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_step_rewards",
    "register_adv_est",
    "register_policy_loss",
    "register_rollout_correction",
    "run_adv_estimator",
    "step_index_from_mask",
]
