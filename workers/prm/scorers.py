"""The language models a PRM worker can ask, each a ``Scorer``: ``complete(prompts, n, ...) -> [[text] * n]``.

* `EngineScorer`: a frozen Hugging Face checkpoint on the native rollout engine (the policy's reference --
  its initial weights -- or any other checkpoint), each prompt rendered as one user chat turn with the
  model's template; the n samples of a prompt are drawn with seeds ``seed, seed + 1, ...``.
* `HTTPScorer`: an OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint (vLLM, SGLang,
  hosted APIs) through the RLM's ``openai`` client (`workers.agents.clients.OpenAIChat`: retries with
  backoff, errors naming the endpoint); ``n`` choices per request (requests repeated when the server returns
  fewer), at most ``max_workers`` prompts in flight, the API key from an environment variable.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence

from workers.agents.chat_format import ChatFormat
from workers.agents.clients import OpenAIChat
from workers.distributed import default_device
from workers.event_loop import LoopThread
from workers.models import load_tokenizer
from workers.rollout.native import EngineConfig, NativeEngine
from workers.rollout.sampling import SamplingParams

__all__ = ["EngineScorer", "HTTPScorer", "Scorer"]


class Scorer(ABC):
    """``complete(prompts, n, ...)``: ``n`` samples for every prompt; prompt i's are drawn with seeds
    ``seed + n * i, ...`` (no seed: unseeded)."""

    def complete(
        self,
        prompts: Sequence[str],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
    ) -> list[list[str]]:
        if not prompts:
            return []
        seeds = [None if seed is None else seed + n * i for i in range(len(prompts))]
        return self._complete(prompts, n, max_new_tokens, temperature, seeds)

    @abstractmethod
    def _complete(
        self, prompts: Sequence[str], n: int, max_new_tokens: int, temperature: float, seeds: list[int | None]
    ) -> list[list[str]]:
        """``complete`` for a non-empty ``prompts`` with each prompt's first seed."""


class EngineScorer(Scorer):
    def __init__(self, model_path: str, *, device: str | None = None, max_num_seqs: int = 64, seed: int = 0):
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        self.format = ChatFormat(self.tokenizer)
        cfg = EngineConfig(max_num_seqs=max_num_seqs, device=device or str(default_device()), seed=seed)
        self.engine = NativeEngine.from_pretrained(model_path, tokenizer=self.tokenizer, config=cfg)
        self.max_model_len = self.engine.max_model_len

    def _complete(
        self, prompts: Sequence[str], n: int, max_new_tokens: int, temperature: float, seeds: list[int | None]
    ) -> list[list[str]]:
        ids = []
        for p in prompts:
            x = self.format.prompt_ids([{"role": "user", "content": p}])
            keep = max(self.max_model_len - max_new_tokens, 1)
            ids.append(x[-keep:])  # a prompt too long for the model keeps its end (the question)
        params = [
            SamplingParams(
                max_new_tokens=max_new_tokens, temperature=temperature, n=n, seed=s, logprobs=False
            )
            for s in seeds
        ]
        self.engine.resume_memory()
        try:
            outs = self.engine.generate_batch(ids, params)
        finally:
            self.engine.release_memory()
        return [[self.format.decode(o.token_ids) for o in group] for group in outs]


class HTTPScorer(Scorer):
    def __init__(
        self,
        base_url: str,
        model: str = "default",
        *,
        api_key_env: str | None = None,
        timeout_s: float = 60.0,
        max_workers: int = 8,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"prm.endpoint must be an http(s) URL, got {base_url!r}")
        self.chat = OpenAIChat(model, base_url=base_url, api_key_env=api_key_env, timeout=timeout_s)
        self.max_workers = max_workers
        self._loop: LoopThread | None = None  # the client's requests run on this scorer's own loop thread

    async def _one(
        self, prompt: str, n: int, max_new_tokens: int, temperature: float, seed: int | None
    ) -> list[str]:
        texts: list[str] = []
        tries = 0
        while len(texts) < n:
            tries += 1
            if tries > n + 2:
                raise RuntimeError(f"PRM endpoint {self.chat.url} returned {len(texts)} of {n} completions")
            texts += await self.chat.choices(
                [{"role": "user", "content": prompt}],
                n - len(texts),
                max_tokens=max_new_tokens,
                temperature=temperature,
                seed=None if seed is None else seed + len(texts),
            )
        return texts[:n]

    def _complete(
        self, prompts: Sequence[str], n: int, max_new_tokens: int, temperature: float, seeds: list[int | None]
    ) -> list[list[str]]:
        async def all_prompts() -> list[list[str]]:
            room = asyncio.Semaphore(self.max_workers)

            async def one(prompt: str, seed: int | None) -> list[str]:
                async with room:
                    return await self._one(prompt, n, max_new_tokens, temperature, seed)

            return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, seeds))))

        if self._loop is None:
            self._loop = LoopThread(name="prm-http")
        return self._loop.run(all_prompts())
