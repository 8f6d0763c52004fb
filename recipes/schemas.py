"""Each recipe's config schema, and ``SCHEMAS``: recipe name -> schema, what ``load_config(recipe)`` reads.

* ``GRPOConfig`` (``grpo``) and ``PPOConfig`` (``ppo``): the shared sections (``RecipeConfig``); PPO trains a
  critic (``adv_estimator=gae``), GRPO does not.
* ``GRPOAsyncConfig`` (``grpo_async``): GRPO plus ``async_rl`` (``recipes.sections.AsyncRLConfig``: one-step
  off-policy or fully asynchronous generation, staleness bound, buffer, what happens to in-flight requests at a
  weight update).
* ``quickstart``: GRPO's schema; its YAML always warm-starts (``sft.enable: true``).
* ``RLMConfig`` (``rlm``): GRPO's sections plus ``env`` and ``async_rl``. ``env`` is any agent
  environment: the dataclass of the loop ``env.loop`` names (``AgentLoop.config_class``; read by
  ``recipes.config.load_config``), by default the RLM REPL's (``workers.rlm.env_loop.RLMEnvConfig``: agent
  limits, sandbox); ``env.loop: mixed`` holds several (``workers.agents.mixed``), and a data file whose
  ``env_name`` column names none of them is refused here, naming file and row (``check_data_env_names``).
* ``HybridConfig`` (``hybrid_rl``; the GRPO baseline is ``hybrid_rl_grpo.yaml``): GRPO's sections plus
  ``env`` (``workers.math_env.env_loop.MathToolEnvConfig``: turns, tokens per turn, observation size, the
  Python tool's sandbox; an ``env.loop`` whose config does not derive from it is refused), ``prm``
  (``workers.prm.worker.PRMConfig``: the judge -- ``reference`` / ``checkpoint`` / ``http`` --, votes per step,
  hints, placement), ``hybrid`` (the advantage's weights ``w_rl``, ``w_opd``, ``opd_clip``, whether the PRM term
  is used, how a hint is written into the teacher's context) and ``eval`` (what validation measures -- when is
  ``trainer.val_before_train`` / ``trainer.test_freq`` --: pass@k for every k in ``eval.pass_k`` from
  ``max(pass_k)`` samples per held-out problem at ``eval.temperature``).

Each section checks itself (``recipes.sections``, which also holds ``RecipeConfig``, the sections every recipe
has); a schema adds the rules of its recipe across sections in
``check_recipe``. The type a schema gives ``env`` is the base every ``env.loop``'s config must derive from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from recipes.sections import AsyncRLConfig, RecipeConfig
from workers.agents.loop import AgentEnvConfig
from workers.math_env.env_loop import MathToolEnvConfig
from workers.prm.worker import PRMConfig
from workers.rlm.env_loop import RLMEnvConfig


@dataclass
class GRPOConfig(RecipeConfig):
    """``recipes/grpo.py``: critic-free estimators."""

    def check_recipe(self, errors: list[str]) -> None:
        if self.algorithm.adv_estimator == "gae":
            errors.append("algorithm.adv_estimator=gae needs a critic; use recipes.ppo")


@dataclass
class GRPOAsyncConfig(GRPOConfig):
    """``recipes/grpo_async.py``: GRPO with generation overlapping training (``async_rl``)."""

    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)


@dataclass
class PPOConfig(RecipeConfig):
    """``recipes/ppo.py``: actor and critic, GAE."""

    def check_recipe(self, errors: list[str]) -> None:
        if self.algorithm.adv_estimator != "gae":
            errors.append(
                "recipes.ppo trains a critic: algorithm.adv_estimator must be gae, got "
                f"{self.algorithm.adv_estimator!r}"
            )


def check_data_env_names(errors: list[str], cfg: RLMConfig) -> None:
    """A row of ``data.train_files`` / ``data.val_files`` whose ``env_name`` is none of ``env.env_names()`` (a
    mixed env's ``env.envs``; ``""`` or ``env.loop`` for one environment): an error naming the file, the row and
    the known names, before the run starts (the prompt loader checks the rows it reads again)."""
    from recipes.data.prompts import UnknownEnvNameError, check_env_names

    try:
        check_env_names([*cfg.data.train_files, *cfg.data.val_files], cfg.env.env_names())
    except UnknownEnvNameError as err:
        errors.append(str(err))


@dataclass
class RLMConfig(GRPOConfig):
    """``recipes/rlm.py``: GRPO on agent trajectories (RLM unless ``env.loop`` names another environment) after a
    warm start on replayed reference solutions; ``async_rl`` as ``recipes/grpo_async.py`` (trajectories generated
    while the trainer trains)."""

    env: AgentEnvConfig = field(default_factory=RLMEnvConfig)
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)

    def check_recipe(self, errors: list[str]) -> None:
        check_data_env_names(errors, self)
        if self.algorithm.adv_estimator == "gae":
            errors.append("recipes.rlm has no critic: algorithm.adv_estimator must not be gae")
        if self.async_rl.on_weight_update == "abort":
            errors.append(
                "recipes.rlm: async_rl.on_weight_update=abort would cut agent turns short; use partial (a turn "
                "in flight finishes on the new weights, its tokens tagged by version)"
            )


@dataclass
class HybridWeightsConfig:
    w_rl: float = 1.0  # weight of the RL term (GRPO outcome + PRM step advantage)
    w_opd: float = 1.0  # weight of the on-policy distillation term (teacher - old log-prob)
    opd_clip: float | None = 5.0  # bound on |log pi_teacher - log pi_old| per token (None: none)
    use_prm_reward: bool = True  # add the normalised PRM step advantage to the RL term
    hint_template: str = "Hint: {hint}\n"  # what goes between the prompt and the response for the teacher
    # false: the teacher is the plain reference, the hint kept out of its prompt, on the same hinted rows (the
    # ablation "OPD without the hint": recipes/compare_hybrid.py --arms opd_no_hint)
    teacher_reads_hint: bool = True
    # the OPD teacher's HF directory (same tokenizer as the policy), e.g. a model trained longer on hinted
    # demonstrations; null: the reference model (the policy's start). The reference role loads it, so no KL term
    # may use the reference at the same time
    teacher_path: str | None = None
    # warm start: this fraction of the rows also shown as [prompt + judge's hint + correct solution], so the
    # reference (the teacher) learns to use a hint (recipes/trainer/hybrid.py: hinted_demonstrations)
    hinted_demos: float = 0.0

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        if self.w_rl < 0 or self.w_opd < 0:
            errors.append(f"hybrid.w_rl and hybrid.w_opd must be >= 0, got {self.w_rl}, {self.w_opd}")
        if self.opd_clip is not None and self.opd_clip <= 0:
            errors.append(f"hybrid.opd_clip must be > 0 or null, got {self.opd_clip}")
        if "{hint}" not in self.hint_template:
            errors.append(f"hybrid.hint_template must contain {{hint}}, got {self.hint_template!r}")
        if not 0.0 <= self.hinted_demos <= 1.0:
            errors.append(f"hybrid.hinted_demos must be in [0, 1], got {self.hinted_demos}")
        if self.teacher_path is not None:
            self._check_teacher(errors, cfg)

    def _check_teacher(self, errors: list[str], cfg: RecipeConfig) -> None:
        assert self.teacher_path is not None  # check calls this only when it is set
        path = os.path.expanduser(self.teacher_path)
        if not os.path.isfile(os.path.join(path, "config.json")):
            errors.append(f"hybrid.teacher_path={self.teacher_path!r} is not a Hugging Face model directory "
                          "(no config.json)")  # fmt: skip
        elif cfg.model.path and os.path.isfile(
            os.path.join(os.path.expanduser(cfg.model.path), "config.json")
        ):
            vocab = [_vocab_size(p) for p in (path, os.path.expanduser(cfg.model.path))]
            if vocab[0] != vocab[1]:
                errors.append(f"hybrid.teacher_path={self.teacher_path!r} has vocab_size {vocab[0]}, the policy "
                              f"(model.path) {vocab[1]}: the teacher scores the policy's tokens, so they must "
                              "share the tokenizer")  # fmt: skip
        if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            errors.append("hybrid.teacher_path: the reference role loads the teacher, so actor.use_kl_loss and "
                          "algorithm.use_kl_in_reward (a KL to the reference) must be false")  # fmt: skip
        if cfg.actor.lora.enabled:
            errors.append("hybrid.teacher_path: with actor.lora the reference is the actor's frozen base, so "
                          "there is no reference role to load a teacher; train without LoRA")  # fmt: skip
        if cfg.algorithm.adv_estimator != "hybrid":
            errors.append(f"hybrid.teacher_path is set, but algorithm.adv_estimator={cfg.algorithm.adv_estimator} "
                          "has no OPD term to use a teacher")  # fmt: skip


def _vocab_size(model_dir: str) -> int | None:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f).get("vocab_size")


@dataclass
class HybridEvalConfig:
    pass_k: list[int] = field(default_factory=lambda: [1, 4])
    temperature: float = 1.0  # sampling temperature of the validation samples

    def check(self, errors: list[str], cfg: RecipeConfig) -> None:
        if not self.pass_k or min(self.pass_k) < 1:
            errors.append(f"eval.pass_k must be a non-empty list of k >= 1, got {self.pass_k}")
        if max(self.pass_k or [1]) > 1 and self.temperature <= 0:
            errors.append(f"eval.pass_k={self.pass_k} needs sampled validation: eval.temperature > 0")


@dataclass
class HybridConfig(GRPOConfig):
    """``recipes/hybrid_rl.py``: math-tool trajectories, PRM step rewards and hints, the hybrid advantage."""

    env: MathToolEnvConfig = field(default_factory=MathToolEnvConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    hybrid: HybridWeightsConfig = field(default_factory=HybridWeightsConfig)
    eval: HybridEvalConfig = field(default_factory=HybridEvalConfig)

    def check_recipe(self, errors: list[str]) -> None:
        est = self.algorithm.adv_estimator
        if est not in ("hybrid", "grpo"):
            errors.append(
                f"algorithm.adv_estimator must be hybrid (the method) or grpo (the baseline), got {est!r}"
            )
        if est == "hybrid" and not self.prm.enable:
            errors.append(
                "algorithm.adv_estimator=hybrid needs prm.enable=true (step scores and hints come from the PRM)"
            )
        if self.prm.max_steps < self.env.agent.max_turns:
            errors.append(
                f"prm.max_steps={self.prm.max_steps} < env.agent.max_turns={self.env.agent.max_turns}: later "
                "steps would get no PRM score"
            )


SCHEMAS: dict[str, type[RecipeConfig]] = {
    "grpo": GRPOConfig,
    "grpo_async": GRPOAsyncConfig,
    "ppo": PPOConfig,
    "quickstart": GRPOConfig,
    "rlm": RLMConfig,
    "hybrid_rl": HybridConfig,
}
