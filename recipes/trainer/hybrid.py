"""The pieces of ``recipes/hybrid_rl.py``: tool-env roles, the PRM role, hint-conditioned teacher log-probs,
and the hybrid advantage with its metrics.

* ``role_options``: ``build_roles``' options -- the agent layer's env role running the tool env
  (``env.loop: math_tool``) beside the rollout role; with ``prm.placement=colocated`` the PRM role
  (``PRMWorker``: ``score_steps``) joins the same processes.
* ``PRMRole``: the PRM on its own resource pool (``prm.placement=separate``) or the role beside the rollout.
* ``add_teacher_hints`` / ``hybrid_advantage``: hints -> ``teacher_hint`` (``hybrid.hint_template``), then
  ``algorithms`` ``hybrid`` with the config's weights; metrics ``hybrid/hint_frac`` (trajectories with a
  hint), ``hybrid/prm_score/mean``, ``hybrid/opd/abs_mean`` (|teacher - old| on hinted rows' policy
  tokens), ``hybrid/opd_term/abs_mean`` (the weighted OPD part of the advantage over all policy tokens),
  ``hybrid/prm_adv/abs_mean``, ``hybrid/grpo_adv/abs_mean``.

* ``hinted_demonstrations``: the warm start's data -- the task's demonstrations replayed in the sandbox, plus,
  for a fraction ``hybrid.hinted_demos`` of the rows, [prompt + hint + the correct tool solution] where the
  hint is what the hindsight judge (``workers.prm.hindsight``) writes about the row's failed attempt
  (``extra_info["failed_steps"]``), laid out as the teacher sees it; so the reference, the teacher of the OPD
  term, has learnt to use a hint. ``hint_gap`` measures that on held-out rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from algorithms import run_adv_estimator
from algorithms.hybrid import hybrid_advantage_terms
from controller import RayClassWithInitArgs, RayWorkerGroup
from dataproto import DataProto
from recipes.schemas import HybridConfig
from recipes.trainer.roles import PooledRole, Roles, env_generator
from recipes.trainer.sources import is_source
from resource_pools import ResourcePoolManager
from workers.agents.replay import reference_trajectories, sft_batch
from workers.agents.trajectory import Trajectory
from workers.engine.vocab_head import head_computes_log_probs
from workers.prm.hindsight import bridge_thought
from workers.prm.worker import PRMWorker
from workers.roles.handles import PRMGroup, role_group

__all__ = [
    "PRMRole",
    "add_teacher_hints",
    "hint_gap",
    "hinted_demonstrations",
    "hybrid_advantage",
    "role_options",
]


def prm_colocated(cfg: HybridConfig) -> bool:
    return cfg.prm.enable and cfg.prm.placement == "colocated"


def role_options(cfg: HybridConfig, run) -> dict:
    """``build_roles``' options: the tool env generates (the env role beside the rollout role); with
    ``prm.placement=colocated`` the PRM is a role in the same processes too; ``hybrid.teacher_path``: the
    reference role loads that teacher."""
    options = env_generator(cfg, run, cfg.env)
    if cfg.hybrid.teacher_path:
        options["reference_path"] = os.path.expanduser(cfg.hybrid.teacher_path)
    if prm_colocated(cfg):
        prm = RayClassWithInitArgs(PRMWorker, config=cfg.prm, reference_path=run.model_path)
        options["extra_roles"] |= {"prm": PooledRole(prm, beside="rollout")}
    return options


class PRMRole:
    """``score(batch)`` -> the PRM's columns; on its own pool (``separate``) or the rollout group (``colocated``)."""

    def __init__(self, cfg: HybridConfig, run, roles: Roles):
        self.manager = None
        self.own = not prm_colocated(cfg)
        if not self.own:
            self.wg = role_group(roles.extra["prm"], PRMGroup)
            return
        self.manager = ResourcePoolManager({"prm_pool": [1]}, {"prm": "prm_pool"}, use_gpu=run.use_gpu)
        self.manager.create_resource_pools()
        try:
            group = RayWorkerGroup(
                self.manager.get_pool("prm"),
                RayClassWithInitArgs(PRMWorker, config=cfg.prm, reference_path=run.model_path),
                name_prefix="prm",
                call_timeout_s=cfg.trainer.call_timeout_s,
                call_timeout_per_row_s=cfg.trainer.call_timeout_per_row_s,
            )
            self.wg = role_group(group, PRMGroup)
            self.wg.init_model()
        except BaseException:
            self.manager.remove()
            raise

    def score(self, batch: DataProto) -> DataProto:
        return self.wg.score_steps(batch)

    def close(self) -> None:
        if self.own:
            try:
                self.wg.shutdown()
            finally:
                assert self.manager is not None  # own: __init__ made the pool
                self.manager.remove()


