"""The OpenAI wire format the endpoint speaks (``workers.agents.gateway``): requests read and checked, responses
and stream chunks written. Pure Python: no engine, tokenizer or HTTP library here.

A request that hyflow cannot honour exactly is refused with an `APIError` (a 4xx with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``) rather than half-served: ``n`` other than 1, penalties,
``logit_bias``, ``top_logprobs``, a forced ``tool_choice``, a ``response_format`` other than text, an unknown
field. What is accepted and ignored is listed in ``IGNORED``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.agents.tool_calls import ParsedTurn, normalize_tools

__all__ = [
    "APIError",
    "ChatRequest",
    "CompletionRequest",
    "IGNORED",
    "Sampling",
    "canonical_message",
    "chat_chunks",
    "chat_response",
    "completion_chunks",
    "completion_response",
    "error_body",
]

# fields a client may send that change nothing here (bookkeeping, or a choice the model's own text makes)
IGNORED = frozenset(("user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"))
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return {
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _number(body: Mapping, key: str, lo: float, hi: float, default: float | None) -> float | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise _bad(f"'{key}' must be a number in [{lo}, {hi}], got {value!r}", key)
    return float(value)


def _int(body: Mapping, key: str, lo: int, default: int | None = None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _bad(f"'{key}' must be an integer >= {lo}, got {value!r}", key)
    return value


def _unsupported(body: Mapping, key: str, allowed: Sequence[Any], why: str) -> None:
    if key in body and body[key] not in allowed:
        raise _bad(f"'{key}'={body[key]!r} is not supported: {why}", key, "unsupported_parameter")


@dataclass
class Sampling:
    """The sampling a request asks for (None: the server's default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False


def _sampling(body: Mapping, max_tokens_keys: Sequence[str], logprobs: bool) -> Sampling:
    max_tokens = None
    for key in max_tokens_keys:
        max_tokens = _int(body, key, 1) if body.get(key) is not None else max_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise _bad(f"'stop' must be a string or a list of non-empty strings, got {stop!r}", "stop")
    _unsupported(body, "n", (1, None), "one choice per request (send n requests; each is sampled on its own)")
    for key in ("presence_penalty", "frequency_penalty"):
        _unsupported(body, key, (0, 0.0, None), "the engine samples from the policy's own distribution")
    _unsupported(body, "logit_bias", (None, {}), "the engine samples from the policy's own distribution")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad(f"'seed' must be an integer, got {seed!r}", "seed")
    top_k = _int(body, "top_k", -1)
    if top_k == 0:
        raise _bad("'top_k' must be -1 (off) or >= 1, got 0", "top_k")
    return Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0, None),
        top_p=_number(body, "top_p", 1e-9, 1.0, None),
        top_k=top_k,
        seed=seed,
        stop=list(stop or []),
        logprobs=logprobs,
    )


def _check_fields(body: Mapping, known: frozenset[str]) -> None:
    unknown = sorted(set(body) - known - IGNORED)
    if unknown:
        raise _bad(f"unrecognized request argument(s) supplied: {unknown}", unknown[0], "unknown_parameter")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (``{"type": "text", "text": ...}``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise _bad(f"{where}.content: only text parts are supported, got {part!r}", where)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}", where
    )


def _tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise _bad(f"{where}: a tool call needs function.name, got {call!r}", where)
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError as e:
        raise _bad(f"{where}.function.arguments is not JSON: {e}", where) from None
    return {"id": str(call.get("id", "")), "name": fn["name"], "arguments": parsed}


def canonical_message(message: Any, where: str = "messages") -> dict:
    """A chat message as the template sees it (role, text content, name, tool_call_id, tool_calls with their
    arguments decoded), the ``None`` fields and client-side extras (``refusal``, ``audio``) dropped: two messages
    the template renders alike compare equal."""
    if not isinstance(message, Mapping):
        raise _bad(f"{where} must be an object with 'role' and 'content', got {message!r}", where)
    role = message.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role must be one of {list(ROLES)}, got {role!r}", where)
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = str(message[key])
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise _bad(f"{where}.tool_calls: only an assistant message has a list of tool calls", where)
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    return out


