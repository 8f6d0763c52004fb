"""Config schema of ``recipes/hybrid_rl.py`` (``hybrid_rl.yaml``; the GRPO baseline ``hybrid_rl_grpo.yaml``).

The quickstart's sections (``sft`` warm start included) plus

* ``env`` -- ``workers.math_env.env_loop.MathToolEnvConfig``: the agent (turns, tokens per turn,
  observation size) and the sandbox of the Python tool;
* ``prm`` -- ``workers.prm.worker.PRMConfig``: the judge (``reference`` / ``checkpoint`` / ``http``), votes
  per step, hints, placement (``separate``: its own pool; ``colocated``: in the rollout worker's processes);
* ``hybrid`` -- the advantage's weights: ``w_rl``, ``w_opd``, ``opd_clip``, whether the PRM term is used,
  and how a hint is written into the teacher's context (``hint_template``);
* ``eval`` -- what the validation measures (when: ``trainer.val_before_train`` / ``trainer.test_freq``): pass@k
  for every k in ``eval.pass_k`` from ``max(pass_k)`` samples per held-out problem at ``eval.temperature``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recipes.config import SCHEMAS, ConfigError, QuickstartConfig
from workers.math_env.env_loop import MathToolEnvConfig
from workers.prm.worker import PRMConfig

__all__ = ["HybridConfig", "HybridEvalConfig", "HybridWeightsConfig", "check", "register_schema"]


@dataclass
class HybridWeightsConfig:
    w_rl: float = 1.0  # weight of the RL term (GRPO outcome + PRM step advantage)
    w_opd: float = 1.0  # weight of the on-policy distillation term (teacher - old log-prob)
    opd_clip: float | None = 5.0  # bound on |log pi_teacher - log pi_old| per token (None: none)
    use_prm_reward: bool = True  # add the normalised PRM step advantage to the RL term
    hint_template: str = "Hint: {hint}\n"  # what goes between the prompt and the response for the teacher


@dataclass
class HybridEvalConfig:
    pass_k: list[int] = field(default_factory=lambda: [1, 4])
    temperature: float = 1.0  # sampling temperature of the validation samples


@dataclass
class HybridConfig(QuickstartConfig):
    env: MathToolEnvConfig = field(default_factory=MathToolEnvConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    hybrid: HybridWeightsConfig = field(default_factory=HybridWeightsConfig)
    eval: HybridEvalConfig = field(default_factory=HybridEvalConfig)


def register_schema() -> None:
    """Make ``parse_args("hybrid_rl")`` know ``HybridConfig`` (the baseline is ``--config hybrid_rl_grpo.yaml``)."""
    SCHEMAS.setdefault("hybrid_rl", HybridConfig)


def check(cfg: HybridConfig) -> None:
    """What the general validation cannot know about this recipe; errors name the keys."""
    errors = []
    a, h = cfg.algorithm, cfg.hybrid
    if a.adv_estimator not in ("hybrid", "grpo"):
        errors.append(
            f"algorithm.adv_estimator must be hybrid (the method) or grpo (the baseline), got {a.adv_estimator!r}"
        )
    if a.adv_estimator == "hybrid" and not cfg.prm.enable:
        errors.append(
            "algorithm.adv_estimator=hybrid needs prm.enable=true (step scores and hints come from the PRM)"
        )
    if h.w_rl < 0 or h.w_opd < 0:
        errors.append(f"hybrid.w_rl and hybrid.w_opd must be >= 0, got {h.w_rl}, {h.w_opd}")
    if h.opd_clip is not None and h.opd_clip <= 0:
        errors.append(f"hybrid.opd_clip must be > 0 or null, got {h.opd_clip}")
    if "{hint}" not in h.hint_template:
        errors.append(f"hybrid.hint_template must contain {{hint}}, got {h.hint_template!r}")
    if not cfg.eval.pass_k or min(cfg.eval.pass_k) < 1:
        errors.append(f"eval.pass_k must be a non-empty list of k >= 1, got {cfg.eval.pass_k}")
    if max(cfg.eval.pass_k or [1]) > 1 and cfg.eval.temperature <= 0:
        errors.append(f"eval.pass_k={cfg.eval.pass_k} needs sampled validation: eval.temperature > 0")
    if cfg.prm.max_steps < cfg.env.agent.max_turns:
        errors.append(
            f"prm.max_steps={cfg.prm.max_steps} < env.agent.max_turns={cfg.env.agent.max_turns}: later steps "
            "would get no PRM score"
        )
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
