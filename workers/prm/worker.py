"""PRMWorker: a process reward model over tool trajectories, and the hindsight bridge thoughts.

``score_steps(data)`` (``DP_COMPUTE_PROTO``) reads per row ``non_tensor_batch["steps"]`` (JSON list of
``{"kind", "action", "observation"}``, as ``workers.math_env`` writes it) and the problem (``extra_info
["question"]``, else the last user message of ``raw_prompt``), and returns:

* ``prm_step_scores`` [B, S] float32: the mean of ``votes`` (m) judgements of each step, each parsed from
  ``\\boxed{1}`` / ``\\boxed{-1}`` (unparseable = 0), for the first S = ``max_steps`` steps;
* ``prm_step_mask`` [B, S] float32: 1 on the steps that exist;
* ``non_tensor_batch["hint"]``: the bridge thought (text between ``<hint>`` markers) or "" for "no
  intervention"; asked for rows whose outcome ``token_level_scores.sum(-1)`` is below 1 (``hint_on=
  "failure"``: a correct trajectory needs no hint) or every row (``"always"``) when ``hint`` is on;
* ``meta_info["metrics"]``: ``prm/score/mean``, ``prm/unparseable_frac``, ``prm/hint_frac``,
  ``prm/hint_requested_frac``, ``prm/steps/mean``, ``timing_s/prm``.

The judge (``PRMConfig.scorer``): ``reference`` -- the policy's reference checkpoint (the worker's
``reference_path``), ``checkpoint`` -- ``model_path``, both frozen on the native engine; ``http`` -- an
OpenAI-compatible endpoint (``endpoint``, ``api_model``, ``api_key_env``) -- each a ``ModelJudge`` (the
prompts of ``workers.prm.prompts``); ``rule`` -- ``workers.prm.hindsight.HindsightJudge``, rules that read the
trajectory, the tool's observations, the verifier's result and the ground truth (``reward_model``), standing in
for a strong judge model where none can run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np
import torch

from controller import Dispatch, Inputs, Worker, register
from dataproto import DataProto
from workers.prm.hindsight import HindsightJudge
from workers.prm.prompts import hint_prompt, judge_prompt, parse_hint, parse_vote
from workers.prm.scorers import EngineScorer, HTTPScorer

__all__ = ["ModelJudge", "PRMConfig", "PRMWorker", "build_judge"]

SCORERS = ("reference", "checkpoint", "http", "rule")
# `steps`: the tool env's JSON step records; the problem text comes from extra_info or raw_prompt; the rule
# judge also reads the ground truth (reward_model).
SCORE_STEPS_INPUTS = Inputs(
    non_tensor=("steps",), optional=("extra_info", "raw_prompt", "reward_model", "token_level_scores")
)


@dataclass
class PRMConfig:
    enable: bool = True  # off: the hybrid recipe runs plain GRPO on the tool env (the baseline)
    scorer: str = "reference"  # reference | checkpoint | http | rule (workers.prm.hindsight)
    model_path: str | None = None  # scorer=checkpoint: a Hugging Face directory
    endpoint: str | None = None  # scorer=http: base URL, e.g. http://host:8000/v1
    api_model: str = "default"  # scorer=http: the "model" field of requests
    api_key_env: str | None = None  # scorer=http: environment variable holding the API key
    http_timeout_s: float = 60.0
    placement: str = "separate"  # separate: its own pool | colocated: inside the rollout worker's processes
    votes: int = 3  # m judgements per step
    temperature: float = 1.0  # of the votes
    max_new_tokens: int = 16  # per vote
    max_steps: int = 6  # S: steps judged per trajectory (the width of the step tensors)
    hint: bool = True  # ask for bridge thoughts
    hint_on: str = "failure"  # failure (outcome < 1) | always
    hint_max_new_tokens: int = 48
    hint_temperature: float = 0.7
    max_chars: int = 300  # of each action / observation shown to the judge
    max_num_seqs: int = 64
    seed: int = 0

    def __post_init__(self):
        if self.scorer not in SCORERS:
            raise ValueError(f"prm.scorer must be one of {list(SCORERS)}, got {self.scorer!r}")
        if self.scorer == "checkpoint" and not self.model_path:
            raise ValueError("prm.scorer=checkpoint needs prm.model_path")
        if self.scorer == "http" and not self.endpoint:
            raise ValueError("prm.scorer=http needs prm.endpoint (an OpenAI-compatible base URL)")
        if self.placement not in ("separate", "colocated"):
            raise ValueError(f"prm.placement must be separate or colocated, got {self.placement!r}")
        if self.hint_on not in ("failure", "always"):
            raise ValueError(f"prm.hint_on must be failure or always, got {self.hint_on!r}")
        if self.votes < 1 or self.max_steps < 1 or self.max_new_tokens < 1 or self.hint_max_new_tokens < 1:
            raise ValueError(
                "prm.votes, prm.max_steps, prm.max_new_tokens and prm.hint_max_new_tokens must be >= 1, got "
                f"{self.votes}, {self.max_steps}, {self.max_new_tokens}, {self.hint_max_new_tokens}"
            )


class ModelJudge:
    """A language model as the judge: the PRM prompts (``workers.prm.prompts``) sent to a ``Scorer``, m sampled
    votes per step parsed from ``\\boxed{}``, one sampled hint per asked row."""

    def __init__(self, scorer, config: PRMConfig):
        self.scorer, self.config = scorer, config

    def judge(self, problems, steps, ground_truths, hint_rows, outcomes, seed):
        c = self.config
        prompts, where = [], []
        for i, (problem, row_steps) in enumerate(zip(problems, steps)):
            for k, step in enumerate(row_steps):
                prompts.append(judge_prompt(problem, row_steps[:k], step, c.max_chars))
                where.append((i, k))
        outs = self.scorer.complete(
            prompts, c.votes, max_new_tokens=c.max_new_tokens, temperature=c.temperature, seed=seed
        )
        votes: list[list[list[int]]] = [[[] for _ in s] for s in steps]
        for (i, k), texts in zip(where, outs):
            votes[i][k] = [parse_vote(t) for t in texts]
        hint_texts = self.scorer.complete(
            [
                hint_prompt(problems[i], steps[i], None if outcomes is None else outcomes[i], c.max_chars)
                for i in hint_rows
            ],
            1,
            max_new_tokens=c.hint_max_new_tokens,
            temperature=c.hint_temperature,
            seed=seed + 999_983,
        )
        hints = [""] * len(problems)
        for i, texts in zip(hint_rows, hint_texts):
            hints[i] = texts[0]
        return votes, hints


def build_judge(cfg: PRMConfig, reference_path: str | None, rank: int = 0):
    """The judge ``cfg.scorer`` names: the rule-based hindsight judge, or a model judge on its scorer."""
    if cfg.scorer == "rule":
        return HindsightJudge()
    if cfg.scorer == "http":
        if not cfg.endpoint:
            raise ValueError("prm.scorer=http needs prm.endpoint (the judge's OpenAI-compatible base URL)")
        scorer = HTTPScorer(
            cfg.endpoint, cfg.api_model, api_key_env=cfg.api_key_env, timeout_s=cfg.http_timeout_s
        )
        return ModelJudge(scorer, cfg)
    path = cfg.model_path if cfg.scorer == "checkpoint" else reference_path
    if not path:
        raise ValueError("prm.scorer=reference needs the reference checkpoint path (the policy's model.path)")
    return ModelJudge(
        EngineScorer(path, max_num_seqs=cfg.max_num_seqs, seed=cfg.seed * 1_000_003 + rank), cfg
    )


def _ground_truth(nt: dict, i: int) -> str | None:
    rm = nt["reward_model"][i] if "reward_model" in nt else None
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        return str(rm["ground_truth"])
    return None


def _problem(nt: dict, i: int) -> str:
    extra = nt["extra_info"][i] if "extra_info" in nt else None
    if isinstance(extra, dict) and extra.get("question"):
        return str(extra["question"])
    raw = nt["raw_prompt"][i] if "raw_prompt" in nt else None
    msgs = raw.tolist() if isinstance(raw, np.ndarray) else raw
    for m in reversed(list(msgs or [])):
        if isinstance(m, dict) and m.get("role") == "user":
            return str(m.get("content", ""))
    return ""


class PRMWorker(Worker):
    """The PRM as a role of its own: on its own resource pool, or composed into another pool's processes (e.g.
    beside the rollout role, ``prm.placement=colocated``); the judge is built on first use."""

    def __init__(self, config: PRMConfig, reference_path: str | None = None, scorer=None):
        """``scorer``: an object with ``complete(prompts, n, max_new_tokens=, temperature=, seed=)`` used
        instead of building one (tests); ``reference_path``: the checkpoint of ``prm.scorer=reference``."""
        self.prm_config = config
        self.prm_reference_path = reference_path
        self._prm_judge = None if scorer is None else ModelJudge(scorer, config)
        self.prm_calls = 0

    @property
    def config(self) -> PRMConfig:
        return self.prm_config

    def _judge(self):
        if self._prm_judge is None:
            self._prm_judge = build_judge(self.prm_config, self.prm_reference_path, self.rank)
        return self._prm_judge

    @register(Dispatch.DP_COMPUTE_PROTO, inputs=SCORE_STEPS_INPUTS)
    def score_steps(self, data: DataProto) -> DataProto:
        """Step scores, step mask and hints of every row (module docstring)."""
        t0 = time.perf_counter()
        judge = self._judge()
        tag = self.tag
        nt = data.non_tensor_batch
        c = self.prm_config
        B, S = len(data), c.max_steps
        problems, steps = [], []
        for i in range(B):
            try:
                row_steps = json.loads(nt["steps"][i]) if nt["steps"][i] else []
            except (TypeError, json.JSONDecodeError) as err:
                raise ValueError(f"{tag}: row {i}: steps is not JSON step records: {err}") from None
            problems.append(_problem(nt, i))
            steps.append(row_steps[:S])
        outcome = None
        if "token_level_scores" in data.batch:
            outcome = data.batch["token_level_scores"].sum(-1).tolist()
        hint_rows = [
            i
            for i in range(B)
            if c.hint and steps[i] and (c.hint_on == "always" or outcome is None or outcome[i] < 1.0)
        ]
        seed = c.seed * 2**32 + self.prm_calls * 1_000_003
        self.prm_calls += 1
        truths = [_ground_truth(nt, i) for i in range(B)]
        votes, raw_hints = judge.judge(problems, steps, truths, hint_rows, outcome, seed)
        scores = torch.zeros(B, S, dtype=torch.float32)
        mask = torch.zeros(B, S, dtype=torch.float32)
        unparseable = 0
        for i, row_votes in enumerate(votes):
            for k, v in enumerate(row_votes):
                unparseable += sum(x == 0 for x in v)
                scores[i, k] = sum(v) / len(v)
                mask[i, k] = 1.0
        hints = [parse_hint(h) or "" for h in raw_hints]
        n_steps = float(mask.sum())
        metrics = {
            "prm/score/mean": float(scores.sum() / max(n_steps, 1.0)),
            "prm/unparseable_frac": unparseable / max(sum(len(v) for r in votes for v in r), 1),
            "prm/hint_frac": sum(bool(h) for h in hints) / max(B, 1),
            "prm/hint_requested_frac": len(hint_rows) / max(B, 1),
            "prm/steps/mean": n_steps / max(B, 1),
            "timing_s/prm": time.perf_counter() - t0,
        }
        return DataProto.from_dict(
            {"prm_step_scores": scores, "prm_step_mask": mask},
            non_tensors={
                "hint": hints,
                "prm_hint_raw": raw_hints,
                "prm_votes": [json.dumps(v) for v in votes],
            },
            meta_info={"metrics": metrics},
        )

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self._judge()
