"""The RLM pieces of ``recipes/rlm.py``: config schema, warm-start trajectories, RLM rollouts, answer rewards.

* ``RLMConfig``: the quickstart's sections (``sft`` included) plus ``env`` (``workers.rlm.env_worker.RLMEnvConfig``:
  agent limits, sandbox) and ``eval`` (RLM validation before training and every ``eval.freq`` steps).
* ``reference_batch``: the tasks' reference solutions (``extra_info["reference_turns"]``) replayed through the
  same ``RLMAgent`` the env worker runs, with a scripted policy and a real sandbox, so the observations are
  what running the reference code actually printed; returned in the rollout layout (loss mask 1 on the
  assistant turns, 0 on system prompt / query / observations) for ``ActorWorker.sft_step``.
* ``rlm_role_classes``: ``build_roles``' hook -- ``RLMActorRolloutWorker`` (colocated) / ``RLMEnvWorker``
  (disaggregated) with ``env=cfg.env``; ``rlm_generate`` calls their ``generate_rlm``.
* ``rlm_validate``: greedy RLM trajectories on held-out prompts, scored by the reward worker, which scores
  each trajectory's final ``answer`` (not the decoded multi-turn transcript).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from dataproto import DataProto
from recipes.config import SCHEMAS, QuickstartConfig
from recipes.trainer.metrics import validation_metrics
from recipes.trainer.roles import Roles, metrics_of
from recipes.trainer.steps import val_meta
from workers.rlm.env_worker import RLMEnvConfig

__all__ = [
    "RLMConfig",
    "RLMEvalConfig",
    "reference_batch",
    "register_schema",
    "rlm_generate",
    "rlm_role_classes",
    "rlm_validate",
]


@dataclass
class RLMEvalConfig:
    before_train: bool = True  # greedy RLM validation at step 0
    freq: int = -1  # and every k steps (and at the last step); <= 0: only at the last step


@dataclass
class RLMConfig(QuickstartConfig):
    env: RLMEnvConfig = field(default_factory=RLMEnvConfig)
    eval: RLMEvalConfig = field(default_factory=RLMEvalConfig)


def register_schema() -> None:
    """Make ``parse_args("rlm")`` / ``load_config("rlm")`` know ``RLMConfig`` (no edit to recipes/config.py)."""
    SCHEMAS.setdefault("rlm", RLMConfig)


def check(cfg: RLMConfig) -> None:
    from recipes.config import ConfigError

    t = cfg.trainer
    if t.val_before_train or t.test_freq > 0:
        raise ConfigError(
            "recipes.rlm validates RLM trajectories itself (eval.before_train, eval.freq): set "
            f"trainer.val_before_train=false and trainer.test_freq=-1, got {t.val_before_train}, {t.test_freq}"
        )
    if cfg.algorithm.adv_estimator == "gae":
        raise ConfigError("recipes.rlm has no critic: algorithm.adv_estimator must not be gae")


# --------------------------------------------------------------------------------------------------------------
# Roles and rollouts


def rlm_role_classes(cfg: RLMConfig) -> dict:
    from workers.rlm.env_worker import RLMActorRolloutWorker, RLMEnvWorker

    return {
        "hybrid_cls": RLMActorRolloutWorker,
        "rollout_cls": RLMEnvWorker,
        "rollout_kwargs": {"env": cfg.env},
    }


def rlm_generate(roles: Roles, prompts: DataProto, meta: dict) -> DataProto:
    """RLM trajectories (``rollout.n`` per prompt, rows a,a,..,b,b,..) on the env role; ``env/*`` metrics in
    ``meta_info["metrics"]``."""
    prompts.meta_info.update(meta)
    return roles.rollout.generate_rlm(prompts)


def rlm_validate(roles: Roles, batches: list[DataProto], cfg: RLMConfig) -> dict[str, float]:
    """Greedy RLM trajectories on the held-out prompts: ``val/accuracy`` (mean answer score),
    ``val-core/<data_source>/acc`` and the env's metrics as ``val-env/*``."""
    scores, sources, lengths, env = [], [], [], []
    for prompts in batches:
        p = DataProto(prompts.batch, dict(prompts.non_tensor_batch), dict(prompts.meta_info))
        out = rlm_generate(roles, p, val_meta(cfg))
        env.append(metrics_of(out))
        scores += roles.reward.compute_rm_score(out).batch["token_level_scores"].sum(-1).tolist()
        sources += list(out.non_tensor_batch["data_source"])
        lengths += out.batch["response_mask"].sum(-1).tolist()
    m = validation_metrics(scores, sources, lengths)
    for k in env[0] if env else []:
        if k.startswith("env/"):
            m["val-" + k] = float(np.mean([e[k] for e in env if k in e]))
    return m


# --------------------------------------------------------------------------------------------------------------
# Warm start: reference solutions as multi-turn RLM trajectories


def reference_trajectories(rows: Sequence[Mapping], tokenizer, env: RLMEnvConfig):
    """Replay every row's ``reference_turns`` through ``RLMAgent`` (scripted policy, real sandbox): the
    trajectories an ideal policy would produce, observations included. Rows whose replay does not finish with
    the ground truth are dropped (they would teach a wrong program)."""
    import asyncio

    from workers.reward import score_batch
    from workers.rlm.agent import EngineLLM, LoopThread, ReplayScript, RLMAgent, scripted_generate
    from workers.sandbox import ReplSandbox

    script = ReplayScript(
        {str(r["extra_info"]["question"]): list(r["extra_info"]["reference_turns"]) for r in rows}
    )
    policy = EngineLLM(scripted_generate(tokenizer, script, log_prob=0.0), tokenizer, name="reference")
    sandbox, loop = ReplSandbox(env.sandbox), LoopThread(name="rlm-reference")
    agent = RLMAgent(policy, sandbox, replace(env.agent, max_new_tokens=4096))  # never cut a reference turn

    async def run_all():
        sem = asyncio.Semaphore(env.max_concurrent)

        async def one(i: int, r: Mapping):
            async with sem:
                return await agent.run(r["extra_info"]["question"], r["extra_info"]["context"], uid=f"ref{i}")

        return await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))

    try:
        results = loop.run(run_all())
    finally:
        sandbox.close()
        loop.stop()
    roots = [res.root for res in results]
    scores = score_batch(
        [t.final_answer or "" for t in roots],
        [r["data_source"] for r in rows],
        [r["reward_model"]["ground_truth"] for r in rows],
    ).scores
    return [t for t, s in zip(roots, scores) if s >= 1.0 and t.status == "finished"]


def reference_batch(rows: Sequence[Mapping], tokenizer, env: RLMEnvConfig) -> DataProto:
    """The replayed reference trajectories in the rollout layout, tensors as wide as the longest one."""
    from workers.rlm.trajectory_batch import trajectories_to_dataproto

    trajs = reference_trajectories(rows, tokenizer, env)
    if not trajs:
        raise RuntimeError("no reference trajectory finished with the right answer; check the task data")
    P = max(len(t.turns[0].prompt_token_ids) for t in trajs)
    R = max(len(t.token_sequence()[0]) for t in trajs) - min(len(t.turns[0].prompt_token_ids) for t in trajs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return trajectories_to_dataproto(
        trajs, max_prompt_length=P, max_response_length=max(R, 1), pad_token_id=pad, include_json=False
    )
