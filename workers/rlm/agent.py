"""The RLM agent loop: multi-turn generation, sandboxed code, recursive sub-calls, token-exact records.

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
segment, and :meth:`RLMTrajectory.token_sequence` rebuilds the whole sequence with its loss mask (1 on
the engine's tokens, 0 on everything else) and the engine's log-probs.

Sub-calls from REPL code (``workers.sandbox`` hands them to :meth:`RLMAgent._subcall`):

* ``llm_query(prompt)`` / ``llm_query_batched`` -> one plain chat completion (``[user: prompt]``) from
  the sub-LM: ``sub_llm`` (a separately configured frozen engine) or the policy itself; ``model=name``
  picks one of ``sub_llms``.
* ``rlm_query(prompt, context)`` / ``rlm_query_batched`` -> a child agent one level down with its own
  REPL holding ``context``; at ``depth == max_depth`` it is an ``llm_query`` with the context appended
  to the prompt. The child's final answer (a string) is what the parent's code gets.
* A failing or refused sub-call returns an ``"Error: ..."`` string to the code; it never raises.

Budgets (``AgentConfig``) are per root and shared by its whole tree: iterations (per trajectory),
sub-calls, generated tokens, wall-clock seconds, and the length of one trajectory's token sequence.
Reaching one ends the trajectory with status ``"budget"`` (``"max_iterations"`` for the turn cap);
a sandbox that cannot run at all (creation fails, or a REPL dies and cannot be restarted) ends that
trajectory with status ``"error"`` -- never the batch.

Children carry the root's ``root_uid``, ``depth = parent.depth + 1`` and ``parent_id``; their ids are
``<parent id>/<k>`` (k-th child of that parent). A run returns every trajectory of the tree, root
first, children in start order.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from workers.rlm.prompts import ContextInfo, PromptConfig, build_messages, describe_context
from workers.rlm.protocol import (
    DEFAULT_LANGUAGES,
    CodeResult,
    RLMTrajectory,
    RLMTurn,
    format_observation,
    parse_turn,
    truncate,
)
from workers.rollout.sampling import GenerationOutput, SamplingParams

__all__ = [
    "AgentConfig",
    "AgentResult",
    "ChatFormat",
    "ChatLLM",
    "EngineLLM",
    "GenerateFn",
    "LoopThread",
    "RLMAgent",
    "ReplayScript",
    "as_llm",
    "normalize_context",
    "scripted_generate",
]

GenerateFn = Callable[[list[int], SamplingParams], Awaitable[GenerationOutput | list[GenerationOutput]]]
"""``async gen(prompt_ids, SamplingParams) -> GenerationOutput``: NativeEngine.generate, SGLangRollout.generate,
or any function with that contract (a scripted policy in tests)."""

SUBCALL_RECORD_CHARS = 2000  # prompt/response characters kept per sub-call in a trajectory's metadata


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
    max_tokens: int | None = None  # per root: tokens generated by the whole tree (turns + sub-calls)
    max_wall_s: float | None = None  # per root: wall-clock seconds from the root's start
    exec_timeout_s: float | None = None  # per code block (None: the sandbox's timeout_s)
    max_observation_chars: int = 4000  # stdout+stderr+error shown per block (the system prompt says so)
    show_variables: bool = True
    languages: tuple[str, ...] = DEFAULT_LANGUAGES  # fences that execute
    prompt: PromptConfig = field(default_factory=PromptConfig)

    def __post_init__(self):
        if self.max_depth < 0:
            raise ValueError(f"AgentConfig.max_depth must be >= 0, got {self.max_depth}")
        if self.max_iterations < 1:
            raise ValueError(f"AgentConfig.max_iterations must be >= 1, got {self.max_iterations}")
        if self.child_max_iterations is not None and self.child_max_iterations < 1:
            raise ValueError("AgentConfig.child_max_iterations must be >= 1 or None")
        if self.max_new_tokens < 1 or self.sub_max_new_tokens < 1:
            raise ValueError("AgentConfig.max_new_tokens and sub_max_new_tokens must be >= 1")
        self.languages = tuple(self.languages)

    def iterations(self, depth: int) -> int:
        if depth > 0 and self.child_max_iterations is not None:
            return self.child_max_iterations
        return self.max_iterations


# --------------------------------------------------------------------------------------------------
# Chat formatting (template pieces tokenised once per segment, never the whole conversation)

_S1, _S2, _SA = "HYFLOWSENTINELONE", "HYFLOWSENTINELTWO", "HYFLOWSENTINELSYS"


class ChatFormat:
    """The tokenizer's chat template split into the pieces an incremental conversation needs.

    ``prompt_ids(messages)``: the initial prompt (template + generation prompt). ``continuation(text,
    last_token)``: the tokens that close the model's turn (unless its last token already did), open a
    user turn holding ``text``, close it and open the next assistant turn -- tokenised by itself, so
    the model's own tokens before it are never touched. Tokenizers without a chat template get a
    plain ``User:/Assistant:`` format.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.has_template:
            text = self._render(
                [
                    {"role": "system", "content": _SA},
                    {"role": "user", "content": "A"},
                    {"role": "assistant", "content": _S1},
                    {"role": "user", "content": _S2},
                ],
                add_generation_prompt=True,
            )
            i1, i2 = text.find(_S1), text.find(_S2)
            if i1 < 0 or i2 < i1:
                raise ValueError("the chat template drops message contents; ChatFormat cannot split it")
            self.between = text[i1 + len(_S1) : i2]  # end of assistant turn + start of user turn
            self.tail = text[i2 + len(_S2) :]  # end of user turn + generation prompt
        else:
            self.between, self.tail = "\n\nUser: ", "\n\nAssistant: "
        self.eos_ids = set()
        for name in ("eos_token_id",):
            v = getattr(tokenizer, name, None)
            if isinstance(v, int):
                self.eos_ids.add(v)
        # The text of each special token, so a turn that ended with one does not get it twice.
        self._special_text: dict[int, str] = {}

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of ``messages`` with the generation prompt."""
        if self.has_template:
            return self._render(messages, add_generation_prompt=True)
        parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        return "\n\n".join(parts) + self.tail

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return self.encode(self.render(messages))

    def _token_text(self, token: int) -> str:
        if token not in self._special_text:
            self._special_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self._special_text[token]

    def continuation_text(self, text: str, last_token: int | None) -> str:
        between = self.between
        if last_token is not None:
            closing = self._token_text(last_token)
            if closing and between.startswith(closing):
                between = between[len(closing) :]
        return between + text + self.tail

    def continuation(self, text: str, last_token: int | None) -> list[int]:
        return self.encode(self.continuation_text(text, last_token))


# --------------------------------------------------------------------------------------------------
# LLM backends


class ContextFull(Exception):
    """The next request would not fit under the trajectory's (or the engine's) token limit."""


@dataclass
class _Response:
    text: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    prompt_ids: list[int]  # tokens appended since the previous response (the whole prompt for turn 0)
    prompt_text: str
    num_tokens: int  # generated tokens (for budgets)


class EngineLLM:
    """A token-level LLM: ``generate`` (an engine object with ``async generate`` or a `GenerateFn`) and
    the tokenizer whose ids it speaks. ``max_model_len``: prompt + response limit (default: the engine's
    ``max_model_len`` attribute, if any)."""

    token_exact = True

    def __init__(self, generate, tokenizer, *, max_model_len: int | None = None, name: str = "policy"):
        fn = getattr(generate, "generate", None)
        self.generate_fn: GenerateFn = fn if fn is not None and inspect.iscoroutinefunction(fn) else generate
        if not callable(self.generate_fn):
            raise TypeError(f"EngineLLM needs an async generate function or an engine, got {generate!r}")
        self.engine = generate if fn is not None else None
        self.tokenizer = tokenizer
        self.format = ChatFormat(tokenizer)
        self.max_model_len = max_model_len or getattr(generate, "max_model_len", None)
        self.name = name

    async def _generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        out = await self.generate_fn(list(prompt_ids), params)
        if isinstance(out, list):
            out = out[0]
        return out

    def conversation(self, messages, limit: int | None) -> _TokenConversation:
        return _TokenConversation(self, messages, limit)

    async def complete(self, prompt: str, params: SamplingParams) -> tuple[str, int]:
        """One plain completion of ``[user: prompt]``: (text, generated tokens)."""
        ids = self.format.prompt_ids([{"role": "user", "content": prompt}])
        if self.max_model_len is not None:
            room = self.max_model_len - len(ids)
            if room < 1:
                raise ContextFull(
                    f"the prompt is {len(ids)} tokens; the model {self.name!r} takes at most "
                    f"{self.max_model_len - 1} (split it into smaller pieces)"
                )
            if params.max_new_tokens > room:
                params = SamplingParams(**{**params.__dict__, "max_new_tokens": room})
        out = await self._generate(ids, params)
        return self.format.decode(out.token_ids), len(out.token_ids)


class _TokenConversation:
    def __init__(self, llm: EngineLLM, messages, limit: int | None):
        self.llm = llm
        fmt = llm.format
        text = fmt.render(messages)
        self.ids: list[int] = fmt.encode(text)
        self.pending_ids: list[int] = list(self.ids)
        self.pending_text = text
        limits = [x for x in (limit, llm.max_model_len) if x is not None]
        self.limit = min(limits) if limits else None
        self.last_token: int | None = None

    def __len__(self) -> int:
        return len(self.ids)

    async def respond(self, params: SamplingParams) -> _Response:
        if self.limit is not None:
            room = self.limit - len(self.ids)
            if room < 1:
                raise ContextFull(f"the trajectory reached its limit of {self.limit} tokens")
            if params.max_new_tokens > room:
                params = SamplingParams(**{**params.__dict__, "max_new_tokens": room})
        out = await self.llm._generate(self.ids, params)
        ids = [int(t) for t in out.token_ids]
        lps = [float(x) for x in out.log_probs] if out.log_probs is not None else [0.0] * len(ids)
        resp = _Response(
            text=self.llm.format.decode(ids),
            token_ids=ids,
            log_probs=lps,
            finish_reason=out.finish_reason,
            prompt_ids=self.pending_ids,
            prompt_text=self.pending_text,
            num_tokens=len(ids),
        )
        self.ids = self.ids + ids
        self.pending_ids, self.pending_text = [], ""
        self.last_token = ids[-1] if ids else None
        return resp

    def add_user(self, text: str) -> bool:
        """Append the segment holding ``text``; False (nothing appended) when the sequence would leave no
        room for one more generated token."""
        fmt = self.llm.format
        last = self.last_token if self.last_token in fmt.eos_ids else None
        seg_text = fmt.continuation_text(text, last)
        seg = fmt.encode(seg_text)
        if self.limit is not None and len(self.ids) + len(seg) >= self.limit:
            return False
        self.ids = self.ids + seg
        self.pending_ids, self.pending_text = seg, seg_text
        return True


ChatFn = Callable[..., Awaitable[tuple[str, int]]]
"""``async chat(messages, max_tokens=, temperature=, top_p=, seed=, stop=) -> (text, completion tokens)``."""


class ChatLLM:
    """A message-level LLM (e.g. an OpenAI-compatible HTTP endpoint): no token ids, so its trajectories
    carry text only and cannot be trained on. Used by the inference API."""

    token_exact = False

    def __init__(self, chat: ChatFn, *, name: str = "chat"):
        self.chat = chat
        self.name = name

    def conversation(self, messages, limit: int | None) -> _ChatConversation:
        return _ChatConversation(self, messages)

    async def complete(self, prompt: str, params: SamplingParams) -> tuple[str, int]:
        return await self.chat([{"role": "user", "content": prompt}], **_chat_kwargs(params))


def _chat_kwargs(params: SamplingParams) -> dict:
    return {
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "stop": list(params.stop) or None,
    }


class _ChatConversation:
    def __init__(self, llm: ChatLLM, messages):
        self.llm = llm
        self.messages = [dict(m) for m in messages]
        self.pending_text = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in self.messages)

    def __len__(self) -> int:
        return 0

    async def respond(self, params: SamplingParams) -> _Response:
        text, n = await self.llm.chat(list(self.messages), **_chat_kwargs(params))
        self.messages.append({"role": "assistant", "content": text})
        resp = _Response(text, [], [], "stop", [], self.pending_text, int(n))
        self.pending_text = ""
        return resp

    def add_user(self, text: str) -> bool:
        self.messages.append({"role": "user", "content": text})
        self.pending_text = text
        return True


def as_llm(backend, tokenizer=None, *, name: str = "policy", max_model_len: int | None = None):
    """An `EngineLLM`/`ChatLLM` as is; an engine or a `GenerateFn` (needs ``tokenizer``) -> `EngineLLM`."""
    if isinstance(backend, (EngineLLM, ChatLLM)):
        return backend
    if tokenizer is None:
        raise ValueError(f"{name}: a tokenizer is needed to drive {type(backend).__name__} token by token")
    return EngineLLM(backend, tokenizer, max_model_len=max_model_len, name=name)


# --------------------------------------------------------------------------------------------------
# Budgets and run state


class _Budget:
    """Per-root budget, shared by the whole tree."""

    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.t0 = time.monotonic()
        self.deadline = None if cfg.max_wall_s is None else self.t0 + cfg.max_wall_s
        self.subcalls = 0
        self.tokens = 0

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def exhausted(self) -> str | None:
        cfg = self.cfg
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return f"wall-clock budget of {cfg.max_wall_s:g} s per root is spent"
        if cfg.max_tokens is not None and self.tokens >= cfg.max_tokens:
            return f"token budget of {cfg.max_tokens} generated tokens per root is spent"
        return None

    def take_subcall(self) -> str | None:
        reason = self.exhausted()
        if reason:
            return reason
        if self.cfg.max_subcalls is not None and self.subcalls >= self.cfg.max_subcalls:
            return f"sub-call budget of {self.cfg.max_subcalls} calls per root is spent"
        self.subcalls += 1
        return None

    def left(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.cfg.max_subcalls is not None:
            out["sub-calls"] = max(0, self.cfg.max_subcalls - self.subcalls)
        if self.cfg.max_tokens is not None:
            out["tokens"] = max(0, self.cfg.max_tokens - self.tokens)
        rem = self.remaining_s()
        if rem is not None:
            out["seconds"] = max(0, int(rem))
        return out


class _Run:
    """One root and its tree."""

    def __init__(self, cfg: AgentConfig, seed: int | None):
        self.budget = _Budget(cfg)
        self.trajectories: list[RLMTrajectory] = []
        self.rng = random.Random(seed) if seed is not None else None
        self.t0 = time.perf_counter()

    def next_seed(self) -> int | None:
        return None if self.rng is None else self.rng.getrandbits(62)


@dataclass
class _State:
    turn: RLMTurn | None = None


class _SandboxFailed(Exception):
    pass


@dataclass
class AgentResult:
    """A root trajectory and its whole tree (root first, children in start order)."""

    root: RLMTrajectory
    trajectories: list[RLMTrajectory]
    elapsed_s: float = 0.0

    @property
    def answer(self) -> str | None:
        return self.root.final_answer

    @property
    def children(self) -> list[RLMTrajectory]:
        return [t for t in self.trajectories if t is not self.root]


def normalize_context(context):
    """Context as the sandbox and the prompts take it: None, a str, or a list of str (numpy arrays and
    tuples from parquet rows become lists)."""
    if context is None or isinstance(context, str):
        return context
    if hasattr(context, "tolist") and not isinstance(context, (list, tuple)):
        context = context.tolist()
    if isinstance(context, (list, tuple)):
        return [c if isinstance(c, str) else str(c) for c in context]
    return str(context)


def _context_prompt(prompt: str, context) -> str:
    if context is None:
        return prompt
    ctx = context if isinstance(context, str) else "\n".join(context)
    return f"{prompt}\n\nContext:\n{ctx}"


# --------------------------------------------------------------------------------------------------
# The agent


class RLMAgent:
    """Runs RLM trajectories: ``await agent.run(query, context)`` -> `AgentResult`.

    ``policy``: the model whose turns are recorded (an `EngineLLM` for trainable, token-exact
    trajectories; a `ChatLLM` for text-only inference). ``sandbox``: a ``workers.sandbox.ReplSandbox``
    (one REPL per trajectory is created in it and closed when the trajectory ends). ``sub_llm``: the
    model answering ``llm_query`` (default: the policy); ``sub_llms``: more, chosen by
    ``llm_query(prompt, model=name)``.
    """

    def __init__(
        self,
        policy,
        sandbox,
        config: AgentConfig | None = None,
        *,
        sub_llm=None,
        sub_llms: Mapping[str, Any] | None = None,
    ):
        self.policy = policy
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
    ) -> AgentResult:
        """Run one root trajectory (and its children) to the end. Never raises for anything the model,
        its code or the sandbox does; the root's ``status`` says how it ended."""
        run = _Run(self.config, seed)
        tid = traj_id or uuid.uuid4().hex[:12]
        if "/" in tid:
            raise ValueError(f"a root trajectory id may not contain '/' (children use it), got {tid!r}")
        root = RLMTrajectory(
            id=tid, query=str(query), root_uid=str(uid if uid is not None else tid), depth=0, parent_id=None
        )
        root.metadata.update(dict(metadata or {}))
        run.trajectories.append(root)
        await self._run_trajectory(run, root, normalize_context(context), context_info)
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

    async def _run_trajectory(self, run: _Run, traj: RLMTrajectory, context, context_info=None) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        timings = {"gen_s": 0.0, "exec_s": 0.0}
        info = context_info if context_info is not None else describe_context(context)
        info = info if isinstance(info, ContextInfo) else ContextInfo.from_dict(info)
        traj.context_info = info.to_dict()
        traj.timings["start_s"] = t0 - run.t0
        state = _State()
        repl = None
        try:

            async def handler(kind: str, payload: dict) -> str:
                return await self._subcall(run, traj, state, kind, payload)

            try:
                repl = await self.sandbox.acreate(context=context, handler=handler)
            except Exception as exc:  # the sandbox cannot give this trajectory a REPL
                raise _SandboxFailed(f"could not create a REPL: {type(exc).__name__}: {exc}") from None
            max_it = cfg.iterations(traj.depth)
            messages = build_messages(
                traj.query,
                context_info=info,
                depth=traj.depth,
                max_depth=cfg.max_depth,
                config=replace(cfg.prompt, max_output_chars=cfg.max_observation_chars),
                max_iterations=max_it,
            )
            conv = self.policy.conversation(messages, cfg.max_sequence_tokens)
            for it in range(max_it):
                reason = run.budget.exhausted()
                if reason:
                    traj.status, traj.error = "budget", reason
                    break
                tg = time.perf_counter()
                try:
                    resp = await self._bounded(run, conv.respond(self._sampling(run)))
                except TimeoutError:
                    traj.status, traj.error = "budget", run.budget.exhausted() or "wall-clock budget spent"
                    break
                except ContextFull as exc:
                    traj.status, traj.error = "budget", str(exc)
                    break
                gen_s = time.perf_counter() - tg
                timings["gen_s"] += gen_s
                run.budget.tokens += resp.num_tokens
                turn = RLMTurn(
                    index=it,
                    prompt_text=resp.prompt_text,
                    response_text=resp.text,
                    prompt_token_ids=list(resp.prompt_ids),
                    response_token_ids=list(resp.token_ids),
                    response_logprobs=list(resp.log_probs),
                    timings={"start_s": tg - run.t0, "gen_s": gen_s},
                )
                if resp.finish_reason == "length":
                    turn.timings["truncated"] = 1.0
                traj.turns.append(turn)
                state.turn = turn
                parsed = parse_turn(resp.text, cfg.languages)
                turn.final = parsed.final
                te = time.perf_counter()
                results, answer = await self._execute(run, repl, parsed)
                turn.code_results = results
                exec_s = time.perf_counter() - te
                turn.timings["exec_s"] = exec_s
                timings["exec_s"] += exec_s
                if answer is not None:
                    traj.final_answer, traj.status = answer, "finished"
                    break
                if it == max_it - 1:
                    traj.status = "max_iterations"
                    break
                obs = format_observation(
                    results,
                    cfg.max_observation_chars,
                    iteration=it + 1,
                    max_iterations=max_it,
                    budget=run.budget.left() or None,
                    turn=parsed,
                    show_variables=cfg.show_variables,
                )
                if not conv.add_user(obs):
                    traj.status = "budget"
                    traj.error = "the next observation does not fit under the trajectory's token limit"
                    break
        except _SandboxFailed as exc:
            traj.status, traj.error = "error", f"sandbox: {exc}"
        except asyncio.CancelledError:
            traj.status, traj.error = "error", "cancelled"
            raise
        except Exception as exc:  # a bug or an engine failure: this trajectory fails, not the run
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            traj.status, traj.error = "error", tb
        finally:
            if traj.status == "running":
                traj.status = "error"
                traj.error = traj.error or "the agent loop ended without a status"
            if repl is not None:
                try:
                    await repl.aclose()
                except Exception:  # closing a dead REPL must not hide the trajectory's result
                    pass
            timings["total_s"] = time.perf_counter() - t0
            traj.timings.update(timings)

    async def _execute(self, run: _Run, repl, parsed) -> tuple[list[CodeResult], str | None]:
        """Run the turn's blocks in order, then apply an outside FINAL/FINAL_VAR line."""
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
            if res.killed and not res.restarted:
                raise _SandboxFailed(res.error or "the REPL died and could not be restarted")
            return CodeResult(
                code=code,
                stdout=res.stdout,
                stderr=res.stderr,
                error=res.error,
                variables={str(n): str(t) for n, t in res.variables},
                final_answer=res.final_answer,
                elapsed_s=res.elapsed_s,
                timed_out=res.timed_out,
            )

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

    async def _subcall(self, run: _Run, traj: RLMTrajectory, state: _State, kind: str, payload: dict) -> str:
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
                    text, n = await self._bounded(run, llm.complete(prompt, self._sampling(run, sub=True)))
                    run.budget.tokens += n
                    record["tokens"] = n
                    result = text
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
        return result

    async def _child(self, run: _Run, parent: RLMTrajectory, state: _State, prompt, context, record) -> str:
        child = RLMTrajectory(
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


class LoopThread:
    """A private event loop on a daemon thread: ``run(coro)`` from any thread (also one whose own loop is
    running, as in a Ray actor or a notebook) waits for the result. The env worker and the inference API
    keep one for their lifetime, so engines and sandboxes stay bound to the same loop across calls."""

    def __init__(self, name: str = "rlm-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro):
        if not self._thread.is_alive():
            raise RuntimeError("the loop thread is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


# --------------------------------------------------------------------------------------------------
# A scripted policy (tests, benchmarks, demos)


def scripted_generate(
    tokenizer,
    respond: Callable[[str], str],
    *,
    log_prob: float = -0.5,
    tokenization: str = "bpe",
    add_eos: bool = True,
    delay_s: float = 0.0,
) -> GenerateFn:
    """A `GenerateFn` that answers ``respond(prompt text)`` instead of sampling a model.

    The prompt ids are decoded (special tokens kept, so the chat structure is visible to ``respond``);
    the reply is tokenised (``tokenization="bpe"``: the tokenizer's own encoding; ``"chars"``: each
    character encoded alone -- a valid but non-canonical token sequence that re-tokenising the text
    would *not* reproduce) and ended with the EOS token, unless ``max_new_tokens`` cuts it first
    (finish_reason "length"). Every token gets ``log_prob``. ``delay_s`` simulates generation time.
    """
    if tokenization not in ("bpe", "chars"):
        raise ValueError(f"tokenization must be 'bpe' or 'chars', got {tokenization!r}")
    eos = tokenizer.eos_token_id

    async def generate(prompt_ids, params: SamplingParams) -> GenerationOutput:
        text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        reply = respond(text)
        if inspect.isawaitable(reply):
            reply = await reply
        if tokenization == "bpe":
            ids = list(tokenizer.encode(reply, add_special_tokens=False))
        else:
            ids = [t for ch in reply for t in tokenizer.encode(ch, add_special_tokens=False)]
        if add_eos and eos is not None:
            ids.append(int(eos))
        finish = "stop"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        if delay_s:
            await asyncio.sleep(delay_s)
        else:
            await asyncio.sleep(0)
        return GenerationOutput(
            token_ids=ids,
            log_probs=[log_prob] * len(ids) if params.logprobs else None,
            finish_reason=finish,
            text=tokenizer.decode(ids, skip_special_tokens=True),
        )

    return generate


class ReplayScript:
    """A ``respond(prompt_text) -> str`` for `scripted_generate` that replays fixed turns (tests, benchmarks,
    demos such as replaying a task's ``extra_info["reference_turns"]``).

    ``by_query``: ``{query: [turn 1 text, turn 2 text, ...]}``; a prompt containing a query is that
    agent's conversation (the query that occurs first wins, the longest among equals: the agent's own
    query precedes its history, which may quote other queries) -- roots and ``rlm_query`` children alike (a child's query
    is the ``rlm_query`` prompt) -- and its turn number is the count of ``turn_marker`` (the template's
    assistant header) in the prompt minus one; past the last text the last one repeats. Any other prompt
    is a plain ``llm_query`` completion and gets ``sub(prompt_text)`` (default: ``"ok"``).
    """

    def __init__(
        self,
        by_query: Mapping[str, Sequence[str]],
        sub: Callable[[str], str] | None = None,
        turn_marker: str = "<|im_start|>assistant",
    ):
        self.by_query = {str(k): list(v) for k, v in by_query.items()}
        self.order = sorted(self.by_query, key=len, reverse=True)
        self.sub = sub
        self.turn_marker = turn_marker

    def __call__(self, prompt_text: str) -> str:
        found = [(prompt_text.find(q), -len(q), q) for q in self.order if q in prompt_text]
        if not found:
            return self.sub(prompt_text) if self.sub is not None else "ok"
        turns = self.by_query[min(found)[2]]
        k = max(prompt_text.count(self.turn_marker) - 1, 0)
        return turns[min(k, len(turns) - 1)]
