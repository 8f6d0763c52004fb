"""Agent trajectories -> a training batch (``DataProto``, dataproto/BATCH_LAYOUT.md).

Two layouts (``step_wise``), both with rows for the roots, and for children too with ``train_children=True``:

* one row per trajectory (default): ``prompts`` holds its initial prompt (system prompt + query, chat
  template and the generation prompt -- turn 0's prompt tokens), ``responses`` everything after it in order:
  the model's turn tokens and, between turns, the observation segments (end of turn, user observation, next
  generation prompt), which are attended to but carry loss mask 0;
* step-wise, one row per model turn: ``prompts`` holds the exact token prefix the engine saw for that turn
  (initial prompt, earlier turns and observations), ``responses`` that turn's tokens only. The length limits
  then apply per turn, so a trajectory of many turns fits under the same ``max_prompt_length`` +
  ``max_response_length`` that one row per trajectory would have to cut.

A trajectory whose chat template rewrote its history (``Trajectory.rewritten``: a turn was fed a whole new
prompt, ``TrajectoryTurn.full_prompt``) is no single growing sequence: it trains step-wise whatever the layout
(``split_rewritten``; each row's prompt is exactly the prompt the engine was fed for that turn), and where one row
per trajectory is wanted (validation) its row is its last segment. ``meta_info["rewritten_trajectories"]``
counts them.

Tensors (built by `workers.rollout.batch.build_rollout_batch`, the one rollout-batch builder): ``prompts`` [B, P]
left-padded with ``pad_token_id``; ``responses`` [B, R] right-padded;
``response_mask`` [B, R] float32, the loss mask, 1 exactly on the engine's own tokens; ``rollout_log_probs``
[B, R] float32, the engine's log-probs on model tokens, 0 elsewhere; ``rollout_versions`` [B, R] int64, the
weight version that sampled each model token (asynchronous RL), 0 elsewhere; ``rollout_aborted`` [B], all False
(a failed turn fails its trajectory); ``input_ids``, ``attention_mask`` (1 on every real token),
``position_ids`` = ``clamp(cumsum(attention_mask) - 1, 0)``.

Truncation: a response longer than ``max_response_length`` keeps its first R tokens (the cut tail is simply
absent, so never trained); with ``mask_truncated=True`` such a row's whole loss mask is zeroed (overlong
filtering). A prompt longer than ``max_prompt_length`` cannot be represented faithfully (the kept response was
generated from the full prompt): it keeps its last P tokens and the row's loss mask is zeroed. Step-wise, a
turn whose prefix is longer than P is dropped instead (``meta_info["dropped_turns"]`` counts them); only when
no turn of a trajectory fits does it keep one such masked row (its last turn), so that the trajectory still
counts in its group. ``non_tensor_batch["truncated"]`` says which rows were cut (``""``, ``"response"``,
``"prompt"``).

Advantage sources: ``row_id`` names each row (the trajectory id; step-wise ``<trajectory id>@<turn>``) and
``advantage_source`` the row whose advantage it takes. A source row (``advantage_source == row_id``) is one
sample of its ``uid`` group in the advantage estimator's statistics; every other row is left out of them and
inherits its source's advantage and returns on its own loss mask (``recipes/trainer/sources.py``). The source
of every row of a tree is its root trajectory's last row: step-wise turns take the advantage of their
trajectory, and children (which share their root's ``uid`` and are scored on their own answer) take their
root's, never acting as extra samples of the group.

Failures and drops: a trajectory whose environment failed (status ``"error"`` without
``metadata["policy_error"]``: its sandbox died, the engine or the code around it failed -- nothing the policy
did) trains nothing: its rows' loss masks are zeroed. A root's row stays (it is a sample of its group, with
the reward its answer gets); a child row with nothing to train -- such a child's, one that never reached a
turn, one masked by the length limits above -- is dropped (``meta_info["dropped_children"]`` counts the child
trajectories left without a row). Every other child -- finished, out of turns or budget, or ended by its own
errors (``max_errors``) -- takes its root's advantage on the tokens it produced that fit its row.

Non-tensor columns: ``uid`` (the root's prompt uid, shared by a group's samples and by children), ``row_id``,
``advantage_source``, ``traj_id``, ``turn`` (the turn of a step-wise row, -1 for a whole trajectory),
``root_id`` (the root trajectory of the row's tree), ``depth``, ``parent_id`` (``""`` for roots), ``answer``
(this trajectory's final answer, ``""`` if none), ``root_answer``, ``status``, ``error`` (the trajectory's
error, ``""`` if none), ``num_turns``, ``truncated``, ``trajectory`` (the trajectory as JSON, without its
token ids/log-probs, which are in the tensors) plus any ``extra`` columns the caller passes (one value per
trajectory, repeated on each of its rows).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dataproto import DataProto
from workers.agents.trajectory import Trajectory
from workers.rollout.batch import RolloutRow, build_rollout_batch

if TYPE_CHECKING:
    import torch

__all__ = [
    "OWN_COLUMNS",
    "row_extent",
    "select_rows",
    "trajectory_json",
    "trajectories_to_dataproto",
]

# The non-tensor columns trajectories_to_dataproto writes (an input column of the same name is not copied).
OWN_COLUMNS = frozenset(
    ("uid", "row_id", "advantage_source", "traj_id", "turn", "root_id", "depth", "parent_id", "answer")
    + ("root_answer", "status", "error", "num_turns", "truncated", "trajectory")
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


@dataclass
class _Row:
    """One training row before padding: a whole trajectory (``turn`` -1) or one of its turns."""

    source: int  # index into the trajectories
    turn: int
    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]  # per response token: the weight version that sampled it (0 on observations)
    # mixture of experts: expert routes of the row's positions from its first prompt token (the row's last call
    # covered them all: its prompt was everything before its response); None where the engine gave none
    routes: torch.Tensor | None = None

    def row_id(self, traj: Trajectory) -> str:
        return traj.id if self.turn < 0 else f"{traj.id}@{self.turn}"

    def fit(self, P: int, R: int, mask_truncated: bool, trains: bool) -> tuple[_Row, str]:
        """The row cut to the limits (its prompt's last ``P`` tokens, its response's first ``R``) and what was
        cut (``""``, ``"prompt"``, ``"response"``); its loss mask is zeroed when the prompt was cut, when the
        response was with ``mask_truncated``, or when the trajectory ``trains`` nothing."""
        prompt, response, mask, lps, cut = self.prompt, self.response, self.mask, self.logprobs, ""
        versions, routes = self.versions, self.routes
        if len(prompt) > P:
            routes = routes[len(prompt) - P :] if routes is not None else None
            prompt, cut = prompt[-P:], "prompt"
        if len(response) > R:
            response, mask, lps, versions = response[:R], mask[:R], lps[:R], versions[:R]
            routes = routes[: len(prompt) + R] if routes is not None else None
            cut = cut or "response"
        if cut == "prompt" or (cut and mask_truncated) or not trains:
            mask = [0] * len(mask)
        return _Row(self.source, self.turn, prompt, response, mask, lps, versions, routes), cut


def _environment_failed(traj: Trajectory) -> bool:
    """Status "error" not of the policy's doing (a dead sandbox, a failed engine, a bug): nothing to train."""
    return traj.status == "error" and not traj.metadata.get("policy_error")


