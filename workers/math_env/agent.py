"""The tool-use math agent loop: multi-turn generation with a sandboxed Python tool, token-exact records.

    messages = [system (the tool protocol), user (the problem)]
    loop up to max_turns:
        response    = policy.generate(sequence)                    -> the engine's own tokens (mask 1)
        action      = parse_action(decode(response))
        answer      -> the trajectory ends ("finished")
        tool call   -> run the code in the trajectory's REPL (created on the first call, persistent)
        malformed   -> a format-correction observation (the trajectory goes on)
        sequence   += end of turn + user observation + generation prompt          (mask 0)

In the tool-call format (``tool_format``: a parser name such as ``hermes`` for Qwen/Hermes models or
``llama3_json``), the Python tool is declared once as an OpenAI function schema (``PYTHON_TOOL``), rendered into
the prompt by the tokenizer's chat template, called the way the model family calls tools, and answered with
``tool`` messages (``workers.agents.tool_use``); a turn with no call is the answer (``\\boxed{}``) or malformed.

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
from workers.agents.tool_calls import ToolCall, tool_parser
from workers.agents.tool_use import ToolUse
from workers.agents.trajectory import CodeResult, Trajectory, TrajectoryTurn
from workers.agents.turns import Episode, Step, run_turns
from workers.math_env.protocol import (
    TOOL_CLOSE,
    TOOL_OPEN,
    Action,
    format_correction,
    format_tool_observation,
    parse_action,
)
from workers.reward import extract_boxed
from workers.rollout.sampling import SamplingParams
from workers.sandbox import Repl

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "PYTHON_TOOL",
    "TOOL_CALL_SYSTEM_PROMPT",
    "MathToolAgent",
    "ToolAgentConfig",
]

DEFAULT_SYSTEM_PROMPT = (
    f"Solve the problem. You may run Python: write {TOOL_OPEN}code{TOOL_CLOSE} and you will see what it "
    "prints. Give the final answer as \\boxed{N}."
)
TOOL_CALL_SYSTEM_PROMPT = (
    "Solve the problem. You may call the python tool to run code and see what it prints. "
    "Give the final answer as \\boxed{N}."
)
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a persistent interpreter and see what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python code to run"}},
            "required": ["code"],
            "additionalProperties": False,
        },
    },
}


@dataclass
class ToolAgentConfig:
    max_turns: int = 4  # model turns per trajectory
    max_new_tokens: int = 128  # per model turn
    max_sequence_tokens: int | None = None  # prompt + all turns + observations (None: engine limit)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # "tags": <python>code</python> turns; else the model family's tool calls, by parser name ("hermes" for
    # Qwen/Hermes models, "llama3_json", "package.module:Parser"; workers/agents/tool_calls.py)
    tool_format: str = "tags"
    stop_at_tool_close: bool = True  # end a turn at the format's closing tag (</python>, </tool_call>)
    max_observation_chars: int = 400
    exec_timeout_s: float | None = None  # per tool call (None: the sandbox's timeout_s)
    system_prompt: str | None = None  # None: the format's (DEFAULT_SYSTEM_PROMPT / TOOL_CALL_SYSTEM_PROMPT)

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"ToolAgentConfig.max_turns must be >= 1, got {self.max_turns}")
        if self.max_new_tokens < 1:
            raise ValueError(f"ToolAgentConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_observation_chars < 1:
            raise ValueError("ToolAgentConfig.max_observation_chars must be >= 1")
        if self.tool_format != "tags":
            try:
                tool_parser(self.tool_format)
            except (ValueError, TypeError) as exc:
                raise ValueError(
                    f"ToolAgentConfig.tool_format: 'tags' or a tool-call parser; {exc}"
                ) from None


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
        fmt = self.config.tool_format
        self.tools = None if fmt == "tags" else ToolUse([PYTHON_TOOL], fmt)  # None: the tag protocol

    def messages(self, problem: str) -> list[dict]:
        system = self.config.system_prompt
        if system is None:
            system = DEFAULT_SYSTEM_PROMPT if self.tools is None else TOOL_CALL_SYSTEM_PROMPT
        msgs = [{"role": "system", "content": system}] if system else []
        return msgs + [{"role": "user", "content": problem}]

    def stop(self) -> list[str]:
        if not self.config.stop_at_tool_close:
            return []
        return [TOOL_CLOSE] if self.tools is None else self.tools.stop

    def _params(self, seed: int | None) -> SamplingParams:
        c = self.config
        greedy = c.temperature <= 0
        return SamplingParams(
            max_new_tokens=c.max_new_tokens,
            temperature=0.0 if greedy else c.temperature,
            top_p=1.0 if greedy else c.top_p,
            top_k=-1 if greedy else c.top_k,
            seed=seed,
            stop=self.stop(),
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
        traj.metadata["tool_format"] = self.config.tool_format
        return traj


LAST_TURN = "\nNext turn is the last: give the answer as \\boxed{N}."
ANSWER_NOT_TAKEN = "Your \\boxed{} answer was not taken: a turn with a tool call only runs the code."
NO_CALL_NOR_ANSWER = Action(
    "malformed",
    problem="No tool call and no answer found. Call the python tool or give the final answer as \\boxed{N}.",
)


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
        self.repl: Repl | None = None  # the trajectory's REPL, created on its first code call

    async def start(self) -> None:
        agent = self.agent
        tools = None if agent.tools is None else agent.tools.schemas
        self.conv = agent.policy.conversation(
            agent.messages(self.problem), agent.config.max_sequence_tokens, tools=tools
        )

    async def respond(self, k: int) -> ModelResponse:
        return await self.conv.respond(
            self.agent._params(None if self.seed is None else self.seed + 7919 * k)
        )

    async def _run_code(self, code: str, turn: TrajectoryTurn, note: str = "") -> str:
        """Run ``code`` in the trajectory's REPL (created on its first call); the observation the model reads."""
        c, sandbox, stats = self.agent.config, self.agent.sandbox, self.stats
        if self.repl is None:
            self.repl = await sandbox.acreate()
        res = await self.repl.aexecute(code, timeout_s=c.exec_timeout_s or sandbox.config.timeout_s)
        if res.killed and not res.restarted:
            raise RuntimeError(res.error or "the REPL died and could not be restarted")
        stats.tool_calls += 1
        stats.tool_errors += bool(res.error) and not res.timed_out
        stats.timeouts += bool(res.timed_out)
        stats.empty_output += not (res.stdout.strip() or res.stderr.strip() or res.error)
        turn.code_results.append(CodeResult.of_execution(code, res))
        return format_tool_observation(
            res.stdout, res.stderr, res.error, res.timed_out, c.max_observation_chars, note
        )

    async def step(self, k: int, response: ModelResponse, turn: TrajectoryTurn) -> Step:
        if self.agent.tools is not None:
            return await self._tool_call_step(k, response, turn, self.agent.tools)
        action = parse_action(response.text)
        record = {"kind": action.kind, "action": response.text, "observation": ""}
        self.steps.append(record)
        if action.kind == "answer":
            return Step(answer=f"\\boxed{{{action.answer}}}")
        if action.kind == "tool":
            observation = await self._run_code(action.code, turn, action.problem)
        else:
            self.stats.malformed += 1
            observation = format_correction(action)
        record["observation"] = observation
        if k == self.max_turns - 2:
            observation += LAST_TURN
        return Step(observation=observation)

    async def _tool_call_step(
        self, k: int, response: ModelResponse, turn: TrajectoryTurn, tools: ToolUse
    ) -> Step:
        """A turn in the model family's tool-call format: its calls run, each answered by a ``tool`` message;
        a turn without any is the answer, or malformed."""
        parsed = tools.parse(response.text)
        record = {"kind": "tool", "action": response.text, "observation": ""}
        self.steps.append(record)
        answer = extract_boxed(parsed.content)
        if not parsed.calls and not parsed.malformed:
            if answer:
                record["kind"] = "answer"
                return Step(answer=f"\\boxed{{{answer}}}")
            record["kind"] = "malformed"
            self.stats.malformed += 1
            observation = format_correction(NO_CALL_NOR_ANSWER)
            record["observation"] = observation
            return Step(observation=observation + (LAST_TURN if k == self.max_turns - 2 else ""))
        before = tools.stats.calls

        async def run(call: ToolCall) -> str:
            return await self._run_code(call.arguments["code"], turn)

        messages = await tools.answer(parsed, run)
        bad = len(parsed.calls) + len(parsed.malformed) - (tools.stats.calls - before)
        self.stats.malformed += bad
        if tools.stats.calls == before:
            record["kind"] = "malformed"
        if answer:
            messages[-1]["content"] += "\n" + ANSWER_NOT_TAKEN
        if k == self.max_turns - 2:
            messages[-1]["content"] += LAST_TURN
        record["observation"] = "\n".join(m["content"] for m in messages)
        return Step(messages=messages)

    async def close(self) -> None:
        if self.repl is not None:
            try:
                await self.repl.aclose()
            except Exception:  # closing a dead REPL must not hide the result
                pass
