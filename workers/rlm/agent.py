"""The RLM agent loop: multi-turn generation, sandboxed code, recursive sub-calls, token-exact records.

The turn loop (``workers.agents.turns.run_turns``), the conversation (``workers.agents.llm``), the records
(``workers.agents.trajectory``) and the budget (``workers.agents.limits``) are the agent layer's; this module
holds what is RLM's own (the episode: REPL, parsing, FINAL, observations; sub-calls and children).

One :class:`RLMAgent` drives any number of concurrent trajectories on one asyncio loop (their turns and
sub-calls batch together in the engine). A root trajectory runs like this::

    messages  = [system (depth-aware, context *metadata* only), user (the query)]
    sequence  = chat-template tokens of messages + the generation prompt         (mask 0)
    loop up to max_iterations:
        response  = engine.generate(sequence)           -> its own token ids      (mask 1)
        turn      = parse_turn(decode(response))
        run every ```repl block of the turn, in order, in the trajectory's own REPL
        FINAL/FINAL_VAR recorded by the sandbox, or a FINAL line outside code -> finished
        observation = format_observation(results)
        sequence += tokens(end of turn + user observation + generation prompt)    (mask 0)

Token-exact trajectories: the model's tokens are exactly the engine's ``token_ids`` (never decoded and
re-encoded); the template/observation segment between two turns is tokenised once, by itself, and
appended; the prompt of turn k+1 is therefore *literally* the prompt of turn k + its response + that
segment, and :meth:`Trajectory.token_sequence` rebuilds the whole sequence with its loss mask (1 on
the engine's tokens, 0 on everything else) and the engine's log-probs.

Sub-calls from REPL code (``workers.sandbox`` hands them to :meth:`RLMAgent._subcall`):

* ``llm_query(prompt)`` / ``llm_query_batched`` -> one plain chat completion (``[user: prompt]``) from
  the sub-LM: ``sub_llm`` (a separately configured frozen engine) or the policy itself; ``model=name``
  picks one of ``sub_llms``.
* ``rlm_query(prompt, context)`` / ``rlm_query_batched`` -> a child agent one level down with its own
  REPL holding ``context``; at ``depth == max_depth`` it is an ``llm_query`` with the context appended
  to the prompt. The child's final answer (a string) is what the parent's code gets.
* A failing or refused sub-call returns an ``"Error: ..."`` string to the code; it never raises.

Budgets (``AgentConfig``, enforced by ``workers.agents.limits.Budget``) are per root and shared by its whole tree: iterations (per trajectory),
sub-calls, generated tokens (``max_tokens``), prompt+completion tokens of every call (``max_total_tokens``), US
dollars under a price table (``max_cost_usd``, ``prices``), wall-clock seconds, and the length of one
trajectory's token sequence. Reaching one ends the trajectory with status ``"budget"`` naming it
(``"max_iterations"`` for the turn cap: with ``final_answer_on_exhaustion`` one more turn then asks for the
answer); ``max_errors`` turns in a row whose code raised end it with status ``"error"`` (a ``PolicyFailure``:
training keeps its tokens); a sandbox that cannot run at all (creation fails, or a REPL dies and cannot be
restarted) ends that trajectory with status ``"error"`` -- never the batch (training keeps none of its tokens).

Usage: every model call's tokens are on its record (``turn.usage``, a sub-call's ``usage``); ``run`` stores the
tree's sums (``workers.rlm.usage``) as ``root.metadata["usage"]``.

Children carry the root's ``root_uid``, ``depth = parent.depth + 1`` and ``parent_id``; their ids are
``<parent id>/<k>`` (k-th child of that parent). A run returns every trajectory of the tree, root
first, children in start order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from workers.agents.limits import Budget, BudgetLimits, BudgetSpent
from workers.agents.llm import ModelResponse
from workers.agents.tool_calls import ParsedTurn, ToolCall, tool_parser
from workers.agents.tool_use import ToolUse
from workers.agents.trajectory import CodeResult, Trajectory, TrajectoryTurn
from workers.agents.turns import EnvFailure, Episode, PolicyFailure, Step, run_turns
from workers.rlm.callbacks import Callbacks, FinalEvent, IterationEvent, SubcallEvent
from workers.rlm.prompts import ContextInfo, Contexts, PromptConfig, build_messages, describe_context
from workers.rlm.protocol import DEFAULT_LANGUAGES, format_observation, parse_turn, truncate
from workers.rlm.session import Session, follow_up_message
from workers.rlm.usage import tree_usage
from workers.rollout.sampling import SamplingParams
from workers.sandbox.tools import Tool, as_tools

__all__ = ["AgentConfig", "AgentResult", "RLMAgent", "normalize_context"]

SUBCALL_RECORD_CHARS = 2000  # prompt/response characters kept per sub-call in a trajectory's metadata

FINAL_REQUEST = (
    "[Your turns are spent. Answer now, in this message: write FINAL(your answer) on its own line, or "
    "FINAL_VAR(variable_name) to answer with a REPL variable. If you write neither, your message outside code "
    "is taken as the answer.]"
)


# --------------------------------------------------------------------------------------------------
# Configuration


@dataclass
class AgentConfig:
    """Limits and sampling of an RLM agent. Budgets marked *per root* are shared by the whole tree."""

    max_depth: int = 1  # rlm_query starts a child while depth < max_depth; at the cap it is llm_query
    max_iterations: int = 8  # model turns per trajectory (root)
    child_max_iterations: int | None = None  # model turns per child trajectory (None: max_iterations)
    max_new_tokens: int = 512  # per model turn
    max_sequence_tokens: int | None = None  # one trajectory's whole token sequence (None: engine limit)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)  # extra stop strings for model turns
    sub_max_new_tokens: int = 256  # per llm_query completion
    sub_temperature: float | None = None  # llm_query sampling temperature (None: temperature)
    max_subcalls: int | None = 64  # per root: llm_query + rlm_query calls of the whole tree
    # per root: model sub-calls (llm_query, rlm_query at the depth cap) in flight at once, e.g. under a provider's
    # rate limit; child agents are not counted (a child holding a slot while its own calls wait could deadlock)
    max_concurrent_subcalls: int | None = None
    max_tokens: int | None = None  # per root: tokens generated by the whole tree (turns + sub-calls)
    # per root: prompt + completion tokens of every model call of the tree, as a provider bills them (each turn's
    # prompt is its whole conversation so far)
    max_total_tokens: int | None = None
    # per root: US dollars of every model call of the tree, under ``prices``
    max_cost_usd: float | None = None
    # {model name: [USD per million prompt tokens, USD per million completion tokens]}; "*" prices any other
    # model. Names are the LLMs' (``EngineLLM(name=...)``, an HTTP endpoint's model). Gives usage its cost_usd.
    prices: dict[str, list[float]] | None = None
    max_wall_s: float | None = None  # per root: wall-clock seconds from the root's start
    # per trajectory: this many turns in a row whose code raised end it (status "error"), as rlms counts them
    max_errors: int | None = None
    # the turns ran out without an answer: one more model turn asks for it (rlms does so). Off by default
    # for training (the extra turn changes what is trained on); RLM() turns it on.
    final_answer_on_exhaustion: bool = False
    exec_timeout_s: float | None = None  # per code block (None: the sandbox's timeout_s)
    max_observation_chars: int = 4000  # stdout+stderr+error shown per block (the system prompt says so)
    show_variables: bool = True
    languages: tuple[str, ...] = DEFAULT_LANGUAGES  # fences that execute
    prompt: PromptConfig = field(default_factory=PromptConfig)
    # the custom tools are also declared to the model through its chat template (OpenAI function schemas) and
    # may be called in its own tool-call format, by parser name ("hermes", "llama3_json", "module:Class";
    # workers/agents/tool_calls.py); None: only from the REPL's code
    tool_format: str | None = None

    def __post_init__(self):
        if self.max_depth < 0:
            raise ValueError(f"AgentConfig.max_depth must be >= 0, got {self.max_depth}")
        if self.max_iterations < 1:
            raise ValueError(f"AgentConfig.max_iterations must be >= 1, got {self.max_iterations}")
        if self.child_max_iterations is not None and self.child_max_iterations < 1:
            raise ValueError("AgentConfig.child_max_iterations must be >= 1 or None")
        if self.max_new_tokens < 1 or self.sub_max_new_tokens < 1:
            raise ValueError("AgentConfig.max_new_tokens and sub_max_new_tokens must be >= 1")
        if self.max_concurrent_subcalls is not None and self.max_concurrent_subcalls < 1:
            raise ValueError(
                f"AgentConfig.max_concurrent_subcalls must be >= 1 or None, got {self.max_concurrent_subcalls}"
            )
        if self.max_errors is not None and self.max_errors < 1:
            raise ValueError(f"AgentConfig.max_errors must be >= 1 or None, got {self.max_errors}")
        if self.prices is not None:  # (prompt, completion) pairs as lists, as a YAML config gives them
            self.prices = {m: list(p) for m, p in self.prices.items()}
        self.budget_limits()  # checks the budget's own rules (max_cost_usd needs prices)
        self.languages = tuple(self.languages)
        if self.tool_format is not None:
            try:
                tool_parser(self.tool_format)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"AgentConfig.tool_format: {exc}") from None

    def budget_limits(self) -> BudgetLimits:
        """The per-root limits a run's ``Budget`` enforces."""
        return BudgetLimits(
            self.max_subcalls,
            self.max_tokens,
            self.max_wall_s,
            max_total_tokens=self.max_total_tokens,
            max_cost_usd=self.max_cost_usd,
            prices=self.prices,
        )

    def iterations(self, depth: int) -> int:
        if depth > 0 and self.child_max_iterations is not None:
            return self.child_max_iterations
        return self.max_iterations