def _turn_versions(turn) -> list[int]:
    """The weight version of each response token of ``turn`` (0 where the engine recorded none)."""
    v = list(turn.response_versions)
    return v + [0] * (len(turn.response_token_ids) - len(v))


def _whole_row(i: int, traj: Trajectory) -> _Row:
    """The trajectory as one row (its last segment, when the template rewrote its history)."""
    ids, mask, lps = traj.token_sequence()
    turns = traj.turns[traj.segment_start() :]
    n = len(turns[0].prompt_token_ids) if turns else 0
    versions: list[int] = []  # aligned with ids[n:]: each turn's observation (0s), then its response
    for k, t in enumerate(turns):
        versions += [0] * (len(t.prompt_token_ids) if k else 0) + _turn_versions(t)
    return _Row(
        i, -1, ids[:n], ids[n:], mask[n:], lps[n:], versions, _routes_of(turns[-1] if turns else None, ids)
    )


def _routes_of(turn, row_ids: list[int]) -> torch.Tensor | None:
    """The expert routes of a row whose last call is ``turn``: the call's routes cover its whole prompt and its
    response but the last token, so they are the row's when that prompt was the row's tokens before the call's
    response -- checked by finding the response where the routes say it starts; None otherwise."""
    routes = turn.routes if turn is not None else None
    if routes is None:
        return None
    response = list(turn.response_token_ids)
    start = len(routes) + 1 - len(response)
    return routes if start >= 0 and row_ids[start : start + len(response)] == response else None