def template_message(message: Mapping) -> dict:
    """A canonical message in the form chat templates read (tool calls as ``{"type", "function": {"name",
    "arguments"}}`` with the arguments an object, as Hugging Face templates expect)."""
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in message["tool_calls"]
        ]
    return out


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]  # canonical (``canonical_message``)
    tools: list[dict] | None
    parse_tools: bool  # tool_choice "auto" (default with tools): the reply's calls become ``tool_calls``
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    trajectory_id: str | None = None  # the body's ``trajectory_id`` (extra_body)

    @classmethod
    def parse(cls, body: Any) -> ChatRequest:
        if not isinstance(body, Mapping):
            raise _bad("the request body must be a JSON object")
        known = frozenset(
            (
                "model",
                "messages",
                "tools",
                "tool_choice",
                "max_tokens",
                "max_completion_tokens",
                "temperature",
            )
            + (
                "top_p",
                "top_k",
                "seed",
                "stop",
                "n",
                "stream",
                "logprobs",
                "top_logprobs",
                "presence_penalty",
            )
            + ("frequency_penalty", "logit_bias", "response_format", "trajectory_id")
        )
        _check_fields(body, known)
        model = _model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list of chat messages", "messages")
        canon = [canonical_message(m, f"messages[{k}]") for k, m in enumerate(messages)]
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list):
                raise _bad("'tools' must be a list of function schemas", "tools")
            try:
                tools = normalize_tools(tools) or None
            except (TypeError, ValueError) as e:
                raise _bad(f"'tools': {e}", "tools") from None
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise _bad(
                f"'tool_choice'={choice!r} is not supported: the model's own text decides whether it calls a tool "
                "(use 'auto' or 'none')",
                "tool_choice",
                "unsupported_parameter",
            )
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
            raise _bad(
                "'response_format' other than text is not supported (no constrained decoding)",
                "response_format",
                "unsupported_parameter",
            )
        _unsupported(body, "top_logprobs", (None, 0), "only the sampled token's log-prob is returned")
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise _bad(f"'logprobs' must be a boolean, got {logprobs!r}", "logprobs")
        stream, options = _stream(body)
        return cls(
            model=model,
            messages=canon,
            tools=tools,
            parse_tools=bool(tools) and choice != "none",
            sampling=_sampling(body, ("max_tokens", "max_completion_tokens"), logprobs),
            stream=stream,
            include_usage=bool(options.get("include_usage")),
            trajectory_id=_trajectory_id(body),
        )


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    trajectory_id: str | None = None

    @classmethod
    def parse(cls, body: Any) -> CompletionRequest:
        if not isinstance(body, Mapping):
            raise _bad("the request body must be a JSON object")
        known = frozenset(
            ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream")
            + ("logprobs", "echo", "suffix", "best_of", "presence_penalty", "frequency_penalty", "logit_bias")
            + ("trajectory_id",)
        )
        _check_fields(body, known)
        model = _model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        ok_ids = isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise _bad(
                "'prompt' must be a non-empty string or list of token ids (one prompt per request)", "prompt"
            )
        _unsupported(body, "echo", (None, False), "the reply holds the completion only")
        _unsupported(body, "suffix", (None, ""), "no insertion mode")
        _unsupported(body, "best_of", (None, 1), "one sample per request")
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or logprobs not in (0, 1)):
            raise _bad(
                f"'logprobs'={logprobs!r} is not supported: 0 or 1 (the sampled token's log-prob only)",
                "logprobs",
                "unsupported_parameter",
            )
        stream, options = _stream(body)
        sampling = _sampling(body, ("max_tokens",), logprobs is not None)
        if sampling.max_tokens is None:
            sampling.max_tokens = 16  # OpenAI's default for completions
        prompt_value: str | list[int] = prompt if isinstance(prompt, str) else [int(t) for t in prompt or []]
        return cls(
            model, prompt_value, sampling, stream, bool(options.get("include_usage")), _trajectory_id(body)
        )


def _model(body: Mapping) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string (GET /v1/models lists the served one)", "model")
    return model


