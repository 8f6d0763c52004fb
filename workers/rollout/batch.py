"""The one builder of rollout batches: per-row token lists -> the tensors of ``dataproto/BATCH_LAYOUT.md``.

Every producer of a rollout batch goes through `build_rollout_batch`: the engines' ``generate_sequences`` (one
row per sample: `prompt_rows` reads the request, `rollout_dataproto` answers it) and the agent layer (one row per trajectory or per turn, with
observation tokens masked out of the loss). One rule for each column, whoever produced the row:

* ``prompts`` left-padded with the pad id to ``prompt_length`` (default: the longest prompt), ``responses``
  right-padded to ``response_length`` (default: the longest response); a longer row is an error (a caller
  that cuts, cuts before);
* ``attention_mask`` 1 on every real token, prompt and response; ``position_ids`` ``clamp(cumsum - 1, 0)``;
* ``response_mask`` the row's loss mask (default 1 on every response token);
* ``rollout_log_probs`` the engine's log-prob on each token the loss trains on, 0 on padding and on masked
  tokens. **The column is written only when every row reported log-probs**: a missing value is never stood for
  by a 0 (a trainer reading it as the behaviour policy would compute ratios against probability 1); a step
  that needs it and finds it absent stops with an error naming the key (``recipes/trainer/steps.py``);
* ``rollout_versions`` the weight version that sampled each token, 0 where none was recorded;
* ``rollout_aborted`` per row;
* ``routed_experts`` (mixture-of-experts models) ``[B, P + R, MoE layers, top-k]`` int16: the expert ids the
  engine routed each position to, aligned with ``input_ids``, -1 where none was recorded (padding, a row's last
  token, a row that brought none: its routers choose). Written when any row brought routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataproto import DataProto, position_ids
from workers.rollout.sampling import GenerationOutput

__all__ = [
    "RolloutRow",
    "build_rollout_batch",
    "prompt_id_lists",
    "prompt_rows",
    "rollout_dataproto",
    "rows_from_outputs",
]

# tensor keys of a generate_sequences request that the answer rebuilds (the others are repeated and kept)
REBUILT_KEYS = ("prompts", "input_ids", "attention_mask", "position_ids")


@dataclass
class RolloutRow:
    """One row of a rollout batch before padding."""

    prompt: Sequence[int]
    response: Sequence[int]
    loss_mask: Sequence[float] | None = None  # per response token; None: 1 on every one
    log_probs: Sequence[float] | None = None  # per response token; None: the engine reported none
    versions: Sequence[int] | None = None  # per response token (may be shorter: the rest 0); None: all 0
    aborted: bool = False
    # [positions from the prompt's first token (at most prompt + response), MoE layers, top-k]; None: no routes
    routes: torch.Tensor | None = None


def rows_from_outputs(
    prompts: Sequence[Sequence[int]], outputs: Sequence[GenerationOutput]
) -> list[RolloutRow]:
    """One row per engine sample: ``prompts[i]`` (its real tokens, no padding) and ``outputs[i]``."""
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts for {len(outputs)} outputs")
    return [
        RolloutRow(
            p,
            o.token_ids,
            log_probs=o.log_probs,
            versions=o.versions,
            aborted=o.finish_reason == "abort",
            routes=o.routes,
        )
        for p, o in zip(prompts, outputs)
    ]


def _width(name: str, lengths: list[int], width: int | None) -> int:
    longest = max(lengths, default=0)
    if width is None:
        return longest
    if longest > width:
        row = lengths.index(longest)
        raise ValueError(f"row {row} has {longest} {name} tokens, more than {name}_length {width}")
    return width


def build_rollout_batch(
    rows: Sequence[RolloutRow],
    *,
    pad_token_id: int,
    prompt_length: int | None = None,
    response_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """The batch tensors of ``rows`` (CPU; see the module docstring for the rule of each column)."""
    B = len(rows)
    P = _width("prompt", [len(r.prompt) for r in rows], prompt_length)
    R = _width("response", [len(r.response) for r in rows], response_length)
    prompts = torch.full((B, P), pad_token_id, dtype=torch.int64)
    responses = torch.full((B, R), pad_token_id, dtype=torch.int64)
    prompt_mask = torch.zeros(B, P, dtype=torch.int64)
    response_attn = torch.zeros(B, R, dtype=torch.int64)
    loss_mask = torch.zeros(B, R, dtype=torch.float32)
    with_log_probs = all(r.log_probs is not None for r in rows)
    log_probs = torch.zeros(B, R, dtype=torch.float32)
    versions = torch.zeros(B, R, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r.prompt:
            prompts[i, P - len(r.prompt) :] = torch.as_tensor(r.prompt, dtype=torch.int64)
            prompt_mask[i, P - len(r.prompt) :] = 1
        n = len(r.response)
        if not n:
            continue
        responses[i, :n] = torch.as_tensor(r.response, dtype=torch.int64)
        response_attn[i, :n] = 1
        mask = torch.ones(n) if r.loss_mask is None else torch.as_tensor(r.loss_mask, dtype=torch.float32)
        if mask.shape != (n,):
            raise ValueError(f"row {i}: {mask.numel()} loss-mask values for {n} response tokens")
        loss_mask[i, :n] = mask
        if with_log_probs:
            lps = torch.as_tensor(r.log_probs, dtype=torch.float32)
            if lps.shape != (n,):
                raise ValueError(f"row {i}: {lps.numel()} log-probs for {n} response tokens")
            log_probs[i, :n] = torch.where(mask != 0, lps, 0.0)
        if r.versions:
            v = list(r.versions)[:n]
            versions[i, : len(v)] = torch.as_tensor(v, dtype=torch.int64)
    attention_mask = torch.cat([prompt_mask, response_attn], dim=1)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids(attention_mask),
        "response_mask": loss_mask,
        "rollout_versions": versions,
        "rollout_aborted": torch.tensor([r.aborted for r in rows], dtype=torch.bool),
    }
    if with_log_probs:
        batch["rollout_log_probs"] = log_probs
    if any(r.routes is not None for r in rows):
        batch["routed_experts"] = _routes_column(rows, P, R)
    return batch


def _routes_column(rows: Sequence[RolloutRow], P: int, R: int) -> torch.Tensor:
    """The rows' routes aligned with ``input_ids`` [B, P + R, layers, k] (int16, -1 where none)."""
    shapes = {tuple(r.routes.shape[1:]) for r in rows if r.routes is not None}
    if len(shapes) != 1:
        raise ValueError(f"rows bring routes of different [layers, top-k] shapes: {sorted(shapes)}")
    (shape,) = shapes
    out = torch.full((len(rows), P + R, *shape), -1, dtype=torch.int16)
    for i, r in enumerate(rows):
        if r.routes is None:
            continue
        n = min(len(r.routes), len(r.prompt) + len(r.response))
        start = P - len(r.prompt)
        out[i, start : start + n] = r.routes[:n].to(torch.int16)
    return out