def _turn_rows(i: int, traj: Trajectory, max_prompt_length: int) -> tuple[list[_Row], int]:
    """One row per turn whose prefix fits in ``max_prompt_length``, and the number of turns that did not."""
    if not traj.turns:  # it failed before its first turn: an empty row, so it still counts in its group
        return [_whole_row(i, traj)], 0
    rows: list[_Row] = []
    cut: list[_Row] = []
    prefix: list[int] = []
    for t in traj.turns:
        prefix = list(t.prompt_token_ids) if t.full_prompt else prefix + t.prompt_token_ids
        lps = list(t.response_logprobs)
        row = _Row(
            i,
            t.index,
            list(prefix),
            list(t.response_token_ids),
            [1] * len(t.response_token_ids),
            lps + [0.0] * (len(t.response_token_ids) - len(lps)),
            _turn_versions(t),
            _routes_of(t, prefix + list(t.response_token_ids)),
        )
        (rows if len(prefix) <= max_prompt_length else cut).append(row)
        prefix += t.response_token_ids
    # not even the first turn fits: one masked row (packing cuts its prompt) stands for the trajectory
    return rows or cut[-1:], len(cut)


def _row_specs(
    trajectories: Sequence[Trajectory], P: int, train_children: bool, step_wise: bool, split_rewritten: bool
) -> tuple[list[_Row], int]:
    """The rows before fitting to the limits, and the number of turns dropped (prefix longer than ``P``)."""
    specs: list[_Row] = []
    dropped = 0
    for i in select_rows(trajectories, train_children):
        if step_wise or (split_rewritten and trajectories[i].rewritten):
            rows, n_dropped = _turn_rows(i, trajectories[i], P)
            specs += rows
            dropped += n_dropped
        else:
            specs.append(_whole_row(i, trajectories[i]))
    return specs, dropped


def row_extent(trajectories: Sequence[Trajectory], **layout) -> tuple[int, int]:
    """The longest prompt and response of the rows ``trajectories_to_dataproto(trajectories, **layout)`` makes,
    nothing cut: the widths an SFT batch needs."""
    specs, _ = _row_specs(
        trajectories,
        2**62,
        layout.get("train_children", False),
        layout.get("step_wise", False),
        layout.get("split_rewritten", True),
    )
    return max((len(r.prompt) for r in specs), default=1), max((len(r.response) for r in specs), default=1)


