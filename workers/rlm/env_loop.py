"""The RLM-REPL environment as an agent-loop plugin (``env.loop: rlm``): ``RLMEnvConfig`` and ``RLMLoop``.

The env workers (``workers.agents.env_worker``) run it: per job, an ``RLMAgent`` trajectory tree on the row's
query with ``extra_info["context"]`` in the REPL; roots are rows, children too with ``env.train_children``.
``llm_query`` sub-calls go to the policy engine, or to a frozen model when ``env.sub_model_path`` is set (a second
native engine built on the same device on first use, never updated). A task's custom tools (``env.tools``,
import paths; run on the env worker) and ``env.setup_code`` reach every REPL as with
``RLM(custom_tools=, setup_code=)``.

Metrics (a group call merges them over the ranks by name: ``dataproto/metrics_merge.py``): ``env/num_roots``,
``env/num_trajectories``, ``env/turns/mean``, ``env/turns/max``, ``env/subcalls/mean``, ``env/children/mean``,
``env/depth/max``, ``env/finished_frac``, ``env/errors``, ``env/status/<status>``, ``env/response_length/mean``,
``env/trajectories_per_s``, ``env/turns_per_s``, ``env/gen_s_per_turn``, ``env/exec_s_per_turn``,
``timing_s/gen``; and per depth ``d`` present (0: the roots, 1: their children, ...; SkyRL splits parent and
child likewise) ``env/depth_<d>/...``: ``num_trajectories``, ``turns/mean``, ``finished_frac``,
``answered_frac`` (a final answer, which is what the parent's code got), ``errors``, ``status/<status>`` and
``response_length/mean`` (the tokens after the trajectory's first prompt -- its turns and the observations
between them -- before any row limit cuts them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dataproto import DataProto
from workers.agents.llm import EngineLLM
from workers.agents.loop import AgentEnvConfig, AgentJob, AgentLoop, LoopContext
from workers.agents.trajectory import STATUSES, Trajectory
from workers.distributed import default_device
from workers.models import load_tokenizer
from workers.reward import score_batch
from workers.rlm.agent import AgentConfig, RLMAgent, normalize_context
from workers.rlm.tools import load_tools
from workers.rollout.native import EngineConfig, NativeEngine

__all__ = ["RLMEnvConfig", "RLMLoop"]


@dataclass
class RLMEnvConfig(AgentEnvConfig):
    """The RLM env role's settings (the agent's own limits are in ``agent``)."""

    loop: str = "rlm"
    agent: AgentConfig = field(default_factory=AgentConfig)
    sub_model_path: str | None = None  # frozen model answering llm_query (None: the policy engine)
    sub_max_num_seqs: int = 64
    # the task's custom tools, {name: "package.module:attribute"} (a Tool or a callable; e.g.
    # "workers.rlm.tools:search_context"), run on the env worker: the mechanism of RLM(custom_tools=...)
    tools: dict[str, str] = field(default_factory=dict)
    sub_tools: dict[str, str] | None = None  # the children's (None: the same as tools)
    setup_code: str | None = None  # Python run in every REPL before its first turn


def _depth_metrics(prefix: str, trajs: list[Trajectory]) -> dict[str, float]:
    """The trajectories of one depth of the trees (module docstring: ``env/depth_<d>/...``)."""
    n = len(trajs)
    # every turn's prompt segment and response, but the first prompt (the system prompt and the query)
    response = [
        sum(len(u.prompt_token_ids) + len(u.response_token_ids) for u in t.turns[1:])
        + (len(t.turns[0].response_token_ids) if t.turns else 0)
        for t in trajs
    ]
    m = {
        f"{prefix}/num_trajectories": float(n),
        f"{prefix}/turns/mean": sum(len(t.turns) for t in trajs) / n,
        f"{prefix}/finished_frac": sum(t.status == "finished" for t in trajs) / n,
        f"{prefix}/answered_frac": sum(t.final_answer is not None for t in trajs) / n,
        f"{prefix}/errors": float(sum(t.status == "error" for t in trajs)),
        f"{prefix}/response_length/mean": sum(response) / n,
    }
    for s in STATUSES:
        if s != "running":
            m[f"{prefix}/status/{s}"] = float(sum(t.status == s for t in trajs))
    return m


class RLMLoop(AgentLoop):
    """RLM trajectory trees: the root's query and REPL context from the row (module docstring)."""

    config_class = RLMEnvConfig
    required_columns = ("extra_info",)

    def __init__(self, env: RLMEnvConfig, ctx: LoopContext):
        super().__init__(env, ctx)
        self.sub_llm: EngineLLM | None = None
        self._sub_engine = None
        self.tools = load_tools(env.tools)
        self.sub_tools = None if env.sub_tools is None else load_tools(env.sub_tools)
        if env.sub_model_path and not ctx.replay:
            self.sub_llm = self._build_sub_llm(env.sub_model_path)

    def _build_sub_llm(self, path: str) -> EngineLLM:
        tok = load_tokenizer(path)
        cfg = EngineConfig(
            max_num_seqs=self.env.sub_max_num_seqs,
            device=str(default_device()),
            seed=1_000_003 * (self.ctx.seed + 7) + self.ctx.rank,
        )
        self._sub_engine = NativeEngine.from_pretrained(path, tokenizer=tok, config=cfg)
        return EngineLLM(self._sub_engine, tok, name="sub")

    async def run(self, job: AgentJob, config: AgentConfig) -> list[Trajectory]:
        agent = RLMAgent(
            self.ctx.policy,
            self.ctx.sandbox,
            config,
            sub_llm=self.sub_llm,
            tools=self.tools,
            sub_tools=self.sub_tools,
            setup_code=self.env.setup_code,
        )
        result = await agent.run(
            job.query,
            normalize_context(job.extra.get("context")),
            uid=job.uid,
            traj_id=job.traj_id,
            seed=job.seed,
            metadata={"sample": job.sample},
        )
        return result.trajectories

    def metrics(self, runs: list[list[Trajectory]], elapsed_s: float, batch: DataProto) -> dict[str, float]:
        roots = [run[0] for run in runs]
        every = [t for run in runs for t in run]
        nroot = max(len(roots), 1)
        turns_all = sum(len(t.turns) for t in every)
        subcalls = [sum(len(t.metadata.get("subcalls", [])) for t in run) for run in runs]
        gen_s = sum(t.timings.get("gen_s", 0.0) for t in every)
        exec_s = sum(t.timings.get("exec_s", 0.0) for t in every)
        P = batch.batch["prompts"].shape[1] if len(batch) else 0
        m = {
            "env/num_roots": float(len(roots)),
            "env/num_trajectories": float(len(every)),
            "env/turns/mean": sum(len(t.turns) for t in roots) / nroot,
            "env/turns/max": float(max((len(t.turns) for t in roots), default=0)),
            "env/subcalls/mean": sum(subcalls) / nroot,
            "env/children/mean": (len(every) - len(roots)) / nroot,
            "env/depth/max": float(max((t.depth for t in every), default=0)),
            "env/finished_frac": sum(t.status == "finished" for t in roots) / nroot,
            "env/errors": float(sum(t.status == "error" for t in every)),
            "env/trajectories_per_s": len(roots) / elapsed_s if elapsed_s > 0 else 0.0,
            "env/turns_per_s": turns_all / elapsed_s if elapsed_s > 0 else 0.0,
            "env/gen_s_per_turn": gen_s / max(turns_all, 1),
            "env/exec_s_per_turn": exec_s / max(turns_all, 1),
            "env/response_length/mean": (
                float(batch.batch["attention_mask"][:, P:].sum(-1).float().mean()) if len(batch) else 0.0
            ),
        }
        for s in STATUSES:
            if s != "running":
                m[f"env/status/{s}"] = float(sum(t.status == s for t in roots))
        for d in sorted({t.depth for t in every}):
            m |= _depth_metrics(f"env/depth_{d}", [t for t in every if t.depth == d])
        return m

    def reference_config(self, config: AgentConfig, max_turns: int) -> AgentConfig:
        return replace(config, max_new_tokens=4096)  # never cut a reference turn

    def keep_reference(self, root: Trajectory, row: Mapping[str, Any]) -> bool:
        """Finished with the ground truth: a wrong reference program would teach a wrong program."""
        if root.status != "finished":
            return False
        score = score_batch(
            [root.final_answer or ""], [row["data_source"]], [row["reward_model"]["ground_truth"]]
        )
        return score.scores[0] >= 1.0
