"""The tool-use math environment as a role: many trajectories per worker on one event loop, one sandbox.

* ``MathToolActorRolloutWorker(model, actor, rollout, env)`` -- colocated placement: the hybrid actor-rollout
  worker (weights reach its rollout replica in process) plus ``generate_tool(data)``.
* ``MathToolEnvWorker(model, rollout, env)`` -- its own pool (disaggregated): a ``RolloutWorker`` (weights
  arrive over the weight-sync group) whose ``generate_sequences`` runs tool trajectories.

``generate_tool(data)`` (``ROLLOUT_DP_DISPATCH``): per input row the problem is the last user message of
``raw_prompt`` (or ``extra_info["question"]``); ``meta_info`` as for any rollout (``n``, ``temperature``,
``top_p``, ``top_k``, ``do_sample``, ``validate``, ``seed``: sample j of the chunk draws from seed + j).
Output: ``trajectories_to_dataproto`` rows (a,a,b,b; ``response_mask`` 1 only on the model's tokens) with
the input's other columns copied, plus ``steps`` (JSON: the per-turn kind/action/observation records the
PRM judges) and ``answer`` (``\\boxed{..}`` or ""); ``meta_info["metrics"]``: ``tool/turns/mean``,
``tool/calls/mean``, ``tool/errors``, ``tool/timeouts``, ``tool/malformed/mean``, ``tool/finished_frac``,
``tool/status/<status>``, ``timing_s/gen``. Tests pass ``policy_factory(tokenizer) -> GenerateFn``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from controller import Dispatch, register
from dataproto import DataProto
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.math_env.agent import MathToolAgent, ToolAgentConfig
from workers.rlm.env_base import AgentEnvBase
from workers.rlm.env_worker import query_of
from workers.rlm.protocol import RLMTrajectory
from workers.rlm.trajectory_batch import trajectories_to_dataproto
from workers.roles.actor_rollout import ActorRolloutWorker
from workers.roles.rollout import PAD_ROWS_KEY, ROLLOUT_DP_DISPATCH, RolloutWorker, rollout_sampling_meta
from workers.sandbox import SandboxConfig

__all__ = ["MathToolActorRolloutWorker", "MathToolEnvConfig", "MathToolEnvWorker", "tool_metrics"]

_OWN = {"uid", "traj_id", "root_id", "depth", "parent_id", "answer", "root_answer", "status", "num_turns"}
_OWN |= {"truncated", "trajectory", "steps"}


@dataclass
class MathToolEnvConfig:
    agent: ToolAgentConfig = field(default_factory=ToolAgentConfig)
    # echo_last_expr: a trailing expression prints its value, as in a notebook (small models forget print)
    sandbox: SandboxConfig = field(default_factory=lambda: SandboxConfig(timeout_s=5.0, echo_last_expr=True))
    max_concurrent: int = 64  # trajectories in flight per worker
    mask_truncated: bool = False  # zero the loss mask of rows cut at prompt + response length
    include_json: bool = False  # non_tensor_batch["trajectory"] (the whole record, for viewers)

    def __post_init__(self):
        if self.max_concurrent < 1:
            raise ValueError(f"MathToolEnvConfig.max_concurrent must be >= 1, got {self.max_concurrent}")


def tool_metrics(trajs: list[RLMTrajectory], elapsed: float) -> dict[str, float]:
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


class MathToolEnvMixin(AgentEnvBase):
    """Tool trajectories for a worker with ``tokenizer``, ``rollout_engine`` (or a policy factory),
    ``rollout_config``, ``rank`` and ``tag``."""

    loop_name = "math-env"

    def _tool_init(self, env: MathToolEnvConfig | None, policy_factory=None) -> None:
        self._env_base_init(env or MathToolEnvConfig(), policy_factory)

    def _tool_generate(self, data: DataProto) -> DataProto:
        t0 = time.perf_counter()
        if not isinstance(data, DataProto):
            raise TypeError(f"{self.tag}: generate_tool takes a DataProto, got {type(data).__name__}")
        meta = dict(data.meta_info)
        pad_rows = int(meta.pop(PAD_ROWS_KEY, 0))
        settings = rollout_sampling_meta(self.rollout_config, meta)
        n = settings["n"]
        seed = meta.get("seed", self.rollout_config.seed * 2**32 + self.rank)
        num_rows = len(data) - pad_rows
        nt = data.non_tensor_batch
        if num_rows and "raw_prompt" not in nt and "extra_info" not in nt:
            raise KeyError(
                f"{self.tag}: generate_tool needs non_tensor_batch 'raw_prompt' (chat messages) or "
                f"'extra_info' with 'question'; the batch has {sorted(nt)}"
            )
        uids = list(nt["uid"]) if "uid" in nt else [uuid.uuid4().hex for _ in range(len(data))]
        jobs = []
        for i in range(num_rows):
            extra = nt["extra_info"][i] if "extra_info" in nt else {}
            raw = nt["raw_prompt"][i] if "raw_prompt" in nt else None
            problem = query_of(raw, extra if isinstance(extra, dict) else {})
            for k in range(n):
                jobs.append({"row": i, "problem": problem, "uid": str(uids[i]), "k": k, "j": len(jobs)})
        greedy = not settings["do_sample"] or settings["temperature"] <= 0
        P, R = self.rollout_config.prompt_length, settings["response_length"]
        agent = MathToolAgent(
            self._env_policy(), self._env_sandbox(), self._sampled(self.env_config.agent, settings, P + R)
        )

        def one(job):
            return agent.run(
                job["problem"],
                uid=job["uid"],
                traj_id=f"{job['uid'].replace('/', '_')}.{job['k']}",
                seed=None if seed is None else int(seed) + job["j"],
            )

        trajs = self._run_agents(one, jobs)
        elapsed = time.perf_counter() - t0
        rows = [j["row"] for j in jobs]
        extra_cols = {k: [v[r] for r in rows] for k, v in nt.items() if k not in _OWN}
        extra_cols["steps"] = [json.dumps(t.metadata.get("steps", []), ensure_ascii=False) for t in trajs]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out = trajectories_to_dataproto(
            trajs,
            max_prompt_length=P,
            max_response_length=R,
            pad_token_id=pad,
            mask_truncated=self.env_config.mask_truncated,
            extra=extra_cols,
            include_json=self.env_config.include_json,
            meta_info={**meta, **settings, "temperature": settings["temperature"] if not greedy else 1.0},
        )
        out.meta_info["metrics"] = tool_metrics(trajs, elapsed)
        out.meta_info["n"] = n
        if not len(out):  # a placeholder chunk: the same columns as the other ranks, no rows
            for k in list(out.non_tensor_batch):
                out.non_tensor_batch[k] = np.empty(0, dtype=object)
        return out


class MathToolEnvWorker(MathToolEnvMixin, RolloutWorker):
    """The env role on its own pool; weights arrive over the weight-sync group."""

    def __init__(
        self,
        model: ModelConfig,
        rollout: RolloutConfig,
        env: MathToolEnvConfig | None = None,
        policy_factory=None,
    ):
        super().__init__(model, rollout)
        self._tool_init(env, policy_factory)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        if self._policy_factory is not None:
            self._load_tokenizer_only()
        else:
            super().init_model()
        self._env_sandbox()

    @register(ROLLOUT_DP_DISPATCH)
    def generate_sequences(self, data: DataProto) -> DataProto:
        """Tool trajectories for this rank's chunk of prompts (module docstring)."""
        return self._tool_generate(data)

    @register(ROLLOUT_DP_DISPATCH)
    def generate_tool(self, data: DataProto) -> DataProto:
        return self._tool_generate(data)


class MathToolActorRolloutWorker(MathToolEnvMixin, ActorRolloutWorker):
    """Colocated: the hybrid actor-rollout worker plus ``generate_tool``."""

    def __init__(
        self,
        model: ModelConfig,
        actor: ActorConfig,
        rollout: RolloutConfig,
        env: MathToolEnvConfig | None = None,
    ):
        super().__init__(model, actor, rollout)
        self._tool_init(env)

    def _env_before_generate(self) -> None:
        self._offload_trainer()

    @register(ROLLOUT_DP_DISPATCH)
    def generate_tool(self, data: DataProto) -> DataProto:
        self._require_rollout("generate_tool")
        return self._tool_generate(data)