def trajectories_to_dataproto(
    trajectories: Sequence[Trajectory],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int,
    train_children: bool = False,
    step_wise: bool = False,
    mask_truncated: bool = False,
    extra: Mapping[str, Sequence] | None = None,
    meta_info: Mapping | None = None,
    include_json: bool = True,
    split_rewritten: bool = True,
) -> DataProto:
    """Rows for ``trajectories`` (in order, a trajectory's turns in order; children dropped unless
    ``train_children``; one row per turn with ``step_wise``, and for a ``rewritten`` trajectory with
    ``split_rewritten`` -- else its last segment is its row), tensors padded to exactly
    ``[B, max_prompt_length]`` / ``[B, max_response_length]`` so batches from several workers concatenate.
    ``extra``: more non-tensor columns, one value per entry of ``trajectories``."""
    if max_prompt_length < 1 or max_response_length < 1:
        raise ValueError("max_prompt_length and max_response_length must be >= 1")
    extra = dict(extra or {})
    for k, v in extra.items():
        if len(v) != len(trajectories):
            raise ValueError(f"extra column {k!r} has {len(v)} values for {len(trajectories)} trajectories")
    P, R = max_prompt_length, max_response_length
    specs, dropped = _row_specs(trajectories, P, train_children, step_wise, split_rewritten)
    fitted = [
        row.fit(P, R, mask_truncated, not _environment_failed(trajectories[row.source])) for row in specs
    ]
    # a child row that trains nothing is dropped; a root's row is a sample of its group, so it stays
    kept = [(row, cut) for row, cut in fitted if trajectories[row.source].depth == 0 or any(row.mask)]
    children = {i for i in select_rows(trajectories, train_children) if trajectories[i].depth > 0}
    dropped_children = len(children - {row.source for row, _ in kept})
    specs = [row for row, _ in kept]
    truncated = [cut for _, cut in kept]
    # every row of a tree takes the advantage of its root's last row
    source_of_root = {
        trajectories[r.source].id: r.row_id(trajectories[r.source])
        for r in specs
        if trajectories[r.source].depth == 0
    }
    answers = {t.id: t.final_answer for t in trajectories if t.depth == 0}
    rows = [
        RolloutRow(
            r.prompt, r.response, loss_mask=r.mask, log_probs=r.logprobs, versions=r.versions, routes=r.routes
        )
        for r in specs
    ]
    # a failed turn fails its trajectory instead of aborting a row: rollout_aborted is all False
    batch = build_rollout_batch(rows, pad_token_id=pad_token_id, prompt_length=P, response_length=R)
    sel = [trajectories[r.source] for r in specs]
    missing = sorted({_root_of(t) for t in sel} - set(source_of_root))
    if missing:
        raise ValueError(f"child trajectories without their root trajectory among the rows: roots {missing}")
    json_of = {i: trajectory_json(trajectories[i]) for i in {r.source for r in specs}} if include_json else {}
    non_tensor: dict[str, list] = {
        "uid": [t.root_uid for t in sel],
        "row_id": [r.row_id(t) for r, t in zip(specs, sel)],
        "advantage_source": [source_of_root[_root_of(t)] for t in sel],
        "traj_id": [t.id for t in sel],
        "turn": [r.turn for r in specs],
        "root_id": [_root_of(t) for t in sel],
        "depth": [int(t.depth) for t in sel],
        "parent_id": [t.parent_id or "" for t in sel],
        "answer": [t.final_answer if t.final_answer is not None else "" for t in sel],
        "root_answer": [answers.get(_root_of(t)) or "" for t in sel],
        "status": [t.status for t in sel],
        "error": [t.error or "" for t in sel],
        "num_turns": [len(t.turns) for t in sel],
        "truncated": truncated,
    }
    if include_json:
        non_tensor["trajectory"] = [json_of[r.source] for r in specs]
    for k, v in extra.items():
        if k in non_tensor:
            raise ValueError(f"extra column {k!r} clashes with a column trajectories_to_dataproto writes")
        non_tensor[k] = [v[r.source] for r in specs]
    arrays = {}
    for k, v in non_tensor.items():
        a = np.empty(len(v), dtype=object)
        a[:] = v if len(v) else []
        arrays[k] = a
    meta = dict(meta_info or {})
    if step_wise or dropped:
        meta["dropped_turns"] = dropped
    meta["rewritten_trajectories"] = sum(trajectories[i].rewritten for i in select_rows(trajectories, True))
    if train_children:
        meta["dropped_children"] = dropped_children
    return DataProto(batch=batch, non_tensor_batch=arrays, meta_info=meta)