def add_teacher_hints(batch: DataProto, template: str, reads_hint: bool = True) -> float:
    """``teacher_hint`` = the template around each row's PRM hint ("" where the PRM chose no intervention, and
    everywhere without ``reads_hint``: the plain reference as the teacher); returns the fraction of rows with a
    hint (the rows the OPD term applies to either way)."""
    hints = [str(h) if h is not None else "" for h in batch.non_tensor_batch["hint"]]
    col = np.empty(len(hints), dtype=object)
    col[:] = [template.format(hint=h) if h and reads_hint else "" for h in hints]
    batch.non_tensor_batch["teacher_hint"] = col
    return sum(bool(h) for h in hints) / max(len(hints), 1)


def hybrid_advantage(batch: DataProto, cfg: HybridConfig) -> dict[str, float]:
    """``token_level_rewards`` (= scores), then ``advantages``/``returns`` from the ``hybrid`` estimator with
    the config's weights; returns the hybrid metrics (module docstring). Its PRM and teacher terms are per
    token of a whole trajectory: rows that inherit another row's advantage (env.step_wise turns,
    env.train_children children) are refused."""
    if not is_source(batch).all():
        raise ValueError(
            "the hybrid advantage needs one row per trajectory: turn off env.step_wise and env.train_children"
        )
    b, nt, h = batch.batch, batch.non_tensor_batch, cfg.hybrid
    b["token_level_rewards"] = b["token_level_scores"]
    hint_mask = torch.tensor([bool(x) for x in nt["hint"]], dtype=torch.float32)
    inputs: dict[str, Any] = {  # the keyword arguments of the estimator and of hybrid_advantage_terms
        "token_level_rewards": b["token_level_rewards"],
        "response_mask": b["response_mask"],
        "index": nt["uid"],
        "step_rewards": b["prm_step_scores"] if h.use_prm_reward else None,
        "step_mask": b["prm_step_mask"] if h.use_prm_reward else None,
        "teacher_log_prob": b["teacher_log_prob"],
        "old_log_probs": b["old_log_probs"],
        "hint_mask": hint_mask,
        "opd_clip": h.opd_clip,
        "norm_adv_by_std_in_grpo": cfg.algorithm.norm_adv_by_std_in_grpo,
    }
    adv, ret = run_adv_estimator("hybrid", **inputs, w_rl=h.w_rl, w_opd=h.w_opd)
    b["advantages"], b["returns"] = adv.float(), ret.float()
    terms = hybrid_advantage_terms(**inputs)
    mask = b["response_mask"] > 0
    hinted = mask & (hint_mask[:, None] > 0)

    def abs_mean(t: torch.Tensor, m: torch.Tensor) -> float:
        return float(t[m].abs().mean()) if m.any() else 0.0

    step_mask = b["prm_step_mask"] > 0
    return {
        "hybrid/hint_frac": float(hint_mask.mean()) if len(hint_mask) else 0.0,
        "hybrid/prm_score/mean": float(b["prm_step_scores"][step_mask].mean()) if step_mask.any() else 0.0,
        "hybrid/opd/abs_mean": abs_mean(terms.opd, hinted),
        "hybrid/opd_term/abs_mean": abs_mean(h.w_opd * terms.opd, mask),
        "hybrid/prm_adv/abs_mean": abs_mean(terms.prm, mask),
        "hybrid/grpo_adv/abs_mean": abs_mean(terms.grpo, mask),
    }