# --------------------------------------------------------------------------------------------------
# Run state


class _Run:
    """One root and its tree."""

    def __init__(self, cfg: AgentConfig, seed: int | None):
        self.budget = Budget(cfg.budget_limits())
        n = cfg.max_concurrent_subcalls
        self.call_slots = asyncio.Semaphore(n) if n is not None else contextlib.nullcontext()
        self.trajectories: list[Trajectory] = []
        self.rng = random.Random(seed) if seed is not None else None
        self.t0 = time.perf_counter()

    def next_seed(self) -> int | None:
        return None if self.rng is None else self.rng.getrandbits(62)


@dataclass
class _State:
    turn: TrajectoryTurn | None = None


@dataclass
class AgentResult:
    """A root trajectory and its whole tree (root first, children in start order)."""

    root: Trajectory
    trajectories: list[Trajectory]
    elapsed_s: float = 0.0

    @property
    def answer(self) -> str | None:
        return self.root.final_answer

    @property
    def children(self) -> list[Trajectory]:
        return [t for t in self.trajectories if t is not self.root]


def normalize_context(context):
    """Context as the sandbox and the prompts take it: a JSON value (None, str, number, list, dict with str
    keys) or ``Contexts`` of them. Numpy arrays and scalars and tuples (e.g. from parquet rows) become lists
    and numbers; anything else that JSON cannot hold becomes its ``str``."""
    if isinstance(context, Contexts):
        return Contexts([normalize_context(c) for c in context.values])
    if context is None or isinstance(context, str | bool | int | float):
        return context
    if isinstance(context, Mapping):
        return {str(k): normalize_context(v) for k, v in context.items()}
    if hasattr(context, "tolist") and not isinstance(context, list | tuple):
        return normalize_context(context.tolist())  # numpy array or scalar
    if isinstance(context, list | tuple):
        return [normalize_context(c) for c in context]
    return str(context)


