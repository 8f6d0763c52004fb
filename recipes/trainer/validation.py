"""Validation on the held-out prompts: one generate -> score -> collect loop, and the validators built on it.

* ``greedy_accuracy`` (every recipe's default): greedy (or ``rollout.val_*`` sampled) generation, scored by the
  reward worker: ``val/accuracy``, ``val-core/<data_source>/acc``, ``val/response_length/mean``,
  ``val/num_samples``.
* ``PassAtK``: ``max(ks)`` samples per held-out problem at a temperature: ``val/pass@k`` for each k (unbiased
  estimator), ``val/accuracy`` (mean sample score), ``val/num_problems``.

Both add the environment's own metrics of the validation rollouts as ``val-<name>`` (``val-env/*`` for the RLM
env, ``val-tool/*`` for the tool env): what the generation reported besides the engine's counters. With several
environments in one run (``env.loop: mixed``, whose metrics are ``env/<env_name>/...``) that is
``val-env/<env_name>/...``, and both add ``val-env/<env_name>/accuracy``: the mean score of that environment's
samples (the generation's ``env_name`` column).
A validator is ``(roles, batches, cfg) -> metrics``; ``Session`` decides when it runs (``should_validate``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import comb

import numpy as np

from dataproto import DataProto
from recipes.sections import RecipeConfig
from recipes.trainer.metrics import validation_metrics
from recipes.trainer.roles import Roles, metrics_of

__all__ = [
    "PassAtK",
    "Validator",
    "ValRollouts",
    "greedy_accuracy",
    "pass_at_k",
    "print_accuracy_change",
    "val_meta",
    "val_rollouts",
]

Validator = Callable[[Roles, list[DataProto], RecipeConfig], dict[str, float]]

# metric groups every generation reports (engine counters, its wall time); the rest is the environment's
ENGINE_GROUPS = ("rollout/", "timing_s/")
# validation's seed: rollout.seed * 2**32 + 2**31, away from the training steps' (+ step * SEED_STRIDE)
VAL_SEED_OFFSET = 2**31


@dataclass
class ValRollouts:
    """Per sample: score, data source, response length, prompt uid; the env metrics averaged over batches."""

    scores: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    lengths: list[float] = field(default_factory=list)
    uids: list[str] = field(default_factory=list)
    env: dict[str, float] = field(default_factory=dict)
    env_names: list[str] = field(default_factory=list)  # the environment that ran each sample ("": unnamed)

    def env_accuracy(self) -> dict[str, float]:
        """``val-env/<env_name>/accuracy``: the mean score of each named environment's samples."""
        by_env: dict[str, list[float]] = {}
        for name, score in zip(self.env_names, self.scores):
            if name:
                by_env.setdefault(name, []).append(score)
        return {f"val-env/{name}/accuracy": float(np.mean(s)) for name, s in sorted(by_env.items())}


def val_rollouts(roles: Roles, batches: Sequence[DataProto], meta: dict) -> ValRollouts:
    """Generate on every held-out batch with the sampling settings ``meta`` and score each sample."""
    out_all, env = ValRollouts(), []
    for prompts in batches:  # a shallow copy: generate writes the settings into meta_info
        out = roles.generate(
            DataProto(prompts.batch, dict(prompts.non_tensor_batch), dict(prompts.meta_info)), meta
        )
        env.append({k: v for k, v in metrics_of(out).items() if not k.startswith(ENGINE_GROUPS)})
        out_all.scores += roles.reward.compute_rm_score(out).batch["token_level_scores"].sum(-1).tolist()
        out_all.sources += list(out.non_tensor_batch["data_source"])
        out_all.lengths += out.batch["response_mask"].sum(-1).tolist()
        out_all.uids += [str(u) for u in out.non_tensor_batch["uid"]]
        names = out.non_tensor_batch.get("env_name", [""] * len(out))
        out_all.env_names += [n if isinstance(n, str) else "" for n in names]
    for k in dict.fromkeys(k for e in env for k in e):
        out_all.env["val-" + k] = float(np.mean([e[k] for e in env if k in e]))
    return out_all


def val_meta(cfg: RecipeConfig) -> dict:
    """Sampling settings of ``greedy_accuracy``: greedy, or ``rollout.val_n`` samples at ``val_temperature``."""
    r = cfg.rollout
    greedy = r.val_temperature == 0
    return {
        "n": 1 if greedy else r.val_n,
        "do_sample": not greedy,
        "validate": True,
        "temperature": r.val_temperature if not greedy else 1.0,
        "response_length": r.response_length,
        "seed": r.seed * 2**32 + VAL_SEED_OFFSET,
    }


def greedy_accuracy(roles: Roles, batches: list[DataProto], cfg: RecipeConfig) -> dict[str, float]:
    v = val_rollouts(roles, batches, val_meta(cfg))
    return validation_metrics(v.scores, v.sources, v.lengths) | v.env | v.env_accuracy()


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class PassAtK:
    """``max(ks)`` samples per held-out problem at ``temperature`` (greedy when 0); a sample is correct when
    its score is >= 1."""

    ks: Sequence[int]
    temperature: float = 1.0

    def __call__(self, roles: Roles, batches: list[DataProto], cfg: RecipeConfig) -> dict[str, float]:
        ks, t = sorted(set(self.ks)), self.temperature
        meta = {"n": max(ks), "do_sample": t > 0, "validate": True, "temperature": t if t > 0 else 1.0}
        meta["seed"] = cfg.rollout.seed * 2**32 + VAL_SEED_OFFSET
        v = val_rollouts(roles, batches, meta)
        correct: dict[str, list[float]] = {}
        for uid, score in zip(v.uids, v.scores):
            correct.setdefault(uid, []).append(score)
        m = {
            "val/accuracy": float(np.mean(v.scores)) if v.scores else float("nan"),
            "val/num_problems": float(len(correct)),
        }
        for k in ks:
            hits = [pass_at_k(len(s), sum(x >= 1.0 for x in s), k) for s in correct.values() if len(s) >= k]
            m[f"val/pass@{k}"] = float(np.mean(hits)) if hits else float("nan")
        return m | v.env | v.env_accuracy()


def print_accuracy_change(val_history: list[tuple[int, dict]], what: str) -> tuple[float, float]:
    """Print ``<what> before -> after`` (``val/accuracy`` of the first and the last validation, with the number
    of held-out samples and their steps); returns (before, after), NaN when no validation ran."""
    if not val_history:
        print("no validation ran (trainer.val_before_train=false and trainer.test_freq <= 0)")
        return float("nan"), float("nan")
    (first_step, first), (last_step, last) = val_history[0], val_history[-1]
    before, after = first["val/accuracy"], last["val/accuracy"]
    print(
        f"{what} {before:.2f} -> {after:.2f}  (greedy, {int(last['val/num_samples'])} held-out problems, "
        f"step {first_step} -> step {last_step})"
    )
    return before, after