def _prompt_ids(prompts: DataProto) -> torch.Tensor:
    key = "input_ids" if "input_ids" in prompts.batch else "prompts"
    if key not in prompts.batch:
        raise KeyError(
            f"generate_sequences needs batch['input_ids'] or batch['prompts'], got {sorted(prompts.batch)}"
        )
    return prompts.batch[key]


def prompt_id_lists(
    prompts: torch.Tensor, attention_mask: torch.Tensor | None = None, pad_token_id: int | None = None
) -> list[list[int]]:
    """Left-padded ``[B, P]`` prompt ids -> one list of real token ids per row.

    With ``attention_mask`` (``[B, P]`` or ``[B, P + R]``; only the first ``P`` columns are used) the
    real tokens are where the mask is 1, so a pad id that also occurs inside a prompt is kept. Without
    it, leading ``pad_token_id`` tokens are stripped.
    """
    if prompts.dim() != 2:
        raise ValueError(f"prompts must be [B, P], got shape {tuple(prompts.shape)}")
    rows = prompts.tolist()
    if attention_mask is not None:
        mask = attention_mask[:, : prompts.shape[1]].bool().tolist()
        ids = [[t for t, m in zip(row, keep) if m] for row, keep in zip(rows, mask)]
    elif pad_token_id is not None:
        ids = []
        for row in rows:
            start = 0
            while start < len(row) and row[start] == pad_token_id:
                start += 1
            ids.append(row[start:])
    else:
        raise ValueError("prompt_id_lists needs an attention_mask or a pad_token_id")
    empty = [i for i, row in enumerate(ids) if not row]
    if empty:
        raise ValueError(f"prompt rows {empty[:8]} have no tokens")
    return ids


def prompt_rows(prompts: DataProto, pad_token_id: int) -> list[list[int]]:
    """Each row's real prompt tokens of a ``generate_sequences`` request (left-padded ``batch['input_ids']``,
    or ``batch['prompts']``, and its ``attention_mask``): `prompt_id_lists`."""
    return prompt_id_lists(_prompt_ids(prompts), prompts.batch.get("attention_mask"), pad_token_id)


def rollout_dataproto(
    prompts: DataProto,
    source: Sequence[int],
    rows: Sequence[Sequence[int]],
    outputs: Sequence[GenerationOutput],
    *,
    pad_token_id: int,
    response_length: int | None,
    meta: dict[str, Any],
) -> DataProto:
    """The answer to a ``generate_sequences`` request: output row ``j`` is the sample ``outputs[j]`` of the
    prompt ``rows[j]`` taken from request row ``source[j]`` (``n`` samples of a prompt: its index ``n`` times,
    interleaved a, a, b, b). The request's other tensors and non-tensor columns are repeated the same way;
    prompts keep the request's width and device."""
    ids = _prompt_ids(prompts)
    index = torch.as_tensor(list(source), dtype=torch.long)
    batch = {
        k: v.index_select(0, index.to(v.device)) for k, v in prompts.batch.items() if k not in REBUILT_KEYS
    }
    tensors = build_rollout_batch(
        rows_from_outputs(rows, outputs),
        pad_token_id=pad_token_id,
        prompt_length=ids.shape[1],
        response_length=response_length,
    )
    batch.update({k: v.to(ids.device) for k, v in tensors.items()})
    np_index = np.asarray(list(source), dtype=np.int64)
    non_tensor = {k: v[np_index] for k, v in prompts.non_tensor_batch.items()}
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
