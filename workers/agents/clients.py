"""The LM clients behind ``RLM(backend=..., backend_kwargs=...)``: ``make_llm(backend, backend_kwargs)`` builds one.

Backends (each builds an `EngineLLM`, token-exact and trainable, or a `ChatLLM`, text only):

* ``openai``: any OpenAI-compatible server (OpenAI, vLLM/SGLang servers, OpenRouter, gateways) through the
  official ``openai`` library (``AsyncOpenAI``) -> `ChatLLM`;
* ``gemini``: Google's OpenAI-compatible Gemini endpoint; ``vercel``: the Vercel AI Gateway -- presets of the
  same client (default ``base_url`` and key variable) -> `ChatLLM`;
* ``azure_openai``: an Azure OpenAI deployment (``openai.AsyncAzureOpenAI``; ``model_name`` is the deployment,
  ``base_url`` the resource endpoint, ``api_version``) -> `ChatLLM`;
* ``anthropic``: the Anthropic Messages API through the official ``anthropic`` library -> `ChatLLM`;
* ``native``: a Hugging Face checkpoint on our ``NativeEngine``, in this process -> `EngineLLM`;
* ``sglang``: a checkpoint on SGLang's offline engine (``SGLangRollout``) -> `EngineLLM`;
* any rollout engine's ``"package.module:Class"`` (the same registry as ``rollout.name``: `RolloutEngine.for_inference`).

``backend_kwargs`` of the HTTP backends: ``model_name`` (required), ``api_key``, ``api_key_env`` (the name of an
environment variable holding the key), ``base_url``, ``timeout`` (seconds per request), ``max_retries`` (the
library retries connection errors, 408/409/429 and 5xx answers with exponential backoff; default 2),
``default_headers`` (sent with every request), ``extra_body`` (merged into every request's JSON body).

API keys: an explicit ``api_key`` (or ``api_key_env``) is sent wherever ``base_url`` points. Without one, a
provider's variable is read only for that provider's own host (``base_url`` unset: OpenAI's or Anthropic's):
``OPENAI_API_KEY`` for api.openai.com, ``OPENROUTER_API_KEY`` for openrouter.ai, ``ANTHROPIC_API_KEY`` for
api.anthropic.com, ``GEMINI_API_KEY`` for generativelanguage.googleapis.com, ``AI_GATEWAY_API_KEY`` for
ai-gateway.vercel.sh, ``AZURE_OPENAI_API_KEY`` for hosts under openai.azure.com; any other URL (a vLLM/SGLang
server, a proxy, a gateway such as Portkey: pass its headers in ``default_headers``) gets no key unless you pass
one.

``backend_kwargs`` of the engine backends: ``model_name`` (the checkpoint path) and the engine's ``inference_options()``
(``EngineConfig`` for native: ``max_num_seqs``, ``max_model_len``, ``device``, ``seed``...; ``SGLangRolloutConfig``
for sglang: ``device``, ``tp_size``, ``mem_fraction_static``...).

A bad backend or key raises ``ValueError`` naming it when the client is built; a failing call raises
`LLMClientError`, whose message names the backend, the model and the URL (e.g. ``backend 'openai' (model m) at
http://127.0.0.1:9/v1: connection failed (Connection refused) after 3 attempts``).
"""

from __future__ import annotations

import asyncio
import os
import re
import weakref
from typing import Any
from urllib.parse import urlsplit

from workers.agents.llm import ChatLLM, Completion, ContextFull, EngineLLM
from workers.models import load_tokenizer
from workers.rollout.base import RolloutEngine
from workers.rollout.registry import ROLLOUT_ENGINES, rollout_engine_class

__all__ = [
    "BACKENDS",
    "AnthropicChat",
    "AzureOpenAIChat",
    "GeminiChat",
    "VercelChat",
    "LLMClientError",
    "OpenAIChat",
    "close_llm",
    "engine_loop",
    "make_llm",
]

BACKENDS = ("openai", "gemini", "vercel", "azure_openai", "anthropic", *ROLLOUT_ENGINES)
HTTP_KWARGS = (
    "model_name",
    "api_key",
    "api_key_env",
    "base_url",
    "timeout",
    "max_retries",
    "default_headers",
    "extra_body",
)


