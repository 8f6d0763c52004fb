"""The pieces of ``recipes/hybrid_rl.py``: tool-env roles, the PRM role, hint-conditioned teacher log-probs,
the hybrid advantage with its metrics, pass@k validation, and the warm-start demonstrations.

* ``role_classes``: ``build_roles``' hook -- ``MathToolActorRolloutWorker`` (colocated) /
  ``MathToolEnvWorker`` (disaggregated) running the tool env; with ``prm.placement=colocated`` the same
  workers also host the PRM judge (``PRMMixin``: ``score_steps`` on the rollout group).
* ``PRMRole``: the PRM on its own resource pool (``prm.placement=separate``) or on the rollout group.
* ``add_teacher_hints`` / ``hybrid_advantage``: hints -> ``teacher_hint`` (``hybrid.hint_template``), then
  ``algorithms`` ``hybrid`` with the config's weights; metrics ``hybrid/hint_frac`` (trajectories with a
  hint), ``hybrid/prm_score/mean``, ``hybrid/opd/abs_mean`` (|teacher - old| on hinted rows' policy
  tokens), ``hybrid/opd_term/abs_mean`` (the weighted OPD part of the advantage over all policy tokens),
  ``hybrid/prm_adv/abs_mean``, ``hybrid/grpo_adv/abs_mean``.
* ``tool_validate``: ``max(eval.pass_k)`` samples per held-out problem -> ``val/pass@k`` (unbiased
  estimator), ``val/accuracy`` (mean score of the samples), ``val-tool/*``.
* ``reference_batch``: the task's ``reference_turns`` replayed through the same agent with a scripted policy
  and a real sandbox (so observations are real), in the rollout layout for ``ActorWorker.sft_step``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import comb

import numpy as np
import torch

from algorithms import run_adv_estimator
from algorithms.hybrid import hybrid_advantage_terms
from controller import RayClassWithInitArgs, RayWorkerGroup
from dataproto import DataProto
from recipes.hybrid_config import HybridConfig
from recipes.trainer.roles import Roles, metrics_of
from workers.math_env.env_worker import MathToolActorRolloutWorker, MathToolEnvConfig, MathToolEnvWorker
from workers.prm.worker import PRMConfig, PRMMixin, PRMWorker

__all__ = [
    "MathToolPRMActorRolloutWorker",
    "MathToolPRMEnvWorker",
    "PRMRole",
    "add_teacher_hints",
    "hybrid_advantage",
    "pass_at_k",
    "reference_batch",
    "role_classes",
    "tool_generate",
    "tool_validate",
]


class MathToolPRMActorRolloutWorker(PRMMixin, MathToolActorRolloutWorker):
    """Colocated placement with the PRM judge in the same process as actor, rollout and reference."""

    def __init__(
        self, model, actor, rollout, env: MathToolEnvConfig | None = None, prm: PRMConfig | None = None
    ):
        super().__init__(model, actor, rollout, env)
        self._prm_init(prm or PRMConfig(), reference_path=model.path)


class MathToolPRMEnvWorker(PRMMixin, MathToolEnvWorker):
    """Disaggregated placement with the PRM judge in the env (rollout) processes."""

    def __init__(self, model, rollout, env: MathToolEnvConfig | None = None, prm: PRMConfig | None = None):
        super().__init__(model, rollout, env)
        self._prm_init(prm or PRMConfig(), reference_path=model.path)


def prm_colocated(cfg: HybridConfig) -> bool:
    return cfg.prm.enable and cfg.prm.placement == "colocated"


def role_classes(cfg: HybridConfig) -> dict:
    if prm_colocated(cfg):
        return {
            "hybrid_cls": MathToolPRMActorRolloutWorker,
            "rollout_cls": MathToolPRMEnvWorker,
            "rollout_kwargs": {"env": cfg.env, "prm": cfg.prm},
        }
    return {
        "hybrid_cls": MathToolActorRolloutWorker,
        "rollout_cls": MathToolEnvWorker,
        "rollout_kwargs": {"env": cfg.env},
    }


class PRMRole:
    """``score(batch)`` -> the PRM's columns; on its own pool (``separate``) or the rollout group (``colocated``)."""

    def __init__(self, cfg: HybridConfig, run, roles: Roles):
        self.manager = None
        self.own = not prm_colocated(cfg)
        if not self.own:
            self.wg = roles.rollout
            return
        from resource_pools import ResourcePoolManager

        self.manager = ResourcePoolManager({"prm_pool": [1]}, {"prm": "prm_pool"}, use_gpu=run.use_gpu)
        self.manager.create_resource_pools()
        try:
            self.wg = RayWorkerGroup(
                self.manager.get_pool("prm"),
                RayClassWithInitArgs(PRMWorker, config=cfg.prm, reference_path=run.model_path),
                name_prefix="prm",
                call_timeout_s=cfg.trainer.call_timeout_s,
                call_timeout_per_row_s=cfg.trainer.call_timeout_per_row_s,
            )
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
                self.manager.remove()


def tool_generate(roles: Roles, prompts: DataProto, meta: dict) -> DataProto:
    """Tool trajectories (``rollout.n`` per prompt, rows a,a,..,b,b,..); ``tool/*`` metrics in meta_info."""
    prompts.meta_info.update(meta)
    return roles.rollout.generate_tool(prompts)