def _solution_rows(rows: Sequence[Mapping]) -> list[dict]:
    """The rows with their correct tool solution (``extra_info["tool_turns"]``) as the turns to replay."""
    return [
        {**r, "extra_info": {**r["extra_info"], "reference_turns": list(r["extra_info"]["tool_turns"])}}
        for r in rows
    ]


def _hinted_solutions(rows: Sequence[Mapping], tokenizer, env, template: str) -> list[Trajectory]:
    """The rows' correct tool solutions replayed, each with the judge's hint about the row's failed attempt
    between prompt and solution (the teacher's layout: ``build_teacher_inputs``)."""
    hints: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        extra = row["extra_info"]
        question = str(extra["question"])
        if question in hints:  # a replay is known by its question only: a shared one would get another's hint
            raise ValueError(f"hinted demonstrations: row {i} repeats the question {question!r}")
        failed = json.loads(extra["failed_steps"])
        hint = bridge_thought(question, failed, str(row["reward_model"]["ground_truth"]))
        hints[question] = tokenizer.encode(template.format(hint=hint), add_special_tokens=False)
    trajs = reference_trajectories(_solution_rows(rows), tokenizer, env)
    for t in trajs:
        t.turns[0].prompt_token_ids = [*t.turns[0].prompt_token_ids, *hints[t.query]]
    return trajs


def hinted_demonstrations(rows: Sequence[Mapping], tokenizer, env, *, frac: float, template: str):
    """The warm start's batch (module docstring): every row's demonstration replayed, plus hinted correct
    solutions for the first ``round(frac * len(rows))`` rows. A ``Replay`` once ``frac``/``template`` are bound."""
    trajs = reference_trajectories(rows, tokenizer, env)
    n = round(frac * len(rows))
    if n:
        trajs += _hinted_solutions(rows[:n], tokenizer, env, template)
    if not trajs:
        raise RuntimeError(f"no {env.loop} reference replay was kept; check the task's reference_turns")
    return sft_batch(trajs, tokenizer)


@torch.no_grad()
def _solution_log_probs(model, batch: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the mean log-prob of the trained (assistant) tokens of the response, and of its first token."""
    b = batch.batch
    length, r = b["input_ids"].shape[1], b["responses"].shape[1]
    with head_computes_log_probs(model, b["responses"].reshape(-1)):  # no [rows x tokens x vocab] logits
        lp = model(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            position_ids=b["position_ids"],
            logits_to_keep=torch.arange(length - r - 1, length - 1),  # the positions predicting the response
        ).logits[..., 0]
    mask = b["response_mask"].float()
    return (lp * mask).sum(-1) / mask.sum(-1).clamp(min=1), lp[:, 0]


def hint_gap(model_path: str, rows: Sequence[Mapping], tokenizer, env, template: str) -> dict[str, float]:
    """How much a hint helps the model at ``model_path`` on ``rows`` (held-out): the mean log-prob per token of
    each row's correct tool solution with the hindsight judge's hint about the row's failed attempt before it,
    and without. ``gap`` > 0: given a hint, the model puts more probability on the right tokens;
    ``first_token_gap``: the same for the solution's first token alone (the tool call instead of a guess)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    plain = reference_trajectories(_solution_rows(rows), tokenizer, env)
    hinted = _hinted_solutions(rows, tokenizer, env, template)
    if len(plain) != len(hinted) or not plain:
        raise RuntimeError(
            f"hint_gap: {len(plain)} plain and {len(hinted)} hinted replays of {len(rows)} rows"
        )
    without, first_without = _solution_log_probs(model, sft_batch(plain, tokenizer))
    with_hint, first_with = _solution_log_probs(model, sft_batch(hinted, tokenizer))
    return {
        "log_prob_with_hint": float(with_hint.mean()),
        "log_prob_without_hint": float(without.mean()),
        "gap": float((with_hint - without).mean()),
        # the first token decides between calling the tool and guessing
        "first_token_gap": float((first_with - first_without).mean()),
        "rows_helped_frac": float((with_hint > without).float().mean()),
        "rows": float(len(plain)),
    }