def _stream(body: Mapping) -> tuple[bool, Mapping]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _bad(f"'stream' must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise _bad("'stream_options' must be an object", "stream_options")
    return stream, options


def _trajectory_id(body: Mapping) -> str | None:
    tid = body.get("trajectory_id")
    if tid is not None and (not isinstance(tid, str) or not tid):
        raise _bad(f"'trajectory_id' must be a non-empty string, got {tid!r}", "trajectory_id")
    return tid


# -- responses --------------------------------------------------------------------------------------------------


@dataclass
class Reply:
    """One generated reply, as the endpoint reports it."""

    text: str  # the decoded completion (special tokens dropped)
    token_ids: list[int]
    log_probs: list[float]
    token_texts: list[str]  # per token, for OpenAI's logprobs content
    prompt_token_ids: list[int]  # the whole prompt the engine was fed
    finish_reason: str  # "stop", "length" or "tool_calls"
    weight_version: int = 0
    parsed: ParsedTurn | None = None  # with tool parsing: the reply's prose and calls
    call_ids: list[str] = field(default_factory=list)


def assistant_message(reply: Reply) -> dict:
    """The reply as the assistant message the client receives (and is expected to send back)."""
    if reply.parsed is None or not reply.parsed.calls:
        return {"role": "assistant", "content": reply.text}
    content = reply.text if reply.parsed.malformed else reply.parsed.content
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [
            {
                "id": cid,
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for cid, c in zip(reply.call_ids, reply.parsed.calls)
        ],
    }


def _usage(reply: Reply) -> dict:
    n_prompt, n_out = len(reply.prompt_token_ids), len(reply.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _chat_logprobs(reply: Reply) -> dict:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(reply.token_texts, reply.log_probs)
        ]
    }


def _head(kind: str, model: str) -> dict:
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def chat_response(reply: Reply, model: str, logprobs: bool) -> dict:
    """A ``chat.completion`` with the extension fields (vLLM's names): ``prompt_token_ids`` and, on the choice,
    ``token_ids``; ``hyflow``: the completion's log-probs and the weight version that sampled it."""
    return {
        **_head("chat.completion", model),
        "choices": [
            {
                "index": 0,
                "message": assistant_message(reply),
                "logprobs": _chat_logprobs(reply) if logprobs else None,
                "finish_reason": reply.finish_reason,
                "token_ids": reply.token_ids,
            }
        ],
        "usage": _usage(reply),
        "prompt_token_ids": reply.prompt_token_ids,
        "hyflow": {"completion_logprobs": reply.log_probs, "weight_version": reply.weight_version},
    }


def chat_chunks(reply: Reply, model: str, logprobs: bool, include_usage: bool) -> list[dict]:
    """The reply as ``chat.completion.chunk`` events: the role, the text, each tool call, the finish reason (with
    the extension fields), then the usage when asked. The engine contract yields whole replies, so the chunks are
    sent together once the reply is complete."""
    head = _head("chat.completion.chunk", model)
    message = assistant_message(reply)

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(
            chunk({"content": message["content"]}, logprobs=_chat_logprobs(reply) if logprobs else None)
        )
    for k, call in enumerate(message.get("tool_calls", [])):
        chunks.append(chunk({"tool_calls": [{"index": k, **call}]}))
    last = chunk({}, reply.finish_reason, token_ids=reply.token_ids)
    last["prompt_token_ids"] = reply.prompt_token_ids
    last["hyflow"] = {"completion_logprobs": reply.log_probs, "weight_version": reply.weight_version}
    chunks.append(last)
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(reply)})
    return chunks


def _completion_logprobs(reply: Reply) -> dict:
    offsets, pos = [], 0
    for t in reply.token_texts:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": reply.token_texts,
        "token_logprobs": reply.log_probs,
        "top_logprobs": None,
        "text_offset": offsets,
    }


def completion_response(reply: Reply, model: str, logprobs: bool) -> dict:
    return {
        **_head("text_completion", model),
        "choices": [
            {
                "index": 0,
                "text": reply.text,
                "logprobs": _completion_logprobs(reply) if logprobs else None,
                "finish_reason": reply.finish_reason,
                "token_ids": reply.token_ids,
            }
        ],
        "usage": _usage(reply),
        "prompt_token_ids": reply.prompt_token_ids,
        "hyflow": {"completion_logprobs": reply.log_probs, "weight_version": reply.weight_version},
    }


def completion_chunks(reply: Reply, model: str, logprobs: bool, include_usage: bool) -> list[dict]:
    full = completion_response(reply, model, logprobs)
    chunks = [{**{k: full[k] for k in ("id", "object", "created", "model")}, "choices": full["choices"]}]
    chunks[0]["prompt_token_ids"] = reply.prompt_token_ids
    if include_usage:
        chunks.append(
            {
                **{k: full[k] for k in ("id", "object", "created", "model")},
                "choices": [],
                "usage": full["usage"],
            }
        )
    return chunks