def add_teacher_hints(batch: DataProto, template: str) -> float:
    """``teacher_hint`` = the template around each row's PRM hint ("" where the PRM chose no intervention);
    returns the fraction of rows with a hint."""
    hints = [str(h) if h is not None else "" for h in batch.non_tensor_batch["hint"]]
    col = np.empty(len(hints), dtype=object)
    col[:] = [template.format(hint=h) if h else "" for h in hints]
    batch.non_tensor_batch["teacher_hint"] = col
    return sum(bool(h) for h in hints) / max(len(hints), 1)


def hybrid_advantage(batch: DataProto, cfg: HybridConfig) -> dict[str, float]:
    """``token_level_rewards`` (= scores), then ``advantages``/``returns`` from the ``hybrid`` estimator with
    the config's weights; returns the hybrid metrics (module docstring)."""
    b, nt, h = batch.batch, batch.non_tensor_batch, cfg.hybrid
    b["token_level_rewards"] = b["token_level_scores"]
    hint_mask = torch.tensor([bool(x) for x in nt["hint"]], dtype=torch.float32)
    inputs = {
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


# --------------------------------------------------------------------------------------------------------------
# Validation: pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def tool_validate(
    roles: Roles, batches: list[DataProto], cfg: HybridConfig, seed: int = 0
) -> dict[str, float]:
    """``max(eval.pass_k)`` tool trajectories per held-out problem at ``eval.temperature``, scored by the
    reward worker: ``val/pass@k`` for each k, ``val/accuracy`` (mean sample score), ``val-tool/*``."""
    ks = sorted(set(cfg.eval.pass_k))
    n, temp = max(ks), cfg.eval.temperature
    meta = {"n": n, "do_sample": temp > 0, "validate": True, "temperature": temp if temp > 0 else 1.0}
    meta["seed"] = cfg.rollout.seed * 2**32 + 2**31 + seed
    correct: dict[str, list[float]] = {}
    scores, env = [], []
    for prompts in batches:
        p = DataProto(prompts.batch, dict(prompts.non_tensor_batch), dict(prompts.meta_info))
        out = tool_generate(roles, p, meta)
        env.append(metrics_of(out))
        s = roles.reward.compute_rm_score(out).batch["token_level_scores"].sum(-1).tolist()
        scores += s
        for uid, x in zip(out.non_tensor_batch["uid"], s):
            correct.setdefault(str(uid), []).append(float(x))
    m = {
        "val/accuracy": float(np.mean(scores)) if scores else float("nan"),
        "val/num_problems": float(len(correct)),
    }
    for k in ks:
        vals = [pass_at_k(len(v), sum(x >= 1.0 for x in v), k) for v in correct.values() if len(v) >= k]
        m[f"val/pass@{k}"] = float(np.mean(vals)) if vals else float("nan")
    for key in env[0] if env else []:
        if key.startswith("tool/"):
            m["val-" + key] = float(np.mean([e[key] for e in env if key in e]))
    return m


# --------------------------------------------------------------------------------------------------------------
# Warm start: the task's multi-turn demonstrations, replayed in the sandbox


def reference_trajectories(rows: Sequence[Mapping], tokenizer, env: MathToolEnvConfig):
    import asyncio
    from dataclasses import replace

    from workers.math_env.agent import MathToolAgent
    from workers.rlm.agent import EngineLLM, LoopThread, ReplayScript, scripted_generate
    from workers.sandbox import ReplSandbox

    script = ReplayScript(
        {str(r["extra_info"]["question"]): list(r["extra_info"]["reference_turns"]) for r in rows}
    )
    policy = EngineLLM(scripted_generate(tokenizer, script, log_prob=0.0), tokenizer, name="reference")
    sandbox, loop = ReplSandbox(env.sandbox), LoopThread(name="hybrid-reference")
    turns = max(len(r["extra_info"]["reference_turns"]) for r in rows)
    agent = MathToolAgent(policy, sandbox, replace(env.agent, max_turns=max(turns, 1), max_new_tokens=1024))

    async def run_all():
        sem = asyncio.Semaphore(env.max_concurrent)

        async def one(i: int, r: Mapping):
            async with sem:
                return await agent.run(r["extra_info"]["question"], uid=f"ref{i}", traj_id=f"ref{i}")

        return await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))

    try:
        trajs = loop.run(run_all())
    finally:
        sandbox.close()
        loop.stop()
    return [t for t in trajs if t.status == "finished"]


def reference_batch(rows: Sequence[Mapping], tokenizer, env: MathToolEnvConfig) -> DataProto:
    """The replayed demonstrations in the rollout layout, tensors as wide as the longest one."""
    from workers.rlm.trajectory_batch import trajectories_to_dataproto

    trajs = reference_trajectories(rows, tokenizer, env)
    if not trajs:
        raise RuntimeError("no demonstration finished with an answer; check the task's reference_turns")
    P = max(len(t.turns[0].prompt_token_ids) for t in trajs)
    R = max(len(t.token_sequence()[0]) - len(t.turns[0].prompt_token_ids) for t in trajs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return trajectories_to_dataproto(
        trajs, max_prompt_length=P, max_response_length=max(R, 1), pad_token_id=pad, include_json=False
    )
