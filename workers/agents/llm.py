"""The LLM clients an agent talks to: one model turn at a time, in a conversation that grows by observations.

* ``EngineLLM``: token level, over a rollout engine (``NativeEngine``, ``SGLangRollout``: anything with ``async
  generate(prompt_ids, SamplingParams)``) or a `GenerateFn` (a scripted policy). Its conversations are
  token-exact: the model's tokens are exactly the engine's ``token_ids``; template/observation segments are
  tokenised by themselves (``ChatFormat``) and appended, so the records can be trained on.
* ``ChatLLM``: message level (e.g. an OpenAI-compatible HTTP endpoint): text only, for inference.

``conversation(messages, limit)`` starts a conversation: ``await respond(params)`` -> `ModelResponse`,
``add_user(text)`` appends an observation (False when it would not fit under the token limit);
``complete(prompt, params)`` is one plain ``[user: prompt]`` completion (a `Completion`: text and token usage).
A request that cannot fit raises `ContextFull`.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

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
    "EngineLLM",
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
        )


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

    def conversation(self, messages, limit: int | None) -> TokenConversation:
        return TokenConversation(self, messages, limit)

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

    async def respond(self, params: SamplingParams) -> ModelResponse:
        if self.limit is not None:
            room = self.limit - len(self.ids)
            if room < 1:
                raise ContextFull(f"the trajectory reached its limit of {self.limit} tokens")
            if params.max_new_tokens > room:
                params = SamplingParams(**{**params.__dict__, "max_new_tokens": room})
        out = await self.llm._generate(self.ids, params)
        ids = [int(t) for t in out.token_ids]
        lps = [float(x) for x in out.log_probs] if out.log_probs is not None else [0.0] * len(ids)
        resp = ModelResponse(
            text=self.llm.format.decode(ids),
            token_ids=ids,
            log_probs=lps,
            finish_reason=out.finish_reason,
            prompt_ids=self.pending_ids,
            prompt_text=self.pending_text,
            num_tokens=len(ids),
            prompt_tokens=len(self.ids),
            model=self.llm.name,
            versions=list(out.versions or []),
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


ChatFn = Callable[..., Awaitable[Completion]]
"""``async chat(messages, max_tokens=, temperature=, top_p=, seed=, stop=) -> Completion``."""


class ChatLLM:
    """A message-level LLM (e.g. an OpenAI-compatible HTTP endpoint): no token ids, so its trajectories
    carry text only and cannot be trained on. Used by the inference API."""

    token_exact = False

    def __init__(self, chat: ChatFn, *, name: str = "chat"):
        self.chat = chat
        self.name = name

    def conversation(self, messages, limit: int | None) -> ChatConversation:
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
        self.messages.append({"role": "user", "content": text})
        self.pending_text = text
        return True
