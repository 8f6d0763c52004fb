"""Several agent environments in one run (``env.loop: mixed``): each row names its environment.

A row's ``env_name`` column (as SkyRL's ``env_class`` and verl's ``agent_name``) picks one of the environments
of ``env.envs``; one batch mixes them, every row run by its own loop::

    env:
      loop: mixed
      default: ""                 # the environment of rows without an env_name ("": such rows are an error)
      envs:                       # env name -> that environment's own section, read into its loop's config_class
        rlm:       {loop: rlm, agent: {max_iterations: 3}}
        tool_math: {loop: math_tool, agent: {max_turns: 3}}
        word_count: {loop: "workers.agents.examples.word_count:WordCountLoop"}

Each entry of ``envs`` is read into (and checked against) the dataclass its ``loop`` declares, exactly as a
top-level ``env`` section is (``recipes/config.py``; errors name the key, e.g. ``env.envs.tool_math.agent.max_turn``).
What shapes the training rows of the whole batch is the top-level section's: ``max_prompt_length``,
``max_response_length``, ``train_children``, ``step_wise``, ``mask_truncated``, ``max_concurrent``,
``include_json``, ``jsonl_dir`` (an entry that sets one of them otherwise is refused); an entry keeps its ``agent``,
its ``sandbox`` (its own sandbox when it differs from the top-level one) and its loop's own fields.

``MixedLoop`` builds one loop per entry, routes each job by ``AgentJob.env_name`` (``default`` when empty), writes
the ``env_name`` column (the environment that ran the row) and the union of the loops' columns (``""`` on the rows
of a loop that does not write one), and reports each loop's metrics on its own trajectories and rows as
``env/<name>/<metric>`` (``timing_s/*`` left out: the env worker times the whole call) plus
``env/<name>/num_trajectories`` (root trajectories) and ``env/<name>/rows`` (training rows). Validation logs them
as ``val-env/<name>/...`` with ``val-env/<name>/accuracy`` (``recipes/trainer/validation.py``). The reference
replay (``workers.agents.replay``) replays each row through its own environment.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dataproto import DataProto
from workers.agents.loop import AgentEnvConfig, AgentJob, AgentLoop, LoopContext, agent_loop_class
from workers.agents.trajectory import Trajectory
from workers.sandbox import ReplSandbox, SandboxConfig

__all__ = ["ENV_NAME_KEY", "ROW_FIELDS", "MixedEnvConfig", "MixedLoop"]

ENV_NAME_KEY = "env_name"  # the input column naming a row's environment; also an output column of MixedLoop
# the AgentEnvConfig fields that shape the rows of the whole batch: the top-level section's alone
ROW_FIELDS = (
    "max_prompt_length",
    "max_response_length",
    "train_children",
    "step_wise",
    "mask_truncated",
    "max_concurrent",
    "include_json",
    "jsonl_dir",
)
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class MixedEnvConfig(AgentEnvConfig):
    """Several environments, one per ``env_name`` (module docstring)."""

    loop: str = "mixed"
    envs: dict[str, AgentEnvConfig] = field(default_factory=dict)  # name -> that environment's config
    default: str = ""  # the environment of rows without an env_name ("": such rows are an error)

    def __post_init__(self):
        super().__post_init__()
        if not self.envs:
            raise ValueError("envs is empty: name at least one environment (env.envs.<name>.loop)")
        for name, sub in self.envs.items():
            if not _NAME.fullmatch(str(name)):
                raise ValueError(f"envs.{name} is not a usable env name: letters, digits, '_', '.', '-' only")
            if not isinstance(sub, AgentEnvConfig):
                raise ValueError(
                    f"envs.{name} must be an AgentEnvConfig (its loop's config), got {type(sub).__name__}"
                )
            if isinstance(sub, MixedEnvConfig):
                raise ValueError(
                    f"envs.{name}.loop={sub.loop!r}: a mixed environment cannot hold another one"
                )
            for f in ROW_FIELDS:
                value, default = getattr(sub, f), _default(type(sub), f)
                if value != default:
                    raise ValueError(
                        f"envs.{name}.{f}={value!r}: the rows of a mixed batch take env.{f} (the top-level "
                        f"section's); leave envs.{name}.{f} at {default!r}"
                    )
        if self.default and self.default not in self.envs:
            raise ValueError(f"default={self.default!r} is not one of the envs {sorted(self.envs)}")

    def env_names(self) -> tuple[str, ...]:
        """The names of ``envs``, and ``""`` when ``default`` runs the rows without one."""
        return tuple(self.envs) + (("",) if self.default else ())

    def env_config(self, name: str) -> AgentEnvConfig:
        if name not in self.env_names():
            raise ValueError(
                f"env_name {name!r} is not one of env.envs {sorted(self.envs)}"
                + ("" if self.default else ' (and env.default is "": every row must name its environment)')
            )
        return self.envs[name or self.default]


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    factory = f.default_factory
    return factory() if callable(factory) else None


class MixedLoop(AgentLoop):
    """One loop per environment of ``env.envs``; every job runs in the one its ``env_name`` names."""

    config_class = MixedEnvConfig

    def __init__(self, env: MixedEnvConfig, ctx: LoopContext):
        super().__init__(env, ctx)
        self._sandboxes: list[tuple[SandboxConfig, ReplSandbox]] = []
        self.loops: dict[str, AgentLoop] = {}
        try:
            for name, sub in env.envs.items():
                sub_ctx = replace(ctx, sandbox=self._sandbox_for(sub.sandbox))
                self.loops[name] = agent_loop_class(sub.loop)(sub, sub_ctx)
        except BaseException:
            self.close()
            raise
        own = (c for loop in self.loops.values() for c in loop.output_columns)
        self.output_columns = tuple(dict.fromkeys((ENV_NAME_KEY, *own)))

    def _sandbox_for(self, config: SandboxConfig) -> ReplSandbox:
        """The host's sandbox when ``config`` is the top-level one, else one of this loop's own (one per config)."""
        if config == self.env.sandbox:
            return self.ctx.sandbox
        for have, sandbox in self._sandboxes:
            if have == config:
                return sandbox
        self._sandboxes.append((config, ReplSandbox(config)))
        return self._sandboxes[-1][1]

    def env_of(self, job: AgentJob) -> str:
        """The environment that runs ``job`` (``env.default`` for a job without a name)."""
        name = job.env_name or self.env.default
        if name not in self.loops:
            raise ValueError(
                f"row {job.row}: env_name {job.env_name!r} is not one of env.envs {sorted(self.loops)}"
                + ("" if self.env.default else ' (env.default is "": every row must name its environment)')
            )
        return name

    def agent_config(self, settings: Mapping[str, Any], token_limit: int) -> dict[str, Any]:
        return {name: loop.agent_config(settings, token_limit) for name, loop in self.loops.items()}

    async def run(self, job: AgentJob, config: Mapping[str, Any]) -> list[Trajectory]:
        name = self.env_of(job)
        trajectories = await self.loops[name].run(job, config[name])
        for t in trajectories:
            t.metadata[ENV_NAME_KEY] = name
        return trajectories

    def columns(self, trajectories: list[Trajectory]) -> dict[str, list]:
        names = [t.metadata.get(ENV_NAME_KEY, "") for t in trajectories]
        out: dict[str, list] = {c: [""] * len(trajectories) for c in self.output_columns}
        out[ENV_NAME_KEY] = list(names)
        for name, loop in self.loops.items():
            idx = [i for i, n in enumerate(names) if n == name]
            if not idx:
                continue
            for col, values in loop.columns([trajectories[i] for i in idx]).items():
                column = out.setdefault(col, [""] * len(trajectories))
                for i, v in zip(idx, values):
                    column[i] = v
        return out

    def metrics(self, runs: list[list[Trajectory]], elapsed_s: float, batch: DataProto) -> dict[str, float]:
        rows = batch.non_tensor_batch.get(ENV_NAME_KEY) if len(batch) else None
        m: dict[str, float] = {}
        for name, loop in self.loops.items():
            own = [run for run in runs if run and run[0].metadata.get(ENV_NAME_KEY) == name]
            if not own:
                continue
            idx = (
                np.flatnonzero(np.asarray(rows, dtype=object) == name)
                if rows is not None
                else np.zeros(0, int)
            )
            sub = batch.select_idxs(idx) if rows is not None else batch
            for k, v in loop.metrics(own, elapsed_s, sub).items():
                if not k.startswith("timing_s/"):
                    m[f"env/{name}/{k}"] = v
            m[f"env/{name}/num_trajectories"] = float(len(own))
            m[f"env/{name}/rows"] = float(len(idx))
        return m

    def reference_config(self, config: Mapping[str, Any], max_turns: int) -> dict[str, Any]:
        return {name: loop.reference_config(config[name], max_turns) for name, loop in self.loops.items()}

    def keep_reference(self, root: Trajectory, row: Mapping[str, Any]) -> bool:
        name = root.metadata.get(ENV_NAME_KEY) or row.get(ENV_NAME_KEY) or self.env.default
        return self.loops[name].keep_reference(root, row)

    def close(self) -> None:
        for loop in self.loops.values():
            loop.close()
        for _, sandbox in self._sandboxes:
            sandbox.close()
        self._sandboxes.clear()
