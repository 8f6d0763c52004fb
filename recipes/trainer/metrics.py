"""Step metrics under verl's names, timers, and validation accuracy.

* ``compute_data_metrics``: ``critic/score/*`` (sequence score), ``critic/rewards/*`` (after any in-reward KL;
  both, with ``train/accuracy`` and ``reward/answered_frac``, over the advantage source rows only: one per
  trajectory tree when step-wise turns or children are rows), ``reward/zero_variance_groups`` (share of prompt
  groups whose samples all scored the same: a group-relative estimator learns nothing from them),
  ``critic/advantages/*``, ``critic/returns/*``, ``critic/values/*`` (PPO), ``response_length/*``
  (incl. ``clip_ratio``: share of responses cut at max length), ``prompt_length/*``, and
  ``training/rollout_logprob_diff_{max,mean}``: |log p_rollout - log p_trainer| of the sampled tokens, the rollout
  engine's log-probs against the trainer's ``old_log_probs`` (near 0 when the engine holds the trainer's weights),
  and ``training/rollout_k3_kl``, the k3 estimate of KL(rollout || trainer) over those tokens.
* ``compute_throughput``: ``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput`` (tokens /
  step time / devices, verl's definition).
* ``timer``: ``with timer("gen", timings): ...`` adds ``timings["gen"]`` seconds -> ``timing_s/gen``.
* ``validation_metrics``: ``val/accuracy`` (mean score over the held-out set) and ``val-core/<data_source>/acc``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from contextlib import contextmanager

import numpy as np
import torch

from dataproto import DataProto
from recipes.trainer.sources import is_source


@contextmanager
def timer(name: str, timings: dict[str, float]):
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def timing_metrics(timings: dict[str, float]) -> dict[str, float]:
    return {f"timing_s/{k}": float(v) for k, v in timings.items()}


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {
        f"{prefix}/mean": float(v.mean()),
        f"{prefix}/max": float(v.max()),
        f"{prefix}/min": float(v.min()),
    }


def _masked_values(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return t[mask.bool()]


def compute_data_metrics(batch: DataProto) -> dict[str, float]:
    b = batch.batch
    mask = b["response_mask"]
    max_resp = mask.shape[-1]
    resp_len = mask.sum(-1).float()
    prompt_len = b["attention_mask"][:, : b["attention_mask"].shape[-1] - max_resp].sum(-1).float()
    out: dict[str, float] = {}
    samples = torch.as_tensor(is_source(batch))  # one row per trajectory tree
    if "token_level_scores" in b:
        scores = b["token_level_scores"].sum(-1)[samples]
        out.update(_stats("critic/score", scores))
        out["train/accuracy"] = float((scores >= 1.0).float().mean())  # sampled responses with full score
        if "uid" in batch.non_tensor_batch:
            flat = zero_variance_groups(batch.non_tensor_batch["uid"][samples.numpy()], scores)
            if flat is not None:
                out["reward/zero_variance_groups"] = flat
    if "answer" in batch.non_tensor_batch:  # RLM trajectories: how many reached FINAL / FINAL_VAR
        out["reward/answered_frac"] = float(
            np.mean([a is not None and a != "" for a in batch.non_tensor_batch["answer"][samples.numpy()]])
        )
    if "reward_error" in batch.non_tensor_batch:  # counted from every row of the batch itself
        out["reward/errors"] = float(sum(bool(e) for e in batch.non_tensor_batch["reward_error"]))
    if "token_level_rewards" in b:
        out.update(_stats("critic/rewards", b["token_level_rewards"].sum(-1)[samples]))
    for key, name in (
        ("advantages", "critic/advantages"),
        ("returns", "critic/returns"),
        ("values", "critic/values"),
    ):
        if key in b:
            out.update(_stats(name, _masked_values(b[key], mask)))
    out.update(_stats("response_length", resp_len))
    out["response_length/clip_ratio"] = float((resp_len >= max_resp).float().mean())
    out.update(_stats("prompt_length", prompt_len))
    if "rollout_log_probs" in b and "old_log_probs" in b:
        log_ratio = _masked_values(b["old_log_probs"] - b["rollout_log_probs"], mask)
        if log_ratio.numel():
            out["training/rollout_logprob_diff_max"] = float(log_ratio.abs().max())
            out["training/rollout_logprob_diff_mean"] = float(log_ratio.abs().mean())
            # k3 estimate of KL(rollout || trainer) over the sampled tokens: r - 1 - log r, r = p_trainer / p_rollout
            out["training/rollout_k3_kl"] = float((log_ratio.exp() - 1 - log_ratio).mean())
    return out


def zero_variance_groups(uids: np.ndarray, scores: torch.Tensor) -> float | None:
    """Share of the prompt groups (samples sharing a ``uid``; groups of two or more) whose samples all got the
    same score; None when no group has two samples (``rollout.n=1``)."""
    groups: dict[object, list[float]] = defaultdict(list)
    for uid, score in zip(uids, scores.tolist(), strict=True):
        groups[uid].append(score)
    sized = [g for g in groups.values() if len(g) > 1]
    if not sized:
        return None
    return sum(max(g) - min(g) <= 1e-6 for g in sized) / len(sized)


def compute_throughput(batch: DataProto, step_seconds: float, n_devices: int) -> dict[str, float]:
    tokens = int(batch.batch["attention_mask"].sum())
    return {
        "perf/total_num_tokens": float(tokens),
        "perf/time_per_step": float(step_seconds),
        "perf/throughput": tokens / max(step_seconds, 1e-9) / max(n_devices, 1),
    }


def validation_metrics(
    scores: Iterable[float], data_sources: Iterable[str], lengths: Iterable[float]
) -> dict:
    scores = np.asarray(list(scores), dtype=np.float64)
    sources = list(data_sources)
    by_source: dict[str, list[float]] = defaultdict(list)
    for s, ds in zip(scores, sources):
        by_source[ds].append(float(s))
    out = {f"val-core/{ds}/acc": float(np.mean(v)) for ds, v in sorted(by_source.items())}
    out["val/accuracy"] = float(scores.mean()) if len(scores) else float("nan")
    out["val/response_length/mean"] = float(np.mean(list(lengths))) if len(scores) else float("nan")
    out["val/num_samples"] = float(len(scores))
    return out