class LLMClientError(RuntimeError):
    """A model call failed; the message names the backend, the model and the URL."""


def make_llm(backend: str, backend_kwargs: dict[str, Any] | None) -> EngineLLM | ChatLLM:
    """The LLM of ``backend`` (one of `BACKENDS`, or a rollout engine's ``"package.module:Class"``) built from
    ``backend_kwargs`` (see the module docstring). Raises ``ValueError`` naming the backend and the offending
    key."""
    kwargs = dict(backend_kwargs or {})
    if backend not in BACKENDS and ":" not in backend:
        raise ValueError(
            f"unknown backend {backend!r}; choose one of {list(BACKENDS)} or a rollout engine's 'package.module:Class'"
        )
    model = kwargs.pop("model_name", None)
    if not model or not isinstance(model, str):
        raise ValueError(
            f"backend {backend!r} needs backend_kwargs['model_name'] (a non-empty str), got {model!r}"
        )
    if backend in _CHAT_CLIENTS:
        client = _CHAT_CLIENTS[backend]
        _check_keys(backend, kwargs, HTTP_KWARGS + client.extra_kwargs)
        return ChatLLM(client(model, **kwargs), name=model)
    engine_cls = rollout_engine_class(backend)  # a token engine, the same ones rollout.name chooses
    _check_keys(backend, kwargs, ("model_name", *engine_cls.inference_options()))
    tokenizer = load_tokenizer(model)
    return EngineLLM(engine_cls.for_inference(model, tokenizer, **kwargs), tokenizer, name=model)


