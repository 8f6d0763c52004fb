"""The LLM clients an agent talks to: one model turn at a time, in a conversation that grows by observations.

* ``EngineLLM``: token level, over a rollout engine (``NativeEngine``, ``SGLangRollout``: anything with ``async
  generate(prompt_ids, SamplingParams)``) or a `GenerateFn` (a scripted policy). Its conversations are
  token-exact: the model's tokens are exactly the engine's ``token_ids``; template/observation segments are
  tokenised by themselves (``ChatFormat``) and appended, so the records can be trained on.
* ``ChatLLM``: message level (e.g. an OpenAI-compatible HTTP endpoint): text only, for inference.

Both are `LLM`s and their conversations `Conversation`s: the two protocols below are the interface, written once.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from workers.agents.chat_format import ChatFormat
from workers.agents.limits import BudgetSpent
from workers.agents.trajectory import TrajectoryTurn
from workers.rollout.sampling import GenerationOutput, SamplingParams

__all__ = [
    "ChatConversation",
    "ChatFn",
    "ChatLLM",
    "Completion",
    "ContextFull",
    "Conversation",
    "EngineLLM",
    "LLM",
    "GenerateFn",
    "ModelResponse",
    "TokenConversation",
]

GenerateFn = Callable[[list[int], SamplingParams], Awaitable[GenerationOutput | list[GenerationOutput]]]
"""``async gen(prompt_ids, SamplingParams) -> GenerationOutput``: NativeEngine.generate, SGLangRollout.generate,
or any function with that contract (a scripted policy in tests)."""


class ContextFull(BudgetSpent):
    """The next request would not fit under the trajectory's (or the engine's) token limit."""


@dataclass
class Completion:
    """One model call's text and token usage (``prompt_tokens``: the whole request; 0 where a client does not
    report it) and why it stopped (``"stop"``, or ``"length"`` when cut at ``max_tokens``)."""

    text: str
    completion_tokens: int
    prompt_tokens: int = 0
    model: str = ""
    finish_reason: str = "stop"


@dataclass
class ModelResponse:
    text: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    prompt_ids: list[int]  # tokens appended since the previous response (the whole prompt for turn 0)
    prompt_text: str
    num_tokens: int  # generated tokens (for budgets)
    prompt_tokens: int = 0  # the whole request's prompt (usage accounting), not only ``prompt_ids``
    model: str = ""  # the LLM's name
    versions: list[int] = field(default_factory=list)  # per token: the engine's weight version (if it tracks)
    full_prompt: bool = (
        False  # ``prompt_ids`` is the whole prompt (the template rewrote the history), not a suffix
    )
    routes: Any = None  # mixture of experts: the call's expert routes (`GenerationOutput.routes`), else None

    def turn(self, index: int) -> TrajectoryTurn:
        """The record of this response as turn ``index`` of a trajectory (its environment part still empty)."""
        return TrajectoryTurn(
            index=index,
            prompt_text=self.prompt_text,
            response_text=self.text,
            prompt_token_ids=list(self.prompt_ids),
            response_token_ids=list(self.token_ids),
            response_logprobs=list(self.log_probs),
            response_versions=list(self.versions),
            usage={
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.num_tokens,
                "model": self.model,
            },
            finish_reason=self.finish_reason,
            full_prompt=self.full_prompt,
            routes=self.routes,
        )


@runtime_checkable
class Conversation(Protocol):
    """What every conversation offers an agent, the one written statement of it: `TokenConversation` (token-exact,
    trainable), `ChatConversation` (messages only, for inference) and ``workers.rlm.session.SessionConversation``
    (either, wrapped so a long RLM session is compacted) all implement it, and an agent never asks which it holds.

    ``messages`` is the history as the chat template (or the chat endpoint) sees it. ``respond`` runs one model
    turn and appends it (`ContextFull` when the next request cannot fit its token limit); ``add_messages``
    appends observations after it (``user``, ``tool``), False and nothing appended when they would leave no room
    for one more generated token; ``add_user(text)`` is ``add_messages([user: text])``; ``len()`` is the token
    count fed next (0 where the conversation has no token ids)."""

    messages: list[dict]

    def __len__(self) -> int: ...

    async def respond(self, params: SamplingParams) -> ModelResponse: ...

    def add_user(self, text: str) -> bool: ...

    def add_messages(self, messages: Sequence[dict]) -> bool: ...


@runtime_checkable
class LLM(Protocol):
    """What every LLM client offers an agent (`EngineLLM`, `ChatLLM`): ``token_exact`` says whether its
    conversations' records can be trained on; ``conversation`` starts one (``tools``: OpenAI function schemas the
    template renders; a client that cannot render them raises ValueError); ``complete`` is one plain
    ``[user: prompt]`` call."""

    name: str
    token_exact: bool

    def conversation(self, messages: Sequence[dict], limit: int | None, tools=None) -> Conversation: ...

    async def complete(self, prompt: str, params: SamplingParams) -> Completion: ...


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

    def conversation(self, messages, limit: int | None, tools=None) -> TokenConversation:
        return TokenConversation(self, messages, limit, tools)

    async def complete(self, prompt: str, params: SamplingParams) -> Completion:
        """One plain completion of ``[user: prompt]``."""
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
        return Completion(self.format.decode(out.token_ids), len(out.token_ids), len(ids), self.name)


class TokenConversation:
    """A token-exact conversation (module docstring): ``ids`` is exactly what the engine is fed next.

    ``messages`` is the history as the chat template sees it (the model's turns as the text of its own tokens,
    without the token that closed them); ``tools`` (OpenAI function schemas) are rendered by the template.
    While the template renders the grown history as the grown token sequence (``fed`` text equal to the
    template's rendering of ``messages``), new messages append only the template's text after the model's turn;
    once it does not (``rewrites``: the template rewrote an earlier turn), every turn is fed the template's full
    rendering and its record says so (``ModelResponse.full_prompt``)."""

    def __init__(self, llm: EngineLLM, messages, limit: int | None, tools=None):
        self.llm = llm
        fmt = llm.format
        self.messages = [dict(m) for m in messages]
        self.tools = list(tools) if tools else None
        text = fmt.render(self.messages, self.tools)
        self.ids: list[int] = fmt.encode(text)
        self.fed = text  # the text of ``ids``
        self.pending_ids: list[int] = list(self.ids)
        self.pending_text = text
        self.pending_full = False
        limits = [x for x in (limit, llm.max_model_len) if x is not None]
        self.limit = min(limits) if limits else None
        self.last_token: int | None = None
        self.rewrites = False  # the template rewrote history: each turn gets the full rendering

    def __len__(self) -> int:
        return len(self.ids)

    async def respond(self, params: SamplingParams) -> ModelResponse:
        if self.limit is not None:
            room = self.limit - len(self.ids)
            if room < 1:
                raise ContextFull(f"the trajectory reached its limit of {self.limit} tokens")
            if params.max_new_tokens > room:
                params = SamplingParams(**{**params.__dict__, "max_new_tokens": room})
        out = await self.llm._generate(self.ids, params)
        fmt = self.llm.format
        ids = [int(t) for t in out.token_ids]
        lps = [float(x) for x in out.log_probs] if out.log_probs is not None else [0.0] * len(ids)
        resp = ModelResponse(
            text=fmt.decode(ids),
            token_ids=ids,
            log_probs=lps,
            finish_reason=out.finish_reason,
            prompt_ids=self.pending_ids,
            prompt_text=self.pending_text,
            num_tokens=len(ids),
            prompt_tokens=len(self.ids),
            model=self.llm.name,
            versions=list(out.versions or []),
            full_prompt=self.pending_full,
            routes=out.routes,
        )
        self.ids = self.ids + ids
        self.fed += fmt.raw_text(ids)
        self.pending_ids, self.pending_text, self.pending_full = [], "", False
        self.last_token = ids[-1] if ids else None
        closed = bool(ids) and ids[-1] in fmt.eos_ids
        self.messages.append({"role": "assistant", "content": fmt.raw_text(ids[:-1] if closed else ids)})
        return resp

    def add_user(self, text: str) -> bool:
        """Append a user message holding ``text`` (``add_messages``)."""
        return self.add_messages([{"role": "user", "content": text}])

    def add_messages(self, messages) -> bool:
        """Append ``messages`` (user observations, ``tool`` results) after the model's turn and the next generation
        prompt; False (nothing appended) when the sequence would leave no room for one more generated token."""
        fmt = self.llm.format
        new = [dict(m) for m in messages]
        history = self.messages + new
        last = self.last_token if self.last_token in fmt.eos_ids else None
        if not self.rewrites:
            seg_text = fmt.continuation(self.messages, new, self.tools, last)
            # the template renders the grown history as we would grow it, or it rewrote an earlier turn
            self.rewrites = fmt.has_template and self.fed + seg_text != fmt.render(history, self.tools)
        if self.rewrites:
            full_text = fmt.render(history, self.tools)
            full = fmt.encode(full_text)
            if self.limit is not None and len(full) >= self.limit:
                return False
            self.ids, self.fed = full, full_text
            self.pending_ids, self.pending_text, self.pending_full = list(full), full_text, True
        else:
            seg = fmt.encode(seg_text)
            if self.limit is not None and len(self.ids) + len(seg) >= self.limit:
                return False
            self.ids = self.ids + seg
            self.fed += seg_text
            self.pending_ids, self.pending_text = seg, seg_text
        self.messages = history
        return True


ChatFn = Callable[..., Awaitable[Completion]]
"""``async chat(messages, max_tokens=, temperature=, top_p=, seed=, stop=) -> Completion``."""


class ChatLLM:
    """A message-level LLM (e.g. an OpenAI-compatible HTTP endpoint): no token ids, so its trajectories
    carry text only and cannot be trained on. Used by the inference API."""

    token_exact = False

    def __init__(self, chat: ChatFn, *, name: str = "chat"):
        self.chat = chat
        self.name = name

    def conversation(self, messages, limit: int | None, tools=None) -> ChatConversation:
        if tools:
            raise ValueError(
                f"{self.name!r} is a message-level client: declared tools need a token-level model whose chat "
                "template renders them (an EngineLLM over a rollout engine)"
            )
        return ChatConversation(self, messages)

    async def complete(self, prompt: str, params: SamplingParams) -> Completion:
        return await self.chat([{"role": "user", "content": prompt}], **_chat_kwargs(params))


def _chat_kwargs(params: SamplingParams) -> dict:
    return {
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "stop": list(params.stop) or None,
    }


class ChatConversation:
    def __init__(self, llm: ChatLLM, messages):
        self.llm = llm
        self.messages = [dict(m) for m in messages]
        self.pending_text = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in self.messages)

    def __len__(self) -> int:
        return 0

    async def respond(self, params: SamplingParams) -> ModelResponse:
        out = await self.llm.chat(list(self.messages), **_chat_kwargs(params))
        self.messages.append({"role": "assistant", "content": out.text})
        resp = ModelResponse(
            out.text,
            [],
            [],
            out.finish_reason,
            [],
            self.pending_text,
            int(out.completion_tokens),
            prompt_tokens=int(out.prompt_tokens),
            model=out.model or self.llm.name,
        )
        self.pending_text = ""
        return resp

    def add_user(self, text: str) -> bool:
        return self.add_messages([{"role": "user", "content": text}])

    def add_messages(self, messages) -> bool:
        new = [dict(m) for m in messages]
        self.messages += new
        self.pending_text = "\n\n".join(str(m.get("content") or "") for m in new)
        return True