def _context_prompt(prompt: str, context) -> str:
    if context is None:
        return prompt
    if isinstance(context, str):
        ctx = context
    elif isinstance(context, list) and all(isinstance(c, str) for c in context):
        ctx = "\n".join(context)
    else:
        ctx = json.dumps(context, ensure_ascii=False)
    return f"{prompt}\n\nContext:\n{ctx}"


# --------------------------------------------------------------------------------------------------
# The agent


class RLMAgent:
    """Runs RLM trajectories: ``await agent.run(query, context)`` -> `AgentResult`.

    ``policy``: the model whose turns are recorded (an `EngineLLM` for trainable, token-exact
    trajectories; a `ChatLLM` for text-only inference). ``sandbox``: a ``workers.sandbox.ReplSandbox``
    (one REPL per trajectory is created in it and closed when the trajectory ends). ``sub_llm``: the
    model answering ``llm_query`` (default: the policy); ``sub_llms``: more, chosen by
    ``llm_query(prompt, model=name)``. ``callbacks``: told of every turn, sub-call and trajectory end
    (`workers.rlm.callbacks`). ``tools``: host functions callable from the root's REPL code
    (``{name: callable | Tool | JSON constant}``, `workers.sandbox.tools`), listed in its system prompt;
    ``sub_tools``: those of every child (None: the same as ``tools``, ``{}``: none -- as rlms' ``custom_sub_tools``);
    each call is recorded in ``metadata["subcalls"]`` with kind ``"tool"``. ``setup_code``: Python run in
    every REPL of the tree before its first turn (its variables are listed in the system prompt; if it
    raises, the trajectory ends with status ``"error"`` naming it).
    """

    def __init__(
        self,
        policy,
        sandbox,
        config: AgentConfig | None = None,
        *,
        sub_llm=None,
        sub_llms: Mapping[str, Any] | None = None,
        callbacks: Callbacks | None = None,
        tools: Mapping[str, Any] | None = None,
        sub_tools: Mapping[str, Any] | None = None,
        setup_code: str | None = None,
    ):
        self.tools = as_tools(tools)  # custom tools of the root's REPL
        self.sub_tools = self.tools if sub_tools is None else as_tools(sub_tools)  # of every child's REPL
        self.setup_code = setup_code  # run in every REPL of the tree before its first turn
        self.policy = policy
        self.callbacks = callbacks or Callbacks()
        self.sandbox = sandbox
        self.config = config or AgentConfig()
        self.sub_llm = sub_llm or policy
        self.sub_llms = dict(sub_llms or {})

    # -- public --------------------------------------------------------------------------------------

    async def run(
        self,
        query: str,
        context=None,
        *,
        uid: str | None = None,
        traj_id: str | None = None,
        seed: int | None = None,
        context_info: ContextInfo | Mapping | None = None,
        metadata: Mapping[str, Any] | None = None,
        session: Session | None = None,
    ) -> AgentResult:
        """Run one root trajectory (and its children) to the end. Never raises for anything the model,
        its code or the sandbox does; the root's ``status`` says how it ended. ``session``: the root runs in
        that persistent session's REPL and conversation (`workers.rlm.session`; inference only)."""
        run = _Run(self.config, seed)
        tid = traj_id or uuid.uuid4().hex[:12]
        if "/" in tid:
            raise ValueError(f"a root trajectory id may not contain '/' (children use it), got {tid!r}")
        root = Trajectory(
            id=tid, query=str(query), root_uid=str(uid if uid is not None else tid), depth=0, parent_id=None
        )
        root.metadata.update(dict(metadata or {}))
        run.trajectories.append(root)
        await self._run_trajectory(run, root, normalize_context(context), context_info, session)
        root.metadata["usage"] = tree_usage(run.trajectories, self.config.prices).to_dict()
        return AgentResult(root, list(run.trajectories), time.perf_counter() - run.t0)

    # -- one trajectory ------------------------------------------------------------------------------

    def _sampling(self, run: _Run, sub: bool = False) -> SamplingParams:
        cfg = self.config
        temperature = cfg.sub_temperature if (sub and cfg.sub_temperature is not None) else cfg.temperature
        return SamplingParams(
            max_new_tokens=cfg.sub_max_new_tokens if sub else cfg.max_new_tokens,
            temperature=temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            seed=run.next_seed(),
            stop=[] if sub else list(cfg.stop),
            logprobs=not sub,
        )

    async def _bounded(self, run: _Run, aw: Awaitable):
        rem = run.budget.remaining_s()
        if rem is None:
            return await aw
        return await asyncio.wait_for(aw, max(rem, 0.0))

    async def _run_trajectory(
        self, run: _Run, traj: Trajectory, context, context_info=None, session: Session | None = None
    ) -> None:
        info = context_info if context_info is not None else describe_context(context)
        info = info if isinstance(info, ContextInfo) else ContextInfo.from_dict(info)
        traj.context_info = info.to_dict()
        traj.timings["start_s"] = time.perf_counter() - run.t0
        await run_turns(traj, _RLMEpisode(self, run, traj, context, info, session), origin=run.t0)
        if self.callbacks:
            tree = [t for t in run.trajectories if t.id == traj.id or t.id.startswith(traj.id + "/")]
            self.callbacks.final(
                FinalEvent(
                    traj.id,
                    traj.depth,
                    traj.status,
                    traj.final_answer,
                    traj.error,
                    len(traj.turns),
                    traj.timings.get("total_s", 0.0),
                    tree_usage(tree, self.config.prices),
                )
            )

    def repl_options(self, depth: int) -> dict[str, Any]:
        """What a REPL at ``depth`` is created with beside its context: its tools and the setup code."""
        return {"tools": self.tools if depth == 0 else self.sub_tools, "setup_code": self.setup_code}

    def prompt_tools(self, depth: int, repl) -> dict[str, str]:
        """System-prompt lines for the REPL's extra names: each tool (signature -> first docstring line) and
        each variable the setup code defined."""
        lines = {
            tool.signature(name): tool.summary() for name, tool in self.repl_options(depth)["tools"].items()
        }
        for name, kind in getattr(repl, "setup_variables", ()):
            lines[name] = f"{kind} defined by the setup code"
        return lines

    def _record_tools(self, run: _Run, traj: Trajectory, turn: int, calls: list[dict]) -> None:
        """A block's tool calls as sub-call records of kind "tool" (the sandbox cut their JSON)."""
        for call in calls:
            record: dict[str, Any] = {
                "kind": "tool",
                "turn": turn,
                "name": call["name"],
                "prompt": call["args"],
                "start_s": call["started"] - run.t0,
            }
            if "error" in call:
                record["error"] = call["error"]
            record["response"] = call.get("result", call.get("error"))
            record["elapsed_s"] = call["elapsed_s"]
            traj.metadata.setdefault("subcalls", []).append(record)
            self.callbacks.subcall(SubcallEvent(traj.id, traj.depth, turn, record))

    async def _execute(
        self, run: _Run, repl, parsed, traj: Trajectory | None = None, turn: int = -1
    ) -> tuple[list[CodeResult], str | None]:
        """Run the turn's blocks in order, then apply an outside FINAL/FINAL_VAR line; the blocks' tool calls
        are recorded on ``traj``."""
        cfg = self.config
        results: list[CodeResult] = []
        answer: str | None = None

        async def run_code(code: str) -> CodeResult:
            timeout = cfg.exec_timeout_s or self.sandbox.config.timeout_s
            rem = run.budget.remaining_s()
            if rem is not None:
                if rem <= 0:
                    return CodeResult(code=code, error="not run: the wall-clock budget is spent")
                timeout = min(timeout, rem)
            res = await repl.aexecute(code, timeout_s=timeout)
            if traj is not None:
                self._record_tools(run, traj, turn, getattr(res, "tool_calls", []))
            if res.killed and not res.restarted:
                raise EnvFailure("sandbox: " + (res.error or "the REPL died and could not be restarted"))
            return CodeResult.of_execution(code, res)

        for code in parsed.code_blocks:
            r = await run_code(code)
            results.append(r)
            if answer is None and r.final_answer is not None:
                answer = r.final_answer
        if answer is None and parsed.final is not None:
            if parsed.final.kind == "FINAL":
                answer = parsed.final.answer
            else:  # FINAL_VAR line: resolved against the REPL state after the blocks
                r = await run_code(f"FINAL_VAR({parsed.final.var_name!r})")
                if r.final_answer is not None:
                    answer = r.final_answer
                else:
                    results.append(r)  # the model sees why (variable not found)
        return results, answer

    # -- sub-calls -----------------------------------------------------------------------------------

    async def _subcall(self, run: _Run, traj: Trajectory, state: _State, kind: str, payload: dict) -> str:
        cfg = self.config
        t0 = time.perf_counter()
        prompt = payload.get("prompt")
        prompt = prompt if isinstance(prompt, str) else str(prompt)
        context = normalize_context(payload.get("context"))
        model = payload.get("model")
        record: dict[str, Any] = {
            "kind": kind,
            "turn": state.turn.index if state.turn is not None else -1,
            "prompt": truncate(prompt, SUBCALL_RECORD_CHARS),
            "start_s": t0 - run.t0,
        }
        refused = run.budget.take_subcall()
        if refused:
            result = f"Error: {kind} refused: the {refused}"
            record["error"] = refused
        else:
            try:
                if kind == "rlm_query" and traj.depth < cfg.max_depth:
                    result = await self._child(run, traj, state, prompt, context, record)
                else:
                    if kind == "rlm_query":
                        prompt = _context_prompt(prompt, context)
                        record["at_depth_cap"] = True
                    llm = self.sub_llm
                    if model is not None:
                        if model not in self.sub_llms:
                            raise ValueError(f"unknown model {model!r}; available: {sorted(self.sub_llms)}")
                        llm = self.sub_llms[model]
                    async with run.call_slots:
                        out = await self._bounded(run, llm.complete(prompt, self._sampling(run, sub=True)))
                    model_name = out.model or llm.name
                    record["tokens"] = out.completion_tokens
                    record["usage"] = {
                        "prompt_tokens": out.prompt_tokens,
                        "completion_tokens": out.completion_tokens,
                        "model": model_name,
                    }
                    run.budget.charge(out.prompt_tokens, out.completion_tokens, model_name)
                    result = out.text
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                result = f"Error: {kind} failed: the wall-clock budget was spent"
                record["error"] = result
            except Exception as exc:
                result = f"Error: {kind} failed: {type(exc).__name__}: {exc}"
                record["error"] = result
        record["response"] = truncate(result, SUBCALL_RECORD_CHARS)
        record["elapsed_s"] = time.perf_counter() - t0
        traj.metadata.setdefault("subcalls", []).append(record)
        self.callbacks.subcall(SubcallEvent(traj.id, traj.depth, record["turn"], record))
        return result

    async def _child(self, run: _Run, parent: Trajectory, state: _State, prompt, context, record) -> str:
        child = Trajectory(
            id=f"{parent.id}/{len(parent.children)}",
            query=prompt,
            root_uid=parent.root_uid,
            depth=parent.depth + 1,
            parent_id=parent.id,
        )
        parent.children.append(child.id)
        if state.turn is not None:
            state.turn.child_ids.append(child.id)
        run.trajectories.append(child)
        record["child_id"] = child.id
        await self._run_trajectory(run, child, context)
        if child.final_answer is not None:
            return child.final_answer
        why = child.status + (f": {child.error}" if child.error else "")
        return f"Error: the helper agent ended without a final answer ({why})"


