"""The agent-loop plugin API: what one multi-turn environment supplies, and how the env config names it.

An environment is an ``AgentLoop`` subclass plus its config (a dataclass deriving ``AgentEnvConfig`` whose
``agent`` field holds the loop's own settings), which the loop declares as its ``config_class``: a recipe's
``env`` section is read into that dataclass and checked against it (``recipes/config.py``). The env workers
(``workers.agents.env_worker``) and the reference replay (``workers.agents.replay``) do everything else: rows ->
jobs (``n`` samples per prompt, seeds), a policy over the rollout engine, a sandbox, an event loop, bounded
concurrency, trajectories -> the training batch, metrics. ``env.loop`` names the plugin: a registered name (``"rlm"``, ``"math_tool"``, or one given to
``register_agent_loop``), ``"package.module:Class"`` or ``"path/to/my_env.py:Class"`` (a file outside the
package: ``workers.plugins.load_user_file``) -- the latter two work in every Ray process without a registration
step. ``docs/agent_env.md`` walks through a complete one-file environment.

Several environments in one run: ``env.loop: mixed`` (``workers.agents.mixed``) routes each row by its
``env_name`` column (``AgentJob.env_name``) to one of the environments named in ``env.envs``; a single
environment accepts rows whose ``env_name`` is ``""`` or its own ``env.loop`` (``AgentEnvConfig.env_names``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from dataproto import DataProto
from workers.agents.llm import EngineLLM
from workers.agents.trajectory import Trajectory
from workers.plugins import load_plugin
from workers.sandbox import ReplSandbox, SandboxConfig

__all__ = [
    "AgentEnvConfig",
    "AgentJob",
    "AgentLoop",
    "LoopContext",
    "agent_loop_class",
    "register_agent_loop",
]


@dataclass
class AgentEnvConfig:
    """What every agent environment role shares; a subclass adds ``agent`` (the loop's settings) and sets
    ``loop``."""

    loop: str = ""  # the agent-loop plugin: a registered name, "package.module:Class" or "dir/file.py:Class"
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    max_prompt_length: int | None = None  # P of the batch (None: rollout.prompt_length)
    max_response_length: int | None = None  # R: all turns + observations (None: the call's response_length)
    train_children: bool = False  # child trajectories become rows (recursive environments)
    # one training row per model turn (its exact token prefix as the prompt), limits per turn; training
    # rollouts only (validation keeps one row per trajectory). Advantages: per trajectory, on every turn.
    step_wise: bool = False
    mask_truncated: bool = False  # zero the loss mask of rows cut at P + R
    max_concurrent: int = 64  # root trajectories in flight per worker
    include_json: bool = True  # non_tensor_batch["trajectory"]
    jsonl_dir: str | None = None  # append every call's trajectories to <dir>/env_rank<r>.jsonl

    def __post_init__(self):
        if self.max_concurrent < 1:
            raise ValueError(f"{type(self).__name__}.max_concurrent must be >= 1, got {self.max_concurrent}")

    def env_names(self) -> tuple[str, ...]:
        """The values a row's ``env_name`` column may hold: ``""`` (no name) or ``loop``, the one environment
        there is (``workers.agents.mixed.MixedEnvConfig`` names several)."""
        return ("", self.loop)

    def env_config(self, name: str) -> AgentEnvConfig:
        """The config of the environment that runs rows named ``name`` (one of ``env_names()``): this one."""
        if name not in self.env_names():
            raise ValueError(
                f"env_name {name!r} is not one of {list(self.env_names())} (env.loop={self.loop!r})"
            )
        return self


@dataclass
class AgentJob:
    """One trajectory to run: sample ``sample`` of batch row ``row``."""

    row: int
    sample: int
    query: str  # the last user message of the row's prompt (or extra_info["question"])
    extra: dict  # the row's extra_info (e.g. the RLM context)
    uid: str  # the prompt's uid, shared by its samples
    traj_id: str
    seed: int | None = None
    env_name: str = ""  # the row's ``env_name`` column: which environment runs it (``workers.agents.mixed``)
    messages: list[dict] | None = None  # the row's chat prompt (``raw_prompt``), when it has one


@dataclass
class LoopContext:
    """What a loop gets from its host: the policy to record, the sandbox, and where it runs."""

    policy: EngineLLM
    sandbox: ReplSandbox
    tokenizer: Any
    rank: int = 0
    seed: int = 0  # the rollout seed, for engines a loop builds itself
    replay: bool = False  # a scripted reference replay: build no model of your own


class AgentLoop:
    """Base of an agent-loop plugin: override ``run``; the other hooks have working defaults.

    A loop object lives as long as its host (an env worker rank, one replay), so it may keep state built on
    first use (e.g. a frozen sub-model engine)."""

    config_class: ClassVar[type[AgentEnvConfig]]  # the env config this loop reads (module docstring)
    required_columns: ClassVar[tuple[str, ...]] = ()  # non_tensor_batch columns the loop reads
    # columns ``columns`` writes (input ones are not copied); a loop may set it per instance (``MixedLoop``)
    output_columns: tuple[str, ...] = ()

    def __init__(self, env: Any, ctx: LoopContext):
        self.env = env
        self.ctx = ctx

    def agent_config(self, settings: Mapping[str, Any], token_limit: int) -> Any:
        """``env.agent`` with this call's sampling (greedy when ``do_sample`` is off or the temperature is 0)
        and a whole-trajectory token limit of at most ``token_limit``; assumes the fields ``temperature``,
        ``top_p``, ``top_k``, ``max_sequence_tokens`` (override otherwise)."""
        agent = self.env.agent
        cap = agent.max_sequence_tokens
        greedy = not settings["do_sample"] or settings["temperature"] <= 0
        return replace(
            agent,
            temperature=0.0 if greedy else settings["temperature"],
            top_p=1.0 if greedy else settings["top_p"],
            top_k=-1 if greedy else settings["top_k"],
            max_sequence_tokens=token_limit if cap is None else min(cap, token_limit),
        )

    async def run(self, job: AgentJob, config: Any) -> list[Trajectory]:
        """One job to its end: its trajectories, root first (children after it, in start order). Never raise
        for anything the model or its code does: record it in the root's ``status``/``error``."""
        raise NotImplementedError

    def columns(self, trajectories: list[Trajectory]) -> dict[str, list]:
        """Extra output columns, one value per trajectory (names in ``output_columns``)."""
        return {}

    def metrics(self, runs: list[list[Trajectory]], elapsed_s: float, batch: DataProto) -> dict[str, float]:
        """This call's metrics from every job's trajectories (root first) and the output batch."""
        return {}

    def reference_config(self, config: Any, max_turns: int) -> Any:
        """The agent config for replaying reference turns (at most ``max_turns`` per row): never cut one."""
        return config

    def keep_reference(self, root: Trajectory, row: Mapping[str, Any]) -> bool:
        """Whether a replayed reference trajectory is worth training on."""
        return root.status == "finished"

    def close(self) -> None:
        """Release what the loop built itself."""


_LOOPS: dict[str, type[AgentLoop] | str] = {
    "rlm": "workers.rlm.env_loop:RLMLoop",
    "math_tool": "workers.math_env.env_loop:MathToolLoop",
    "mixed": "workers.agents.mixed:MixedLoop",
    "openai_agent": "workers.agents.openai_agent:OpenAIAgentLoop",
}


def register_agent_loop(name: str, cls: type[AgentLoop]) -> None:
    """Make ``env.loop=name`` run ``cls`` in this process (other processes: use ``"module:Class"``)."""
    _LOOPS[name] = cls


def agent_loop_class(name: str) -> type[AgentLoop]:
    """The plugin class ``name`` stands for (module docstring)."""
    return load_plugin(name, _LOOPS, AgentLoop, "env.loop", "agent loop")
