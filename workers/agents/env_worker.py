"""The agent environment as a role: ``generate_sequences(data)`` runs the env config's agent loop on every prompt.

`EnvWorker(model, rollout, env, rollout_role=Shared("rollout"))` serves every environment (``env.loop``: ``rlm``,
``math_tool``, yours) in both placements: it is composed into the rollout role's pool (`controller.colocate`)
and shares that role's engine in process (`workers.roles.rollout.RolloutWorker`, on its own pool or colocated with
the actor), so how weights arrive is the rollout role's business, not the environment's. `env_roles` gives the
roles of such a pool.

So ``Roles.generate(batch, meta)`` runs the environment in both placements. ``generate_sequences(data)``
(``Dispatch.DP_SPLIT_PROTO``: one contiguous chunk of prompts per rank, outputs concatenated in rank order; ranks may
return different row counts, e.g. with children as rows):

* input, per row: ``non_tensor_batch["raw_prompt"]`` (chat messages; the query is the last user message -- or
  ``extra_info["question"]``), ``["extra_info"]`` (the loop may read more from it, e.g. the RLM ``context``),
  ``["uid"]`` (generated when absent), ``["env_name"]`` (optional: the environment that runs the row, one of
  ``env.env_names()``, else an error naming the row; ``env.loop: mixed`` routes by it, `workers.agents.mixed`)
  and any other columns (copied to every output row of that prompt). Tensors
  of the input are not used (the loop builds its own prompts from the chat template).
* ``meta_info``: ``n`` samples per prompt (group sampling; rows come back a,a,b,b), ``temperature``, ``top_p``,
  ``top_k``, ``do_sample``, ``validate``, ``response_length`` (defaults from the RolloutConfig as in
  `workers.roles.rollout.rollout_sampling_meta`), ``seed`` (sample j of the chunk draws from ``seed + j``),
  ``train_children`` (overrides ``env.train_children`` for this call; default off in a ``validate`` call).
* all trajectories of the chunk run concurrently on the worker's event loop (at most ``env.max_concurrent``
  at once), so their model turns batch in the engine; each trajectory has its own REPL in the worker's sandbox.
* output: `workers.agents.batch.trajectories_to_dataproto` rows with the BATCH_LAYOUT tensors, the trajectory
  columns, ``env_rank`` and the loop's own ones (one row per model turn with ``env.step_wise``, except in a
  ``validate`` call, which scores trajectories); ``meta_info`` gains the sampling settings, ``eos_token_id``,
  ``pad_token_id``, ``timing_s/gen`` and ``metrics`` (the loop's, e.g. ``env/*`` or ``tool/*``;
  ``env/rewritten_frac``, the trajectories whose chat template rewrote their history, trained one row per turn
  whatever ``env.step_wise`` says -- `workers.agents.batch`; step-wise also
  ``env/rows`` and ``env/dropped_turns``, turns whose prefix exceeded ``max_prompt_length``; with children as
  rows ``env/dropped_children``, child trajectories left without a row as they train nothing -- an environment
  failure, or beyond the length limits, `workers.agents.batch`; merged over the ranks for a group call, ``dataproto/metrics_merge.py``, as for
  rollouts).

Tests and benchmarks may pass ``policy_factory(tokenizer) -> GenerateFn`` (a scripted policy) instead of
building an engine.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import numpy as np

from controller import PAD_ROWS_KEY, Dispatch, RayClassWithInitArgs, Shared, Worker, register
from dataproto import DataProto
from workers.agents.batch import OWN_COLUMNS, trajectories_to_dataproto, trajectory_json
from workers.agents.limits import gather_bounded
from workers.agents.llm import EngineLLM
from workers.agents.loop import AgentEnvConfig, AgentJob, AgentLoop, LoopContext, agent_loop_class
from workers.agents.trajectory import Trajectory
from workers.config import ModelConfig, RolloutConfig
from workers.event_loop import CallerLoop, LoopThread
from workers.models import load_tokenizer
from workers.roles.rollout import RolloutWorker, rollout_sampling_meta
from workers.sandbox import ReplSandbox

__all__ = ["EnvWorker", "env_role", "env_roles", "query_of"]


def query_of(raw_prompt, extra_info) -> str:
    """The query of a dataset row: the last user message of ``raw_prompt`` (chat messages), else
    ``extra_info["question"]``, else ``str(raw_prompt)``."""
    msgs = raw_prompt.tolist() if isinstance(raw_prompt, np.ndarray) else raw_prompt
    if isinstance(msgs, (list, tuple)):
        for m in reversed(list(msgs)):
            if isinstance(m, dict) and m.get("role") == "user":
                return str(m.get("content", ""))
    if isinstance(extra_info, dict) and extra_info.get("question"):
        return str(extra_info["question"])
    if isinstance(msgs, str):
        return msgs
    raise ValueError(f"cannot find a query in raw_prompt={raw_prompt!r}")


def chat_messages(raw_prompt) -> list[dict] | None:
    """A row's ``raw_prompt`` as a list of chat messages, or None when it is not one."""
    msgs = raw_prompt.tolist() if isinstance(raw_prompt, np.ndarray) else raw_prompt
    if isinstance(msgs, (list, tuple)) and msgs and all(isinstance(m, dict) and "role" in m for m in msgs):
        return [dict(m) for m in msgs]
    return None