class _RLMEpisode(Episode):
    """One RLM trajectory's environment: its REPL (holding the context, answering sub-calls), turns parsed
    with the RLM protocol, code run in order, FINAL answers, observations with the budget left."""

    def __init__(
        self,
        agent: RLMAgent,
        run: _Run,
        traj: Trajectory,
        context,
        info: ContextInfo,
        session: Session | None,
    ):
        self.agent, self.run, self.traj, self.context, self.info = agent, run, traj, context, info
        self.max_turns = agent.config.iterations(traj.depth)
        self.state = _State()
        self.repl = None
        self.session = session  # a persistent session owns the REPL and carries the conversation
        self.in_session = False
        self.error_turns = 0  # turns in a row whose code raised (max_errors)
        tools = agent.repl_options(traj.depth)["tools"]
        schemas = [t.schema(n) for n, t in tools.items() if isinstance(t, Tool)]
        fmt = agent.config.tool_format
        # the custom tools in the model's own call format (AgentConfig.tool_format), beside the REPL's functions
        self.tool_use = ToolUse(schemas, fmt) if fmt is not None and schemas else None
        self.schemas = self.tool_use.schemas if self.tool_use is not None else None

    async def start(self) -> None:
        agent, cfg, traj = self.agent, self.agent.config, self.traj

        async def handler(kind: str, payload: dict) -> str:
            return await agent._subcall(self.run, traj, self.state, kind, payload)

        bound: dict[str, Any] = {}  # a later session call's context variables (the first call: `context`)
        try:
            if self.session is None:
                self.repl = await self._create_repl(handler)
            else:
                self.session.begin(handler)
                self.in_session = True
                self.repl, bound = await self.session.repl_for(self._create_repl, self.context)
        except Exception as exc:  # the sandbox cannot give this trajectory a REPL
            raise EnvFailure(f"sandbox: could not create a REPL: {type(exc).__name__}: {exc}") from None
        if self.session is not None and self.session.messages:  # a later call: the conversation goes on
            follow_up = follow_up_message(traj.query, bound)
            messages = [*self.session.messages, {"role": "user", "content": follow_up}]
            self.conv = self.session.conversation(
                agent.policy, messages, cfg.max_sequence_tokens, self._compacted, self.schemas
            )
            return
        tools = {**cfg.prompt.tools, **agent.prompt_tools(traj.depth, self.repl)}
        messages = build_messages(
            traj.query,
            context_info=self.info,
            depth=traj.depth,
            max_depth=cfg.max_depth,
            config=replace(cfg.prompt, max_output_chars=cfg.max_observation_chars, tools=tools),
            max_iterations=self.max_turns,
        )
        if self.session is not None:
            self.conv = self.session.conversation(
                agent.policy, messages, cfg.max_sequence_tokens, self._compacted, self.schemas
            )
        else:
            self.conv = agent.policy.conversation(messages, cfg.max_sequence_tokens, tools=self.schemas)

    async def _create_repl(self, handler):
        # only what is set: a backend without tools or setup code still serves plain trajectories
        options = {k: v for k, v in self.agent.repl_options(self.traj.depth).items() if v}
        if isinstance(self.context, Contexts):
            return await self.agent.sandbox.acreate(
                contexts=list(self.context.values), handler=handler, **options
            )
        return await self.agent.sandbox.acreate(context=self.context, handler=handler, **options)

    def _compacted(self, record: dict) -> None:
        """A session compacted this root's conversation: record it, and charge its summary call."""
        record["turn"] = len(self.traj.turns)
        self.traj.metadata.setdefault("compactions", []).append(record)
        usage = record["usage"]
        if usage:
            self.run.budget.charge(usage["prompt_tokens"], usage["completion_tokens"], usage["model"])

    def _iteration(self, turn: TrajectoryTurn, answer: str | None) -> None:
        if self.agent.callbacks:
            self.agent.callbacks.iteration(
                IterationEvent(
                    self.traj.id,
                    self.traj.depth,
                    turn.index,
                    turn.response_text,
                    list(turn.code_results),
                    answer,
                    dict(turn.usage),
                    self.max_turns,
                )
            )

    async def respond(self, k: int) -> ModelResponse:
        budget = self.run.budget
        reason = budget.exhausted()
        if reason:
            raise BudgetSpent(reason)
        try:
            resp = await self.agent._bounded(self.run, self.conv.respond(self.agent._sampling(self.run)))
        except TimeoutError:
            raise BudgetSpent(budget.exhausted() or "wall-clock budget spent") from None
        budget.charge(resp.prompt_tokens, resp.num_tokens, resp.model)
        return resp

    async def step(self, k: int, response: ModelResponse, turn: TrajectoryTurn) -> Step:
        cfg = self.agent.config
        self.state.turn = turn
        text, calls = response.text, None
        if (
            self.tool_use is not None
        ):  # calls in the model's format leave the rest of the turn to the protocol
            calls = self.tool_use.parse(text)
            if calls.calls or calls.malformed:
                text = calls.content
            else:
                calls = None
        parsed = parse_turn(text, cfg.languages)
        turn.final = parsed.final
        turn.code_results, answer = await self.agent._execute(
            self.run, self.repl, parsed, self.traj, turn.index
        )
        self._iteration(turn, answer)
        if answer is not None:
            return Step(answer=answer)
        self._count_errors(turn.code_results)
        messages = await self._answer_calls(calls, turn) if calls is not None else []
        observation = format_observation(
            turn.code_results,
            cfg.max_observation_chars,
            iteration=k + 1,
            max_iterations=self.max_turns,
            budget=self.run.budget.left() or None,
            turn=parsed,
            show_variables=cfg.show_variables,
        )
        if not messages:
            return Step(observation=observation)
        if turn.code_results:  # the turn's code ran too: its observation follows the tool results
            messages.append({"role": "user", "content": observation})
        return Step(messages=messages)

    async def _answer_calls(self, calls: ParsedTurn, turn: TrajectoryTurn) -> list[dict]:
        """Run the turn's calls in the model's tool-call format on the host (the REPL's tools, their timeouts);
        one ``tool`` message each, recorded in ``metadata["tool_calls"]`` with the turn."""
        tool_use = self.tool_use
        assert tool_use is not None, "calls in the model's format come only from self.tool_use.parse"
        ctx = self.context
        tool_context = (
            {f"context_{i}": c for i, c in enumerate(ctx.values)} if isinstance(ctx, Contexts) else ctx
        )
        tools = self.agent.repl_options(self.traj.depth)["tools"]
        records = self.traj.metadata.setdefault("tool_calls", [])

        async def run(call: ToolCall) -> str:
            outcome = await tools[call.name].acall(call.name, [], dict(call.arguments), tool_context)
            records.append({"turn": turn.index, "name": call.name, "arguments": call.arguments, **outcome})
            if "error" in outcome:
                return f"Error: {outcome['error']}"
            return truncate(
                json.dumps(outcome["ok"], ensure_ascii=False), self.agent.config.max_observation_chars
            )

        messages = await tool_use.answer(calls, run)
        self.traj.metadata["tool_use"] = dict(vars(tool_use.stats))
        return messages

    def _count_errors(self, results: list[CodeResult]) -> None:
        """rlms' ``max_errors``: a turn counts when one of its blocks raised; a turn without one resets."""
        errors = [r.error for r in results if r.error]
        self.error_turns = self.error_turns + 1 if errors else 0
        limit = self.agent.config.max_errors
        if limit is not None and self.error_turns >= limit:
            last = truncate(errors[-1], 300)
            raise PolicyFailure(
                f"max_errors: the code raised in {self.error_turns} turns in a row (last: {last})"
            )

    def final_request(self, observation: str) -> str | None:
        if not self.agent.config.final_answer_on_exhaustion:
            return None
        return f"{observation}\n\n{FINAL_REQUEST}"

    async def final_answer(self, k: int, response: ModelResponse, turn: TrajectoryTurn) -> str | None:
        """A FINAL/FINAL_VAR in the reply (its blocks run, as in any turn), else its text outside code (rlms
        takes the whole reply as the answer)."""
        self.state.turn = turn
        parsed = parse_turn(response.text, self.agent.config.languages)
        turn.final = parsed.final
        turn.code_results, answer = await self.agent._execute(
            self.run, self.repl, parsed, self.traj, turn.index
        )
        answer = answer if answer is not None else (parsed.reasoning or None)
        self._iteration(turn, answer)
        return answer

    async def close(self) -> None:
        if self.in_session:  # the session keeps its REPL open for the next call
            assert self.session is not None, "in_session is set only after self.session.begin"
            self.session.end(self.conv)
            return
        if self.repl is not None:
            try:
                await self.repl.aclose()
            except Exception:  # closing a dead REPL must not hide the trajectory's result
                pass
