"""Run an RLM for inference: ``RLM(...).completion(prompt, context=...) -> RLMResult``.

The same agent loop as training (`workers.rlm.agent`), over

* a token engine -- ``NativeEngine``, the SGLang adapter (``SGLangRollout``: same ``async generate``), or
  any ``async gen(prompt_ids, SamplingParams) -> GenerationOutput`` with its ``tokenizer``;
* an OpenAI-compatible HTTP endpoint -- ``RLM(engine="http://host:port/v1", model="name")`` posts to
  ``/v1/chat/completions`` (stdlib ``urllib``, one thread per request in flight); these trajectories
  carry text only (no token ids).

::

    rlm = RLM(engine=NativeEngine.from_pretrained(path), max_depth=1, max_iterations=8,
              log_path="outputs/rlm.jsonl")
    res = rlm.completion("What is the magic number for quiet-harbor?", context=long_text)
    res.answer, res.status, res.trajectory_tree     # nested dict: root, its turns' children, ...
    rlm.close()

``sub_engine`` (same kinds) answers ``llm_query``; default: the main engine. Every completion appends its
trajectories (root first, then children) to ``log_path`` as JSONL (`workers.agents.trajectory.load_jsonl` reads
it; ``python -m workers.rlm.viewer`` renders it as HTML).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from workers.agents.batch import trajectory_json
from workers.agents.http_chat import post_json
from workers.agents.llm import ChatLLM, Completion, EngineLLM
from workers.agents.trajectory import Trajectory
from workers.event_loop import LoopThread
from workers.rlm.agent import AgentConfig, RLMAgent
from workers.rlm.usage import Usage
from workers.sandbox import ReplSandbox

__all__ = ["RLM", "OpenAIChatLLM", "RLMResult", "trajectory_tree"]


def trajectory_tree(trajectories: list[Trajectory], root_id: str | None = None) -> dict:
    """Nested summary of a run: ``{id, depth, status, answer, query, turns, elapsed_s, children: [...]}``."""
    by_id = {t.id: t for t in trajectories}
    root = by_id[root_id] if root_id is not None else next(t for t in trajectories if t.parent_id is None)

    def node(t: Trajectory) -> dict:
        return {
            "id": t.id,
            "depth": t.depth,
            "status": t.status,
            "answer": t.final_answer,
            "query": t.query,
            "turns": len(t.turns),
            "elapsed_s": t.timings.get("total_s"),
            "children": [node(by_id[c]) for c in t.children if c in by_id],
        }

    return node(root)


@dataclass
class RLMResult:
    answer: str | None
    status: str
    root: Trajectory
    trajectories: list[Trajectory] = field(default_factory=list)  # root first, children in start order
    elapsed_s: float = 0.0
    # tokens (and cost under a price table) of every model call of the tree: total, by_depth, by_model
    usage: Usage = field(default_factory=Usage)

    @property
    def trajectory_tree(self) -> dict:
        return trajectory_tree(self.trajectories, self.root.id)


# --------------------------------------------------------------------------------------------------
# OpenAI-compatible HTTP


def _chat_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


class OpenAIChatLLM(ChatLLM):
    """``POST {base_url}/v1/chat/completions`` (``base_url`` may already end in ``/v1``). The API key comes
    from ``api_key`` or the ``OPENAI_API_KEY`` environment variable (sent only when set)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        extra_body: dict[str, Any] | None = None,
    ):
        super().__init__(self._chat, name=model)
        self.url = _chat_url(base_url)
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout_s = timeout_s
        self.extra_body = dict(extra_body or {})

    def _post(self, body: dict) -> dict:
        return post_json(self.url, body, api_key=self.api_key, timeout_s=self.timeout_s, label="endpoint")

    async def _chat(self, messages, *, max_tokens, temperature, top_p=1.0, seed=None, stop=None):
        body: dict[str, Any] = {
            "model": self.model,
            "messages": list(messages),
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
            **self.extra_body,
        }
        if seed is not None:
            body["seed"] = int(seed) % (2**31)
        if stop:
            body["stop"] = list(stop)
        data = await asyncio.to_thread(self._post, body)
        try:
            text = data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"{self.url}: unexpected response {str(data)[:300]}") from None
        usage = data.get("usage") or {}
        return Completion(
            text,
            int(usage.get("completion_tokens") or max(1, len(text) // 4)),
            int(usage.get("prompt_tokens") or 0),
            self.model,
        )


# --------------------------------------------------------------------------------------------------
# The API


def _llm(backend, tokenizer, model: str | None, name: str):
    if isinstance(backend, (EngineLLM, ChatLLM)):
        return backend
    if isinstance(backend, str):
        if not backend.startswith(("http://", "https://")):
            raise ValueError(f"{name}: a string engine must be an http(s) URL, got {backend!r}")
        if not model:
            raise ValueError(f"{name}: an HTTP endpoint needs model=...")
        return OpenAIChatLLM(backend, model)
    tok = tokenizer if tokenizer is not None else getattr(backend, "tokenizer", None)
    if tok is None:
        raise ValueError(f"{name}: pass tokenizer=... (the engine does not carry one)")
    return EngineLLM(backend, tok, name=name)


class RLM:
    """A Recursive Language Model for inference. See the module docstring.

    Keyword arguments left as None keep ``agent_config``'s values (``AgentConfig`` defaults otherwise), but
    ``final_answer_on_exhaustion`` is True without an ``agent_config``: when the turns run out without an
    answer, one more model turn asks for it (status stays ``"max_iterations"``, with that answer).

    Accounting (per root, shared by the whole tree; reaching a limit ends the run with status ``"budget"``):
    ``max_total_tokens`` -- prompt + completion tokens of every model call (rlms' ``max_tokens``; not
    ``AgentConfig.max_tokens``, which counts generated tokens only); ``max_cost_usd`` -- US dollars (rlms'
    ``max_budget``), which needs ``prices={model: (usd_per_million_prompt, usd_per_million_completion)}``
    (``"*"``: any other model; prices also give ``RLMResult.usage`` its ``cost_usd``); ``max_errors`` -- turns in
    a row whose code raised, per trajectory (status ``"error"``). System prompt: ``prompt_style`` ("full",
    "compact"), ``custom_system_prompt`` (every depth) and ``system_prompts={depth: prompt}``
    (``workers.rlm.prompts`` lists their placeholders, e.g. ``{context_info}``).
    """

    def __init__(
        self,
        engine=None,
        sub_engine=None,
        tokenizer=None,
        *,
        sub_tokenizer=None,
        model: str | None = None,
        sub_model: str | None = None,
        max_depth: int | None = None,
        max_iterations: int | None = None,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        max_total_tokens: int | None = None,
        max_cost_usd: float | None = None,
        prices: dict[str, tuple[float, float]] | None = None,
        max_errors: int | None = None,
        final_answer_on_exhaustion: bool | None = None,
        custom_system_prompt: str | None = None,
        system_prompts: dict[int, str] | None = None,
        prompt_style: str | None = None,
        agent_config: AgentConfig | None = None,
        sandbox_config=None,
        sandbox=None,
        log_path: str | os.PathLike | None = None,
        log_tokens: bool = False,
    ):
        if engine is None:
            raise ValueError("RLM needs engine=... (a token engine, a generate function or an http URL)")
        self.policy = _llm(engine, tokenizer, model, "engine")
        self.sub_llm = (
            _llm(sub_engine, sub_tokenizer or tokenizer, sub_model or model, "sub_engine")
            if sub_engine is not None
            else self.policy
        )
        cfg = agent_config or AgentConfig()
        overrides = {
            k: v
            for k, v in {
                "max_depth": max_depth,
                "max_iterations": max_iterations,
                "temperature": temperature,
                "max_new_tokens": max_new_tokens,
                "max_total_tokens": max_total_tokens,
                "max_cost_usd": max_cost_usd,
                "prices": {m: list(p) for m, p in prices.items()} if prices is not None else None,
                "max_errors": max_errors,
                # inference asks for a last answer when the turns run out unless told otherwise (training: off)
                "final_answer_on_exhaustion": final_answer_on_exhaustion
                if final_answer_on_exhaustion is not None or agent_config is not None
                else True,
                "prompt": replace(
                    cfg.prompt,
                    **{
                        k: v
                        for k, v in {
                            "custom_system_prompt": custom_system_prompt,
                            "system_prompts": system_prompts,
                            "style": prompt_style,
                        }.items()
                        if v is not None
                    },
                ),
            }.items()
            if v is not None
        }
        self.config = replace(cfg, **overrides)
        self._sandbox = sandbox
        self._own_sandbox = sandbox is None
        self._sandbox_config = sandbox_config
        self.log_path = os.fspath(log_path) if log_path is not None else None
        self.log_tokens = log_tokens
        self._loop: LoopThread | None = None
        self._log_lock = threading.Lock()

    @property
    def sandbox(self):
        if self._sandbox is None:
            self._sandbox = ReplSandbox(self._sandbox_config)
        return self._sandbox

    async def acompletion(
        self,
        prompt: str,
        context=None,
        *,
        seed: int | None = None,
        uid: str | None = None,
        metadata: dict | None = None,
    ) -> RLMResult:
        """Answer ``prompt`` about ``context`` (a str, a list of str, or None)."""
        agent = RLMAgent(self.policy, self.sandbox, self.config, sub_llm=self.sub_llm)
        t0 = time.perf_counter()
        res = await agent.run(prompt, context, uid=uid, seed=seed, metadata=metadata)
        out = RLMResult(
            res.root.final_answer,
            res.root.status,
            res.root,
            res.trajectories,
            time.perf_counter() - t0,
            usage=Usage.from_dict(res.root.metadata["usage"]),
        )
        if self.log_path:
            self._log(out.trajectories)
        return out

    def completion(self, prompt: str, context=None, **kwargs) -> RLMResult:
        """Synchronous `acompletion`, run on the RLM's private event-loop thread (so it also works where an
        event loop is already running, e.g. a notebook); ``kwargs`` as for `acompletion`."""
        if self._loop is None:
            self._loop = LoopThread(name="rlm-inference")
        return self._loop.run(self.acompletion(prompt, context, **kwargs))

    def _log(self, trajectories: list[Trajectory]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        with self._log_lock, open(self.log_path, "a", encoding="utf-8") as f:
            for t in trajectories:
                f.write(trajectory_json(t, tokens=self.log_tokens) + "\n")

    def close(self) -> None:
        if self._sandbox is not None and self._own_sandbox:
            self._sandbox.close()
            self._sandbox = None
        if self._loop is not None:
            self._loop.stop()
        self._loop = None

    def __enter__(self) -> RLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
