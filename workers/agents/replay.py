"""Reference replay: a task's reference turns run through an environment's own agent loop, as SFT data.

Every row's ``extra_info["reference_turns"]`` (the assistant turns of an ideal solution, keyed by
``extra_info["question"]``) is replayed by a scripted policy through the env's plugin (``env.loop``) with a real
sandbox, so the observations are what running the reference code actually printed. The loop decides which
replays are worth training on (``AgentLoop.keep_reference``: finished; for RLM also scored correct); a row's
``env_name`` picks the environment that replays it (several in one run: ``workers.agents.mixed``), and
``reference_batch`` returns them in the rollout layout (loss mask 1 on the assistant turns, 0 on system prompt,
query and observations), tensors as wide as the longest one, for ``ActorWorker.sft_step``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dataproto import DataProto
from workers.agents.batch import row_extent, trajectories_to_dataproto
from workers.agents.limits import gather_bounded
from workers.agents.llm import EngineLLM
from workers.agents.loop import AgentJob, LoopContext, agent_loop_class
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.agents.trajectory import Trajectory
from workers.event_loop import LoopThread
from workers.sandbox import ReplSandbox

__all__ = ["reference_batch", "reference_trajectories", "sft_batch"]


def reference_trajectories(rows: Sequence[Mapping], tokenizer, env: Any) -> list[Trajectory]:
    """The kept replayed root trajectories, in row order (module docstring). ``env``: an ``AgentEnvConfig``
    subclass (its ``agent`` field is the loop's config). A row's ``env_name`` picks the environment that replays
    it (``env.env_config(name)``: the env itself, or one of a mixed env's ``envs``)."""
    if not rows:
        return []
    names = [_env_name(r) for r in rows]
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, name in enumerate(names):
        try:
            sub = env.env_config(name)
        except ValueError as err:
            raise ValueError(f"reference replay, row {i}: {err}") from None
        groups.setdefault(id(sub), (sub, []))[1].append(i)
    kept: list[Trajectory | None] = [None] * len(rows)
    for sub, idx in groups.values():
        for i, traj in zip(idx, _replay(rows, idx, [names[i] for i in idx], tokenizer, sub)):
            kept[i] = traj
    return [t for t in kept if t is not None]


def _env_name(row: Mapping) -> str:
    name = row.get("env_name")
    return name if isinstance(name, str) else ""  # no column, or a missing value (None, NaN)


def _replay(
    rows: Sequence[Mapping], idx: list[int], names: list[str], tokenizer, env: Any
) -> list[Trajectory | None]:
    """The replays of ``rows[i]`` for ``i`` in ``idx`` through ``env``'s own loop: the root, or None when the
    loop does not keep it."""
    extras = [dict(rows[i]["extra_info"]) for i in idx]
    sandbox, thread = ReplSandbox(env.sandbox), LoopThread(name=f"{env.loop}-reference")
    # one loop per row, replaying that row's turns only: the scripted policy tells conversations apart by their
    # query alone, and rows may share one (OOLONG asks the same question of many contexts)
    loops = [
        agent_loop_class(env.loop)(
            env, LoopContext(_replay_policy(tokenizer, e), sandbox, tokenizer, replay=True)
        )
        for e in extras
    ]
    config = loops[0].reference_config(env.agent, max(len(e["reference_turns"]) for e in extras))
    jobs = [
        AgentJob(k, 0, str(e["question"]), e, f"ref{i}", f"ref{i}", env_name=name)
        for k, (i, e, name) in enumerate(zip(idx, extras, names))
    ]
    try:
        runs = thread.run(
            gather_bounded(lambda job: loops[job.row].run(job, config), jobs, env.max_concurrent)
        )
    finally:
        for loop in loops:
            loop.close()
        sandbox.close()
        thread.stop()
    return [run[0] if loops[0].keep_reference(run[0], rows[i]) else None for run, i in zip(runs, idx)]


def _replay_policy(tokenizer, extra: Mapping) -> EngineLLM:
    script = ReplayScript({str(extra["question"]): list(extra["reference_turns"])})
    return EngineLLM(scripted_generate(tokenizer, script, log_prob=0.0), tokenizer, name="reference")


def reference_batch(rows: Sequence[Mapping], tokenizer, env: Any) -> DataProto:
    """The kept replays in the rollout layout, tensors as wide as the longest one."""
    trajs = reference_trajectories(rows, tokenizer, env)
    if not trajs:
        raise RuntimeError(f"no {env.loop} reference replay was kept; check the task's reference_turns")
    return sft_batch(trajs, tokenizer)


def sft_batch(trajs: Sequence[Trajectory], tokenizer) -> DataProto:
    """Root trajectories in the rollout layout, tensors as wide as the longest prompt and response (no cut)."""
    P, R = row_extent(trajs)  # every row whole: a rewritten trajectory's later turns have longer prompts
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return trajectories_to_dataproto(
        trajs, max_prompt_length=P, max_response_length=R, pad_token_id=pad, include_json=False
    )
