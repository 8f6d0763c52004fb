"""The tool-use math environment as an agent-loop plugin (``env.loop: math_tool``): ``MathToolEnvConfig`` and
``MathToolLoop``.

The env workers (``workers.agents.env_worker``) run it: per job, one ``MathToolAgent`` trajectory on the row's
problem (the last user message of ``raw_prompt``, or ``extra_info["question"]``). Output columns besides the
trajectory ones: ``steps`` (JSON: the per-turn kind/action/observation records the PRM judges); ``answer`` is
``\\boxed{..}`` or "". Metrics: ``tool/turns/mean``, ``tool/calls/mean``, ``tool/errors``, ``tool/timeouts``,
``tool/malformed/mean``, ``tool/finished_frac``, ``tool/status/<status>``, ``timing_s/gen``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from dataproto import DataProto
from workers.agents.loop import AgentEnvConfig, AgentJob, AgentLoop
from workers.agents.trajectory import Trajectory
from workers.math_env.agent import MathToolAgent, ToolAgentConfig
from workers.sandbox import SandboxConfig

__all__ = ["MathToolEnvConfig", "MathToolLoop", "tool_metrics"]


@dataclass
class MathToolEnvConfig(AgentEnvConfig):
    loop: str = "math_tool"
    agent: ToolAgentConfig = field(default_factory=ToolAgentConfig)
    # echo_last_expr: a trailing expression prints its value, as in a notebook (small models forget print)
    sandbox: SandboxConfig = field(default_factory=lambda: SandboxConfig(timeout_s=5.0, echo_last_expr=True))
    include_json: bool = False  # non_tensor_batch["trajectory"] (the whole record, for viewers)


def tool_metrics(trajs: list[Trajectory], elapsed: float) -> dict[str, float]:
    n = max(len(trajs), 1)
    tool = [t.metadata.get("tool", {}) for t in trajs]
    m = {
        "tool/turns/mean": sum(len(t.turns) for t in trajs) / n,
        "tool/calls/mean": sum(x.get("tool_calls", 0) for x in tool) / n,
        "tool/errors": float(sum(x.get("tool_errors", 0) for x in tool)),
        "tool/timeouts": float(sum(x.get("timeouts", 0) for x in tool)),
        "tool/malformed/mean": sum(x.get("malformed", 0) for x in tool) / n,
        "tool/finished_frac": sum(t.status == "finished" for t in trajs) / n,
        "timing_s/gen": elapsed,
    }
    for s in ("finished", "max_iterations", "budget", "error"):
        m[f"tool/status/{s}"] = float(sum(t.status == s for t in trajs))
    return m


class MathToolLoop(AgentLoop):
    """One tool-use trajectory per job (module docstring)."""

    config_class = MathToolEnvConfig
    output_columns = ("steps",)

    async def run(self, job: AgentJob, config: ToolAgentConfig) -> list[Trajectory]:
        agent = MathToolAgent(self.ctx.policy, self.ctx.sandbox, config)
        return [await agent.run(job.query, uid=job.uid, traj_id=job.traj_id, seed=job.seed)]

    def columns(self, trajectories: list[Trajectory]) -> dict[str, list]:
        return {"steps": [json.dumps(t.metadata.get("steps", []), ensure_ascii=False) for t in trajectories]}

    def metrics(self, runs: list[list[Trajectory]], elapsed_s: float, batch: DataProto) -> dict[str, float]:
        return tool_metrics([t for run in runs for t in run], elapsed_s)

    def reference_config(self, config: ToolAgentConfig, max_turns: int) -> ToolAgentConfig:
        return replace(config, max_turns=max(max_turns, 1), max_new_tokens=1024)  # never cut a demonstration