def _check_keys(backend: str, kwargs: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(
            f"backend {backend!r}: unknown backend_kwargs {unknown}; accepted: {sorted(set(allowed))}"
        )


def close_llm(llm: EngineLLM | ChatLLM) -> None:
    """Release what `make_llm` built: an HTTP client's connections, an engine and its processes."""
    if isinstance(llm, ChatLLM) and isinstance(llm.chat, _HTTPChat):
        llm.chat.close()
    elif isinstance(llm, EngineLLM) and llm.engine is not None:
        llm.engine.shutdown()


def engine_loop(llm) -> asyncio.AbstractEventLoop | None:
    """The event loop ``llm``'s engine must be driven on (SGLang's adapter reads its replies on its engine's
    loop), or None where any loop will do."""
    engine = getattr(llm, "engine", None)
    return engine.event_loop if isinstance(engine, RolloutEngine) else None


# --------------------------------------------------------------------------------------------------
# HTTP chat clients (official libraries)


async def _no_api_key() -> str:
    """The OpenAI client's key provider for a server that takes no key (the client then sends no header)."""
    return ""


class _HTTPChat:
    """What the two HTTP clients share: configuration, the API-key rule, one library client per event loop
    (an async HTTP connection pool belongs to the loop it was opened on), and errors that name the endpoint.
    Subclasses set ``backend``, ``default_url``, ``key_envs`` and implement ``_new_client`` and ``__call__``."""

    backend = ""
    default_url = ""
    key_envs: dict[str, str] = {}  # host (or ".suffix" of hosts) -> the variable holding that provider's key
    extra_kwargs: tuple[str, ...] = ()  # backend_kwargs of this backend only

    def __init__(
        self,
        model_name: str,
        *,
        api_key: str | None = None,
        api_key_env: str | None = None,
        base_url: str | None = None,
        timeout: float = 300.0,
        max_retries: int = 2,
        default_headers: dict[str, str] | None = None,
        extra_body: dict[str, Any] | None = None,
    ):
        self.model = model_name
        self.base_url = base_url
        self.url = base_url or self.default_url
        if api_key is not None and api_key_env is not None:
            raise ValueError(f"backend {self.backend!r}: pass api_key or api_key_env, not both")
        if api_key_env is not None:
            api_key = os.environ.get(api_key_env)
            if not api_key:
                raise ValueError(
                    f"backend {self.backend!r}: api_key_env={api_key_env!r}: that environment variable is not set"
                )
        elif api_key is None and (env := self._key_env(urlsplit(self.url).hostname or "")):
            # the provider's own key, for the provider's own host only
            api_key = os.environ.get(env)
        self.api_key = api_key or None
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(
                f"backend {self.backend!r}: max_retries must be an int >= 0, got {max_retries!r}"
            )
        if not timeout or timeout <= 0:
            raise ValueError(f"backend {self.backend!r}: timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self.default_headers = dict(default_headers or {})
        self.extra_body = dict(extra_body or {})
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()

    def _key_env(self, host: str) -> str | None:
        for pattern, env in self.key_envs.items():
            if host == pattern or (pattern.startswith(".") and host.endswith(pattern)):
                return env
        return None

    def _new_client(self):
        raise NotImplementedError

    def client(self):
        """The library client for the running event loop."""
        loop = asyncio.get_running_loop()
        c = self._clients.get(loop)
        if c is None:
            c = self._clients[loop] = self._new_client()
        return c

    def close(self) -> None:
        """Close the library clients, each on its own loop where that loop can still run it."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for loop, c in list(self._clients.items()):
            del self._clients[loop]
            if loop.is_closed() or loop is here:  # (a loop cannot wait for itself here: dropped)
                continue
            if loop.is_running():
                asyncio.run_coroutine_threadsafe(c.close(), loop).result(timeout=10)
            else:
                loop.run_until_complete(c.close())

    def where(self) -> str:
        return f"backend {self.backend!r} (model {self.model}) at {self.url}"

    def error(self, exc: BaseException, errors) -> LLMClientError:
        """``exc`` (raised by the library whose exception classes are the module ``errors``) as an
        `LLMClientError` naming the endpoint and how many attempts were made."""
        retried = isinstance(exc, errors.APIConnectionError)
        if isinstance(exc, errors.APITimeoutError):
            reason = f"no answer within the timeout of {self.timeout:g}s"
        elif isinstance(exc, errors.APIConnectionError):
            cause = exc.__cause__ or exc.__context__
            reason = f"connection failed ({_root_message(cause) if cause else exc})"
        elif isinstance(exc, errors.APIStatusError):
            code = exc.status_code
            retried = code in (408, 409, 429) or code >= 500
            reason = f"HTTP {code}: {str(exc)[:500]}"
        else:
            reason = f"{type(exc).__name__}: {exc}"
        attempts = self.max_retries + 1 if retried else 1
        tail = f" after {attempts} attempts" if attempts > 1 else ""
        return LLMClientError(f"{self.where()}: {reason}{tail}")


def _root_message(exc: BaseException) -> str:
    """The innermost cause's message (e.g. "[Errno 111] Connection refused" under two wrapping errors)."""
    seen = {id(exc)}
    inner = exc.__cause__ or exc.__context__
    while inner is not None and id(inner) not in seen:
        exc, seen = inner, seen | {id(inner)}
        inner = exc.__cause__ or exc.__context__
    return str(exc) or type(exc).__name__


# A server's refusal of a request longer than the model's window, with its own token counts. SGLang: "maximum
# context length of 2048 tokens ... 1897 tokens from the input messages", or when the messages alone are too long
# "The input (2160 tokens) is longer than the model's context length (2048 tokens)"; vLLM: "maximum context length
# is 2048 tokens ... (1897 in the messages, 512 in the completion)" or "... your request has 2160 input tokens"
_WINDOW = re.compile(r"maximum context length (?:of |is )(\d+)|context length \((\d+) tokens\)")
_INPUT_TOKENS = re.compile(
    r"(\d+) tokens from the input messages|\((\d+) in the messages|input \((\d+) tokens\)|has (\d+) input tokens"
)


def context_overflow(message: str) -> tuple[int, int] | None:
    """(the model's window, tokens the messages take) read from a server's context-length refusal (SGLang's and
    vLLM's wordings); None for any other error."""
    window, used = _WINDOW.search(message), _INPUT_TOKENS.search(message)
    if not (window and used):
        return None
    return int(next(g for g in window.groups() if g)), int(next(g for g in used.groups() if g))


class OpenAIChat(_HTTPChat):
    """A `ChatFn` over ``POST {base_url}/chat/completions`` with ``openai.AsyncOpenAI`` (``base_url`` ends in
    ``/v1`` for vLLM/SGLang servers, e.g. ``http://host:8000/v1``); ``choices`` draws n answers in one request.

    A request whose ``max_tokens`` would pass the model's context window is asked again with what is left (the
    server's own count of the messages' tokens, from its refusal), so a conversation uses its window to the end;
    when the messages alone fill it, ``ContextFull`` says so (an agent ends that trajectory with status
    ``"budget"``, a sub-call returns it as an error string) instead of the server's 400."""

    backend = "openai"
    default_url = "https://api.openai.com/v1"
    key_envs = {"api.openai.com": "OPENAI_API_KEY", "openrouter.ai": "OPENROUTER_API_KEY"}

    def _new_client(self):
        import openai  # imported on first use, as anthropic: the recipes import this module, few use the backend

        options: dict[str, Any] = dict(
            base_url=self.url,
            timeout=self.timeout,
            max_retries=self.max_retries,
            default_headers=self.default_headers or None,
        )
        try:
            # "" (not None): the library would otherwise read OPENAI_API_KEY itself, for any URL; "" sends none
            return openai.AsyncOpenAI(api_key=self.api_key or "", **options)
        except openai.OpenAIError:
            if self.api_key:
                raise
        # openai 3.5x refuses a client without credentials: a key provider that returns "" builds one, and each
        # request omits the Authorization header on purpose (__call__)
        return openai.AsyncOpenAI(api_key=_no_api_key, **options)

    async def _create(self, messages, *, n: int, max_tokens, temperature, top_p=1.0, seed=None, stop=None):
        body: dict[str, Any] = {
            "model": self.model,
            "messages": list(messages),
            "max_completion_tokens": int(max_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
        }
        if n != 1:
            body["n"] = int(n)
        if seed is not None:
            body["seed"] = int(seed) % (2**31)
        if stop:
            body["stop"] = list(stop)
        import openai  # see _new_client

        try:
            no_key = None if self.api_key else {"Authorization": openai.Omit()}  # a keyless server: send none
            resp = await self.client().chat.completions.create(
                **body, extra_body=self.extra_body or None, extra_headers=no_key
            )
        except openai.BadRequestError as exc:
            fit = context_overflow(str(exc))
            if fit is None:
                raise self.error(exc, openai) from exc
            window, used = fit
            if window - used < 1:
                raise ContextFull(
                    f"{self.where()}: the model's context window of {window} tokens is full (the messages take "
                    f"{used})"
                ) from None
            if window - used >= int(max_tokens):  # refused for another reason than this request's length
                raise self.error(exc, openai) from exc
            return await self._create(
                messages,
                n=n,
                max_tokens=window - used,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                stop=stop,
            )
        except openai.OpenAIError as exc:
            raise self.error(exc, openai) from exc
        if not isinstance(getattr(resp, "choices", None), list) or not resp.choices:
            raise LLMClientError(f"{self.where()}: not a chat completion: {str(resp)[:300]}")
        return resp

    async def __call__(
        self, messages, *, max_tokens, temperature, top_p=1.0, seed=None, stop=None
    ) -> Completion:
        resp = await self._create(
            messages, n=1, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop
        )
        choice = resp.choices[0]
        text = choice.message.content or ""
        usage = resp.usage
        return Completion(
            text,
            # a server that reports no usage: a rough estimate, so that token budgets still bind
            int(usage.completion_tokens) if usage else max(1, len(text) // 4),
            int(usage.prompt_tokens or 0) if usage else 0,
            resp.model or self.model,
            finish_reason=choice.finish_reason or "stop",
        )

    async def choices(self, messages, n: int, *, max_tokens, temperature, seed=None) -> list[str]:
        """Up to ``n`` answers to ``messages`` from one request (a server may return fewer)."""
        resp = await self._create(messages, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
        return [c.message.content or "" for c in resp.choices]


class GeminiChat(OpenAIChat):
    """Gemini through Google's OpenAI-compatible endpoint (rlms uses Google's own SDK; the wire format is the
    OpenAI one, so the same client serves)."""

    backend = "gemini"
    default_url = "https://generativelanguage.googleapis.com/v1beta/openai"
    key_envs = {"generativelanguage.googleapis.com": "GEMINI_API_KEY"}


class VercelChat(OpenAIChat):
    """Models behind the Vercel AI Gateway (OpenAI-compatible; ``model_name`` like ``"openai/gpt-5"``)."""

    backend = "vercel"
    default_url = "https://ai-gateway.vercel.sh/v1"
    key_envs = {"ai-gateway.vercel.sh": "AI_GATEWAY_API_KEY"}


class AzureOpenAIChat(OpenAIChat):
    """An Azure OpenAI deployment (``openai.AsyncAzureOpenAI``): ``model_name`` is the deployment, ``base_url``
    the resource endpoint (``https://<resource>.openai.azure.com``, required), ``api_version`` the API
    version; the key travels in Azure's ``api-key`` header."""

    backend = "azure_openai"
    key_envs = {".openai.azure.com": "AZURE_OPENAI_API_KEY"}
    extra_kwargs = ("api_version",)

    def __init__(self, model_name: str, *, api_version: str = "2024-10-21", **kwargs):
        if not kwargs.get("base_url"):
            raise ValueError(
                "backend 'azure_openai' needs backend_kwargs['base_url'] (https://<resource>.openai.azure.com)"
            )
        super().__init__(model_name, **kwargs)
        self.api_version = api_version

    def _new_client(self):
        import openai  # see OpenAIChat._new_client

        return openai.AsyncAzureOpenAI(
            api_key=self.api_key or "",
            azure_endpoint=self.url,
            azure_deployment=self.model,
            api_version=self.api_version,
            timeout=self.timeout,
            max_retries=self.max_retries,
            default_headers=self.default_headers or None,
        )


class AnthropicChat(_HTTPChat):
    """A `ChatFn` over the Anthropic Messages API (``anthropic.AsyncAnthropic``): system messages go in
    ``system=``, ``stop`` in ``stop_sequences``, ``max_tokens`` (required by the API) is the call's limit.
    Sampling is the model's own: the current SDK's ``messages.create`` takes no temperature, top_p or seed, so
    they are not sent; put them in ``extra_body`` (e.g. ``{"temperature": 0.5}``) for a server that takes them."""

    backend = "anthropic"
    default_url = "https://api.anthropic.com"
    key_envs = {"api.anthropic.com": "ANTHROPIC_API_KEY"}

    def _new_client(self):
        import anthropic  # imported on first use: ~1 s, and only this backend needs it

        headers = dict(self.default_headers)
        if self.api_key is None:
            # no key for this URL: say so, or the library would look for one in the environment
            headers["Authorization"] = anthropic.Omit()  # type: ignore[assignment]
        return anthropic.AsyncAnthropic(
            api_key=self.api_key,
            base_url=self.url,
            timeout=self.timeout,
            max_retries=self.max_retries,
            default_headers=headers or None,
        )

    async def __call__(
        self, messages, *, max_tokens, temperature, top_p=1.0, seed=None, stop=None
    ) -> Completion:
        import anthropic  # see _new_client

        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [
                {"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"
            ],
            "max_tokens": int(max_tokens),
        }
        if system:
            body["system"] = system
        if stop:
            body["stop_sequences"] = list(stop)
        try:
            resp = await self.client().messages.create(**body, extra_body=self.extra_body or None)
        except anthropic.AnthropicError as exc:
            raise self.error(exc, anthropic) from exc
        text = "".join(
            getattr(b, "text", "") for b in (resp.content or []) if getattr(b, "type", "") == "text"
        )
        usage = resp.usage
        return Completion(
            text,
            int(usage.output_tokens) if usage else max(1, len(text) // 4),
            int(usage.input_tokens or 0) if usage else 0,
            resp.model or self.model,
            finish_reason="length" if resp.stop_reason == "max_tokens" else "stop",
        )


_CHAT_CLIENTS: dict[str, type[OpenAIChat] | type[AnthropicChat]] = {
    "openai": OpenAIChat,
    "gemini": GeminiChat,
    "vercel": VercelChat,
    "azure_openai": AzureOpenAIChat,
    "anthropic": AnthropicChat,
}
