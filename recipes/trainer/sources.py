"""Rows that take their advantage from another row: step-wise turns from their trajectory, RLM children from
their root (``workers/agents/batch.py``: the ``row_id`` / ``advantage_source`` columns).

Only source rows (``advantage_source == row_id``) are samples of the estimator's ``uid`` groups; the estimator
runs on them alone, and every row then gets its source's sequence-level advantage and return on its own loss
mask. This needs an outcome estimator (one advantage per sequence: GRPO, RLOO, REINFORCE++-baseline); one with
token-level advantages (GAE, REINFORCE++) is refused, as there is no single value to hand on. A batch without
the columns (single-turn rollouts) is its own source, row by row.
"""

from __future__ import annotations

import numpy as np
import torch

from algorithms import run_adv_estimator
from dataproto import DataProto

__all__ = ["fill_rows", "is_source", "run_estimator_on_sources", "source_index"]


def source_index(data: DataProto) -> np.ndarray:
    """For each row, the index of the row whose advantage it takes (itself for a source row)."""
    nt = data.non_tensor_batch
    if "advantage_source" not in nt:
        return np.arange(len(data))
    ids = list(nt["row_id"])
    row_of = {rid: i for i, rid in enumerate(ids)}
    if len(row_of) != len(ids):
        dup = sorted({rid for rid in ids if ids.count(rid) > 1})[:3]
        raise ValueError(f"the batch's row_id column repeats {dup}: each row needs its own id")
    missing = sorted({s for s in nt["advantage_source"] if s not in row_of})
    if missing:
        raise KeyError(f"advantage_source names rows that are not in the batch: {missing[:3]}")
    return np.asarray([row_of[s] for s in nt["advantage_source"]], dtype=np.int64)


def is_source(data: DataProto) -> np.ndarray:
    """Boolean row mask of the rows that are samples of their group (one per trajectory tree)."""
    return source_index(data) == np.arange(len(data))


def run_estimator_on_sources(
    data: DataProto, adv_estimator: str, **inputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, R] from ``data.batch["token_level_rewards"]``: the estimator on the source
    rows (grouped by ``uid``), each row then given its source's value on its own ``response_mask``.
    ``inputs``: the estimator's other arguments (``values`` [B, R] is narrowed to the source rows like the
    rewards)."""
    b = data.batch
    mask = b["response_mask"]
    src = source_index(data)
    if (src == np.arange(len(data))).all():
        return run_adv_estimator(
            adv_estimator,
            token_level_rewards=b["token_level_rewards"],
            response_mask=mask,
            index=data.non_tensor_batch["uid"],
            **inputs,
        )
    sources = np.flatnonzero(src == np.arange(len(data)))
    rows = torch.as_tensor(sources)
    if inputs.get("values") is not None:
        inputs["values"] = inputs["values"][rows]
    # every position of a source row counts, so the value survives a source whose own loss mask is empty
    adv, ret = run_adv_estimator(
        adv_estimator,
        token_level_rewards=b["token_level_rewards"][rows],
        response_mask=torch.ones_like(mask[rows]),
        index=data.non_tensor_batch["uid"][sources],
        **inputs,
    )
    for name, t in (("advantages", adv), ("returns", ret)):
        spread = (t.max(dim=-1).values - t.min(dim=-1).values).abs().max()
        if float(spread) > 1e-5 * max(1.0, float(t.abs().max())):
            raise ValueError(
                f"algorithm.adv_estimator={adv_estimator!r} gives token-level {name}; rows that take "
                "their advantage from another row (env.step_wise turns, env.train_children children) need an "
                "outcome estimator (grpo, rloo, reinforce_plus_plus_baseline)"
            )
    position = {int(s): k for k, s in enumerate(sources)}
    take = torch.as_tensor([position[int(s)] for s in src])
    m = mask.to(adv.dtype)
    return adv[take, :1] * m, ret[take, :1] * m


def fill_rows(data: DataProto, multiple: int) -> DataProto:
    """``data`` with rows appended until its length is a multiple of ``multiple`` (PPO mini-batches take a
    fixed number of rows; step-wise turns and children make the count vary): copies of leading rows with an
    empty loss mask, so they add no gradient and no token or sequence to the loss normalisation, and no sample
    to any group (they take a source row's advantage, which their empty mask zeroes)."""
    pad = -len(data) % multiple
    if pad == 0 or not len(data):
        return data
    if "advantage_source" not in data.non_tensor_batch:
        raise ValueError(
            f"{len(data)} rows are not a multiple of {multiple} rows per PPO mini-batch, and the batch has "
            "no advantage_source column to mark filler rows with"
        )
    extra = data.select_idxs(np.arange(pad) % len(data))
    for key in ("response_mask", "rollout_log_probs"):
        if key in extra.batch:
            extra.batch[key] = torch.zeros_like(extra.batch[key])
    ids = extra.non_tensor_batch["row_id"]
    extra.non_tensor_batch["row_id"] = np.asarray([f"{r}#fill{k}" for k, r in enumerate(ids)], dtype=object)
    return DataProto.concat([data, extra])
