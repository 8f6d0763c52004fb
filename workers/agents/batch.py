"""Agent trajectories -> a training batch (``DataProto``, dataproto/BATCH_LAYOUT.md).

One row per trajectory (roots; children too with ``train_children=True``):

* ``prompts`` [B, P]: the trajectory's initial prompt (system prompt + query, chat template and the
  generation prompt) -- turn 0's prompt tokens -- left-padded with ``pad_token_id``;
* ``responses`` [B, R]: everything after it, in order: the model's turn tokens, and between turns the
  observation segments (end of turn, user observation, next generation prompt) -- right-padded;
* ``response_mask`` [B, R] float32: the loss mask, 1 exactly on the engine's own tokens, 0 on
  observation/template segments and padding;
* ``rollout_log_probs`` [B, R] float32: the engine's log-probs on model tokens, 0 elsewhere;
* ``input_ids``, ``attention_mask`` (1 on every real token, observations included: the model attends
  to them), ``position_ids`` = ``clamp(cumsum(attention_mask) - 1, 0)``.

Truncation: a sequence longer than ``max_prompt_length + max_response_length`` keeps its first
``max_response_length`` response tokens (the cut tail is simply absent, so never trained); with
``mask_truncated=True`` a truncated row's whole loss mask is zeroed (overlong filtering). A prompt
longer than ``max_prompt_length`` cannot be represented faithfully (the kept response was generated
from the full prompt): it keeps its last ``max_prompt_length`` tokens and the row's loss mask is
zeroed. ``non_tensor_batch["truncated"]`` says which rows were cut (``""``, ``"response"``,
``"prompt"``).

Non-tensor columns: ``uid`` (the root's prompt uid, shared by a group's samples and by children),
``traj_id``, ``root_id`` (the root trajectory of the row's tree), ``depth``, ``parent_id`` (``""``
for roots), ``answer`` (this trajectory's final answer, ``""`` if none), ``root_answer``, ``status``,
``num_turns``, ``truncated``, ``trajectory`` (the trajectory as JSON, without its token ids/log-probs,
which are in the tensors) plus any ``extra`` columns the caller passes (one value per trajectory).

Children and advantages: with ``train_children`` the children of a root are rows too and share its
``uid``. They should not be scored and grouped as samples of their own: compute scores/advantages
with children as singleton groups (:func:`advantage_index`), then :func:`inherit_root_advantages`
gives each child its root's (sequence-level) advantage on the child's own loss mask. Without it
children are executed but not rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from dataproto import DataProto
from workers.agents.trajectory import Trajectory

__all__ = [
    "OWN_COLUMNS",
    "advantage_index",
    "inherit_root_advantages",
    "is_root",
    "select_rows",
    "trajectory_json",
    "trajectories_to_dataproto",
]

TENSOR_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
)

# The non-tensor columns trajectories_to_dataproto writes (an input column of the same name is not copied).
OWN_COLUMNS = frozenset(
    ("uid", "traj_id", "root_id", "depth", "parent_id", "answer", "root_answer", "status", "num_turns")
    + ("truncated", "trajectory")
)


def trajectory_json(traj: Trajectory, tokens: bool = False) -> str:
    """The trajectory as one JSON line; without token ids and log-probs unless ``tokens``."""
    d = traj.to_dict()
    if not tokens:
        for t in d["turns"]:
            for k in ("prompt_token_ids", "response_token_ids", "response_logprobs"):
                t.pop(k, None)
    return json.dumps(d, ensure_ascii=False, default=str)


def select_rows(trajectories: Sequence[Trajectory], train_children: bool) -> list[int]:
    """Indices of the trajectories that become rows: all with ``train_children``, else the roots."""
    return [i for i, t in enumerate(trajectories) if train_children or t.depth == 0]


def _root_of(traj: Trajectory) -> str:
    return traj.id.split("/", 1)[0]


def trajectories_to_dataproto(
    trajectories: Sequence[Trajectory],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int,
    train_children: bool = False,
    mask_truncated: bool = False,
    extra: Mapping[str, Sequence] | None = None,
    meta_info: Mapping | None = None,
    include_json: bool = True,
) -> DataProto:
    """Rows for ``trajectories`` (in order; children dropped unless ``train_children``), tensors padded
    to exactly ``[B, max_prompt_length]`` / ``[B, max_response_length]`` so batches from several workers
    concatenate. ``extra``: more non-tensor columns, one value per entry of ``trajectories``."""
    if max_prompt_length < 1 or max_response_length < 1:
        raise ValueError("max_prompt_length and max_response_length must be >= 1")
    extra = dict(extra or {})
    for k, v in extra.items():
        if len(v) != len(trajectories):
            raise ValueError(f"extra column {k!r} has {len(v)} values for {len(trajectories)} trajectories")
    rows = select_rows(trajectories, train_children)
    answers = {t.id: t.final_answer for t in trajectories if t.depth == 0}
    P, R, B = max_prompt_length, max_response_length, len(rows)
    prompts = torch.full((B, P), pad_token_id, dtype=torch.long)
    responses = torch.full((B, R), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    resp_attn = torch.zeros(B, R, dtype=torch.long)
    loss_mask = torch.zeros(B, R, dtype=torch.float32)
    logps = torch.zeros(B, R, dtype=torch.float32)
    truncated: list[str] = []
    for b, i in enumerate(rows):
        traj = trajectories[i]
        ids, mask, lps = traj.token_sequence()
        n_prompt = len(traj.turns[0].prompt_token_ids) if traj.turns else 0
        p_ids = ids[:n_prompt]
        r_ids, r_mask, r_lps = ids[n_prompt:], mask[n_prompt:], lps[n_prompt:]
        cut = ""
        if len(p_ids) > P:
            p_ids, cut = p_ids[-P:], "prompt"
        if len(r_ids) > R:
            r_ids, r_mask, r_lps = r_ids[:R], r_mask[:R], r_lps[:R]
            cut = cut or "response"
        if p_ids:
            prompts[b, P - len(p_ids) :] = torch.tensor(p_ids, dtype=torch.long)
            prompt_mask[b, P - len(p_ids) :] = 1
        if r_ids:
            n = len(r_ids)
            responses[b, :n] = torch.tensor(r_ids, dtype=torch.long)
            resp_attn[b, :n] = 1
            loss_mask[b, :n] = torch.tensor(r_mask, dtype=torch.float32)
            logps[b, :n] = torch.tensor(r_lps, dtype=torch.float32)
        if cut == "prompt" or (cut and mask_truncated):
            loss_mask[b] = 0.0
        logps[b] *= loss_mask[b]
        truncated.append(cut)
    attention_mask = torch.cat([prompt_mask, resp_attn], dim=1)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "response_mask": loss_mask,
        "rollout_log_probs": logps,
    }
    sel = [trajectories[i] for i in rows]
    non_tensor: dict[str, list] = {
        "uid": [t.root_uid for t in sel],
        "traj_id": [t.id for t in sel],
        "root_id": [_root_of(t) for t in sel],
        "depth": [int(t.depth) for t in sel],
        "parent_id": [t.parent_id or "" for t in sel],
        "answer": [t.final_answer if t.final_answer is not None else "" for t in sel],
        "root_answer": [answers.get(_root_of(t)) or "" for t in sel],
        "status": [t.status for t in sel],
        "num_turns": [len(t.turns) for t in sel],
        "truncated": truncated,
    }
    if include_json:
        non_tensor["trajectory"] = [trajectory_json(t) for t in sel]
    for k, v in extra.items():
        if k in non_tensor:
            raise ValueError(f"extra column {k!r} clashes with a column trajectories_to_dataproto writes")
        non_tensor[k] = [v[i] for i in rows]
    arrays = {}
    for k, v in non_tensor.items():
        a = np.empty(len(v), dtype=object)
        a[:] = v if len(v) else []
        arrays[k] = a
    return DataProto(batch=batch, non_tensor_batch=arrays, meta_info=dict(meta_info or {}))


# --------------------------------------------------------------------------------------------------
# Children in the training batch


def is_root(data: DataProto) -> np.ndarray:
    """Boolean row mask of root trajectories (depth 0)."""
    return np.asarray([int(d) == 0 for d in data.non_tensor_batch["depth"]], dtype=bool)


def advantage_index(data: DataProto) -> np.ndarray:
    """Group ids for an advantage estimator: the ``uid`` for roots (a GRPO group = the n samples of a
    prompt) and a group of its own for every child, so children do not distort their root's group
    statistics; their advantages come from :func:`inherit_root_advantages` afterwards."""
    uids = data.non_tensor_batch["uid"]
    ids = data.non_tensor_batch["traj_id"]
    roots = is_root(data)
    out = np.empty(len(data), dtype=object)
    out[:] = [u if r else f"child:{t}" for u, t, r in zip(uids, ids, roots)]
    return out


def inherit_root_advantages(data: DataProto, keys: Sequence[str] = ("advantages", "returns")) -> DataProto:
    """Give every child row its root's advantage: the root's mean advantage over its loss mask (the
    sequence-level value for outcome estimators such as GRPO/RLOO), times the child's own loss mask.
    Children whose root is not in the batch get 0. In place; returns ``data``."""
    ids = list(data.non_tensor_batch["traj_id"])
    roots = list(data.non_tensor_batch["root_id"])
    depth = [int(d) for d in data.non_tensor_batch["depth"]]
    row_of = {tid: i for i, (tid, d) in enumerate(zip(ids, depth)) if d == 0}
    mask = data.batch["response_mask"]
    for key in keys:
        if key not in data.batch:
            continue
        values = data.batch[key]
        for i, (d, root) in enumerate(zip(depth, roots)):
            if d == 0:
                continue
            r = row_of.get(root)
            if r is None:
                values[i] = 0.0
                continue
            m = mask[r]
            scalar = (values[r] * m).sum() / m.sum().clamp(min=1.0)
            values[i] = scalar * mask[i]
    return data
