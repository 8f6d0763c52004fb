"""The tool-use math agent loop: multi-turn generation with a sandboxed Python tool, token-exact records.

    messages = [system (the tool protocol), user (the problem)]
    loop up to max_turns:
        response    = policy.generate(sequence)                    -> the engine's own tokens (mask 1)
        action      = parse_action(decode(response))
        answer      -> the trajectory ends ("finished")
        tool call   -> run the code in the trajectory's REPL (created on the first call, persistent)
        malformed   -> a format-correction observation (the trajectory goes on)
        sequence   += end of turn + user observation + generation prompt          (mask 0)

The loop itself is ``workers.agents.turns.run_turns`` (this module supplies the episode: parsing, the tool,
observations); the conversation and token bookkeeping come from ``workers.agents.llm`` (``EngineLLM``: the
model's tokens are never re-tokenised), and the records are ``workers.agents.trajectory.Trajectory`` so
``workers.agents.batch.trajectories_to_dataproto`` makes the training batch.
``trajectory.metadata["steps"]`` holds one record per turn -- ``kind`` (tool / answer / malformed),
``action`` (the turn's text), ``observation`` (what the environment answered; "" after the answer) -- the
PRM judges these. ``final_answer`` is ``\\boxed{<answer>}``, so rule scorers that read ``\\boxed{}`` score it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from workers.agents.llm import EngineLLM, ModelResponse
from workers.agents.trajectory import CodeResult, Trajectory, TrajectoryTurn
from workers.agents.turns import Episode, Step, run_turns
from workers.math_env.protocol import (
    TOOL_CLOSE,
    TOOL_OPEN,
    format_correction,
    format_tool_observation,
    parse_action,
)
from workers.rollout.sampling import SamplingParams

__all__ = ["DEFAULT_SYSTEM_PROMPT", "MathToolAgent", "ToolAgentConfig"]

DEFAULT_SYSTEM_PROMPT = (
    f"Solve the problem. You may run Python: write {TOOL_OPEN}code{TOOL_CLOSE} and you will see what it "
    "prints. Give the final answer as \\boxed{N}."
)


@dataclass
class ToolAgentConfig:
    max_turns: int = 4  # model turns per trajectory
    max_new_tokens: int = 128  # per model turn
    max_sequence_tokens: int | None = None  # prompt + all turns + observations (None: engine limit)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_at_tool_close: bool = True  # end a turn at </python> (the engine stops on the string)
    max_observation_chars: int = 400
    exec_timeout_s: float | None = None  # per tool call (None: the sandbox's timeout_s)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"ToolAgentConfig.max_turns must be >= 1, got {self.max_turns}")
        if self.max_new_tokens < 1:
            raise ValueError(f"ToolAgentConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_observation_chars < 1:
            raise ValueError("ToolAgentConfig.max_observation_chars must be >= 1")


@dataclass
class _Stats:  # traj.metadata["tool"]
    tool_calls: int = 0
    tool_errors: int = 0
    timeouts: int = 0
    malformed: int = 0
    empty_output: int = 0


class MathToolAgent:
    """``await agent.run(problem, uid=..., traj_id=..., seed=...)`` -> an ``Trajectory`` (module docstring).

    ``policy``: an ``EngineLLM`` (engine or scripted ``GenerateFn`` + tokenizer); ``sandbox``: a
    ``workers.sandbox.ReplSandbox`` (one REPL per trajectory, closed when it ends)."""

    def __init__(self, policy: EngineLLM, sandbox, config: ToolAgentConfig | None = None):
        self.policy = policy
        self.sandbox = sandbox
        self.config = config or ToolAgentConfig()

    def messages(self, problem: str) -> list[dict]:
        msgs = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return msgs + [{"role": "user", "content": problem}]

    def _params(self, seed: int | None) -> SamplingParams:
        c = self.config
        greedy = c.temperature <= 0
        return SamplingParams(
            max_new_tokens=c.max_new_tokens,
            temperature=0.0 if greedy else c.temperature,
            top_p=1.0 if greedy else c.top_p,
            top_k=-1 if greedy else c.top_k,
            seed=seed,
            stop=[TOOL_CLOSE] if c.stop_at_tool_close else [],
            logprobs=True,
        )

    async def run(
        self, problem: str, *, uid: str = "", traj_id: str = "t0", seed: int | None = None, metadata=None
    ) -> Trajectory:
        """One trajectory to its end; never raises for anything the model or its code does."""
        traj = Trajectory(id=traj_id, query=str(problem), root_uid=str(uid or traj_id))
        traj.metadata.update(dict(metadata or {}))
        episode = _ToolEpisode(self, problem, seed)
        traj.metadata["steps"] = episode.steps
        await run_turns(traj, episode)
        traj.metadata["tool"] = asdict(episode.stats)
        return traj


class _ToolEpisode(Episode):
    """One tool-use trajectory's environment: turns parsed as tool call / answer / malformed, the trajectory's
    REPL created on its first tool call, one ``steps`` record per turn."""

    no_room = "the next observation does not fit the token limit"

    def __init__(self, agent: MathToolAgent, problem: str, seed: int | None):
        self.agent, self.seed = agent, seed
        self.problem = problem
        self.max_turns = agent.config.max_turns
        self.steps: list[dict] = []
        self.stats = _Stats()
        self.repl = None

    async def start(self) -> None:
        agent = self.agent
        self.conv = agent.policy.conversation(agent.messages(self.problem), agent.config.max_sequence_tokens)

    async def respond(self, k: int) -> ModelResponse:
        return await self.conv.respond(
            self.agent._params(None if self.seed is None else self.seed + 7919 * k)
        )

    async def step(self, k: int, response: ModelResponse, turn: TrajectoryTurn) -> Step:
        c, sandbox, stats = self.agent.config, self.agent.sandbox, self.stats
        action = parse_action(response.text)
        record = {"kind": action.kind, "action": response.text, "observation": ""}
        self.steps.append(record)
        if action.kind == "answer":
            return Step(answer=f"\\boxed{{{action.answer}}}")
        if action.kind == "tool":
            if self.repl is None:
                self.repl = await sandbox.acreate()
            res = await self.repl.aexecute(
                action.code, timeout_s=c.exec_timeout_s or sandbox.config.timeout_s
            )
            if res.killed and not res.restarted:
                raise RuntimeError(res.error or "the REPL died and could not be restarted")
            stats.tool_calls += 1
            stats.tool_errors += bool(res.error) and not res.timed_out
            stats.timeouts += bool(res.timed_out)
            stats.empty_output += not (res.stdout.strip() or res.stderr.strip() or res.error)
            observation = format_tool_observation(
                res.stdout, res.stderr, res.error, res.timed_out, c.max_observation_chars, action.problem
            )
            turn.code_results = [CodeResult.of_execution(action.code, res)]
        else:
            stats.malformed += 1
            observation = format_correction(action)
        record["observation"] = observation
        if k == self.max_turns - 2:
            observation += "\nNext turn is the last: give the answer as \\boxed{N}."
        return Step(observation=observation)

    async def close(self) -> None:
        if self.repl is not None:
            try:
                await self.repl.aclose()
            except Exception:  # closing a dead REPL must not hide the result
                pass