class EnvWorker(Worker):
    """The agent environment of one rank: its agent loop, sandbox and event loop, running the policy on the engine
    of the rollout role it shares (``rollout_role``), or on ``policy_factory(tokenizer) -> GenerateFn`` (a
    scripted policy: tests and benchmarks, no engine). Policy, sandbox, event loop and plugin are built on
    first use; ``env`` is an ``AgentEnvConfig`` subclass whose ``loop`` names the agent-loop plugin."""

    def __init__(
        self,
        model: ModelConfig,
        rollout: RolloutConfig,
        env: AgentEnvConfig,
        policy_factory=None,
        rollout_role: RolloutWorker | None = None,
    ):
        if not isinstance(env, AgentEnvConfig):
            raise TypeError(f"env must be an AgentEnvConfig (e.g. RLMEnvConfig), got {type(env).__name__}")
        if (policy_factory is None) == (rollout_role is None):
            raise ValueError(f"{self.tag}: give exactly one of rollout_role (an engine) and policy_factory")
        if rollout_role is not None and rollout_role.rollout_tp > 1:
            raise ValueError(
                f"{self.tag}: rollout.tensor_model_parallel_size={rollout_role.rollout_tp}: the agent env splits "
                "prompts per rank, which would give the TP ranks of a generation replica different prompts; use 1"
            )
        self.model_config = model
        self.rollout_config = rollout
        self.env_config = env
        self.tokenizer: Any = None
        self._loop_cls = agent_loop_class(env.loop)
        self._policy_factory = policy_factory
        self._rollout_role = rollout_role
        # one agent rollout at a time; with a rollout role, its lock (weights wait for the agents, as for a rollout)
        self._generating = rollout_role.generating if rollout_role is not None else threading.Lock()
        self._env_loop: LoopThread | CallerLoop | None = None
        self._sandbox: ReplSandbox | None = None
        self._agent_loop: AgentLoop | None = None
        self.env_calls = 0

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """The tokenizer (the rollout role's, built first in this process; or loaded, with a policy factory)
        and this rank's sandbox."""
        if self._rollout_role is not None:
            if self._rollout_role.tokenizer is None:
                raise RuntimeError(f"{self.tag}: init_model before the rollout role's init_model")
            self.tokenizer = self._rollout_role.tokenizer
        else:
            m = self.model_config
            self.tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
        self._env_sandbox()

    @register(Dispatch.DP_SPLIT_PROTO)
    def generate_sequences(self, data: DataProto) -> DataProto:
        """Agent trajectories for this rank's chunk of prompts (module docstring)."""
        with self._generating:
            return self._env_generate(data)

    # -- pieces, built on first use ---------------------------------------------------------------------------

    def _env_engine(self):
        return None if self._rollout_role is None else self._rollout_role.rollout_engine

    def _env_policy(self) -> EngineLLM:
        if self.tokenizer is None:
            raise RuntimeError(f"{self.tag}: agent rollout before init_model()")
        if self._policy_factory is not None:
            return EngineLLM(self._policy_factory(self.tokenizer), self.tokenizer)
        engine = self._env_engine()
        if engine is None:
            raise RuntimeError(f"{self.tag}: agent rollout before init_model()")
        return EngineLLM(engine, self.tokenizer, name="policy")

    def _env_sandbox(self) -> ReplSandbox:
        if self._sandbox is None:
            self._sandbox = ReplSandbox(self.env_config.sandbox)
        return self._sandbox

    def _loop_plugin(self) -> AgentLoop:
        if self._agent_loop is None:
            ctx = LoopContext(
                self._env_policy(), self._env_sandbox(), self.tokenizer, self.rank, self.rollout_config.seed
            )
            self._agent_loop = self._loop_cls(self.env_config, ctx)
        return self._agent_loop

    def _event_loop(self) -> LoopThread | CallerLoop:
        if self._env_loop is None:
            engine = self._env_engine()
            loop = engine.event_loop if engine is not None else None
            if loop is not None:  # the engine reads its replies on its own loop: the agents run there
                self._env_loop = CallerLoop(loop)
            else:
                self._env_loop = LoopThread(name=f"{self.env_config.loop}-env-{self.rank}")
        return self._env_loop

    # -- the rollout ------------------------------------------------------------------------------------------

    def _jobs(self, data: DataProto, num_rows: int, n: int, seed) -> list[AgentJob]:
        nt = data.non_tensor_batch
        if num_rows and "raw_prompt" not in nt and "extra_info" not in nt:
            raise KeyError(
                f"{self.tag}: an agent rollout needs non_tensor_batch 'raw_prompt' (chat messages) or "
                f"'extra_info' with 'question'; the batch has {sorted(nt)}"
            )
        for key in self._loop_cls.required_columns:
            if key not in nt and num_rows:
                raise KeyError(
                    f"{self.tag}: the {self.env_config.loop!r} env needs non_tensor_batch[{key!r}]; "
                    f"the batch has {sorted(nt)}"
                )
        uids = list(nt["uid"]) if "uid" in nt else [uuid.uuid4().hex for _ in range(len(data))]
        env_names = self._env_names(nt, num_rows)
        jobs: list[AgentJob] = []
        for i in range(num_rows):
            extra = nt["extra_info"][i] if "extra_info" in nt else {}
            extra = extra if isinstance(extra, dict) else {}
            raw = nt["raw_prompt"][i] if "raw_prompt" in nt else None
            query = query_of(raw, extra)
            uid = str(uids[i])
            for k in range(n):
                j = len(jobs)
                traj_id = f"{uid.replace('/', '_')}.{k}"
                job_seed = None if seed is None else int(seed) + j
                jobs.append(
                    AgentJob(i, k, query, extra, uid, traj_id, job_seed, env_names[i], chat_messages(raw))
                )
        return jobs

    def _env_names(self, nt: dict, num_rows: int) -> list[str]:
        """Each row's ``env_name`` (``""`` without the column), one of ``env.env_names()``: else an error naming
        the row (and its file row, ``data_row``) and the known names."""
        known = self.env_config.env_names()
        names = [_env_name(v) for v in nt["env_name"][:num_rows]] if "env_name" in nt else [""] * num_rows
        for i, name in enumerate(names):
            if name not in known:
                where = f" ({nt['data_row'][i]})" if "data_row" in nt else ""
                raise ValueError(
                    f"{self.tag}: batch row {i}{where}: env_name {name!r} is not one of "
                    f"{sorted(n for n in known if n)} (env.loop={self.env_config.loop!r}"
                    + (", rows without an env_name are refused)" if "" not in known else ")")
                )
        return names

    def _run_jobs(self, loop: AgentLoop, jobs: list[AgentJob], config) -> list[list[Trajectory]]:
        """Every job on this worker's event loop, at most ``env.max_concurrent`` at once, with the rollout
        engine's memory resumed meanwhile; results in job order."""
        engine = self._env_engine()
        if self._rollout_role is not None:
            self._rollout_role.before_generate()  # a colocated trainer leaves the device
        if engine is not None:
            engine.resume_memory()
        try:
            if not jobs:
                return []
            coro = gather_bounded(lambda job: loop.run(job, config), jobs, self.env_config.max_concurrent)
            return self._event_loop().run(coro)
        finally:
            if engine is not None and self.rollout_config.free_cache_engine:
                engine.release_memory()

    def _env_generate(self, data: DataProto) -> DataProto:
        t0 = time.perf_counter()
        if not isinstance(data, DataProto):
            raise TypeError(f"{self.tag}: an agent rollout takes a DataProto, got {type(data).__name__}")
        env = self.env_config
        meta = dict(data.meta_info)
        pad_rows = int(meta.pop(PAD_ROWS_KEY, 0))
        settings = rollout_sampling_meta(self.rollout_config, meta)
        n = settings["n"]
        seed = meta.get("seed", self.rollout_config.seed * 2**32 + self.rank)
        num_rows = len(data) - pad_rows
        jobs = self._jobs(data, num_rows, n, seed)
        P = env.max_prompt_length or self.rollout_config.prompt_length
        R = env.max_response_length or settings["response_length"]
        loop = self._loop_plugin()
        config = loop.agent_config(settings, P + R)
        runs = self._run_jobs(loop, jobs, config)
        elapsed = time.perf_counter() - t0
        self.env_calls += 1

        trajectories = [t for run in runs for t in run]
        sources = [job.row for job, run in zip(jobs, runs) for _ in run]
        own = OWN_COLUMNS | set(loop.output_columns)
        nt = data.non_tensor_batch
        extra_cols = {k: [v[r] for r in sources] for k, v in nt.items() if k not in own}
        extra_cols |= loop.columns(trajectories)
        extra_cols["env_rank"] = [self.rank] * len(trajectories)
        training = not meta.get("validate", False)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        eos = list(getattr(self._env_engine(), "eos_token_ids", None) or [self.tokenizer.eos_token_id])
        greedy = not settings["do_sample"] or settings["temperature"] <= 0
        out = trajectories_to_dataproto(
            trajectories,
            max_prompt_length=P,
            max_response_length=R,
            pad_token_id=pad,
            train_children=bool(meta.get("train_children", env.train_children and training)),
            step_wise=env.step_wise and training,
            mask_truncated=env.mask_truncated,
            extra=extra_cols,
            include_json=env.include_json,
            split_rewritten=training,  # validation scores one row per trajectory
            meta_info={
                **meta,
                **settings,
                "temperature": 1.0 if greedy else settings["temperature"],  # of the reported log-probs
                "eos_token_id": eos,
                "pad_token_id": pad,
                "timing_s/gen": elapsed,
            },
        )
        if not len(out):  # a placeholder chunk: the same columns as the other ranks, no rows
            for k in list(out.non_tensor_batch):
                out.non_tensor_batch[k] = np.empty(0, dtype=object)
        out.meta_info["metrics"] = {**loop.metrics(runs, elapsed, out), "timing_s/gen": elapsed}
        # the chat template rewrote the history of these: they train one row per turn (workers/agents/batch.py)
        rewritten = out.meta_info.pop("rewritten_trajectories", 0)
        out.meta_info["metrics"]["env/rewritten_frac"] = rewritten / max(len(trajectories), 1)
        if "dropped_turns" in out.meta_info:  # step-wise: turns whose prefix exceeded max_prompt_length
            out.meta_info["metrics"]["env/dropped_turns"] = float(out.meta_info.pop("dropped_turns"))
            out.meta_info["metrics"]["env/rows"] = float(len(out))
        if "dropped_children" in out.meta_info:  # train_children: child trajectories that train nothing
            out.meta_info["metrics"]["env/dropped_children"] = float(out.meta_info.pop("dropped_children"))
        if env.jsonl_dir and trajectories:
            os.makedirs(env.jsonl_dir, exist_ok=True)
            path = os.path.join(env.jsonl_dir, f"env_rank{self.rank}.jsonl")
            with open(path, "a", encoding="utf-8") as f:
                for t in trajectories:
                    f.write(trajectory_json(t) + "\n")
        return out

    # -- group methods ----------------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def env_info(self) -> dict:
        """This rank's sandbox isolation report and counters (``workers.sandbox`` README terms)."""
        sb = self._env_sandbox()
        return {
            "rank": self.rank,
            "isolation": sb.isolation_report(),
            "calls": self.env_calls,
            "repls_open": sb.num_repls,
        }

    @register(Dispatch.ONE_TO_ALL)
    def close_env(self) -> None:
        """Stop this rank's sandbox (every REPL process), agent loop and event loop; they restart on the next
        rollout."""
        if self._agent_loop is not None:
            self._agent_loop.close()
            self._agent_loop = None
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None
        if self._env_loop is not None:
            self._env_loop.stop()
            self._env_loop = None


def _env_name(value) -> str:
    return value if isinstance(value, str) else ""  # a missing value (None) names no environment


def env_roles(model: ModelConfig, rollout: RolloutConfig, env: AgentEnvConfig, **rollout_kwargs) -> dict:
    """The roles of a pool that runs ``env`` on its own rollout engines (disaggregated placement: ``rollout`` then
    ``env``, in build order), for `controller.create_colocated_worker_cls`; ``rollout_kwargs`` go to the
    `RolloutWorker` (e.g. ``concurrent=True``). Colocated with the actor, add the ``env`` role alone
    (`env_role`) beside the hybrid engine's roles (`workers.roles.hybrid_roles`)."""
    return {
        "rollout": RayClassWithInitArgs(RolloutWorker, model=model, rollout=rollout, **rollout_kwargs),
        "env": env_role(model, rollout, env),
    }


def env_role(model: ModelConfig, rollout: RolloutConfig, env: AgentEnvConfig) -> RayClassWithInitArgs:
    """The env role, sharing the ``rollout`` role of its pool."""
    return RayClassWithInitArgs(
        EnvWorker, model=model, rollout=rollout, env=env, rollout_role=Shared("rollout")
    )
