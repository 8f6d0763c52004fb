"""The language models a PRM worker can ask: ``complete(prompts, n, ...) -> [[text] * n per prompt]``.

* `EngineScorer`: a frozen Hugging Face checkpoint on the native rollout engine (the policy's reference --
  its initial weights -- or any other checkpoint), each prompt rendered as one user chat turn with the
  model's template; the n samples of a prompt are drawn with seeds ``seed, seed + 1, ...``.
* `HTTPScorer`: an OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint (vLLM, SGLang,
  hosted APIs); ``n`` choices per request (requests repeated when the server returns fewer), prompts
  sent concurrently from a thread pool, the API key from an environment variable.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from workers.agents.chat_format import ChatFormat
from workers.engine.distributed import default_device
from workers.models import load_tokenizer
from workers.rollout.native import EngineConfig, NativeEngine

__all__ = ["EngineScorer", "HTTPScorer"]


class EngineScorer:
    def __init__(self, model_path: str, *, device: str | None = None, max_num_seqs: int = 64, seed: int = 0):
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        self.format = ChatFormat(self.tokenizer)
        cfg = EngineConfig(max_num_seqs=max_num_seqs, device=device or str(default_device()), seed=seed)
        self.engine = NativeEngine.from_pretrained(model_path, tokenizer=self.tokenizer, config=cfg)
        self.max_model_len = self.engine.max_model_len

    def complete(
        self,
        prompts: Sequence[str],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
    ) -> list[list[str]]:
        from workers.rollout.sampling import SamplingParams

        if not prompts:
            return []
        ids = []
        for p in prompts:
            x = self.format.prompt_ids([{"role": "user", "content": p}])
            keep = max(self.max_model_len - max_new_tokens, 1)
            ids.append(x[-keep:])  # a prompt too long for the model keeps its end (the question)
        params = [
            SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                n=n,
                seed=None if seed is None else seed + n * i,
                logprobs=False,
            )
            for i in range(len(ids))
        ]
        self.engine.resume_memory()
        try:
            outs = self.engine.generate_batch(ids, params)
        finally:
            self.engine.release_memory()
        return [[self.format.decode(o.token_ids) for o in group] for group in outs]


class HTTPScorer:
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
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not self.api_key:
            raise ValueError(f"prm.api_key_env={api_key_env!r}: that environment variable is not set")
        self.timeout_s = timeout_s
        self.max_workers = max_workers

    def _post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise RuntimeError(f"PRM endpoint {self.url} answered HTTP {err.code}: {detail}") from None
        except urllib.error.URLError as err:
            raise RuntimeError(f"PRM endpoint {self.url} unreachable: {err.reason}") from None

    def _one(
        self, prompt: str, n: int, max_new_tokens: int, temperature: float, seed: int | None
    ) -> list[str]:
        texts: list[str] = []
        tries = 0
        while len(texts) < n:
            tries += 1
            if tries > n + 2:
                raise RuntimeError(f"PRM endpoint {self.url} returned {len(texts)} of {n} completions")
            body = {
                "model": self.model,
                "messages": [{"role": "user", "content": prompt}],
                "n": n - len(texts),
                "max_tokens": max_new_tokens,
                "temperature": temperature,
            }
            if seed is not None:
                body["seed"] = seed + len(texts)
            out = self._post(body)
            try:
                texts += [c["message"]["content"] or "" for c in out["choices"]]
            except (KeyError, TypeError):
                raise RuntimeError(
                    f"PRM endpoint {self.url}: not a chat completion: {str(out)[:300]}"
                ) from None
        return texts[:n]

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
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(prompts))) as pool:
            futs = [
                pool.submit(
                    self._one, p, n, max_new_tokens, temperature, None if seed is None else seed + n * i
                )
                for i, p in enumerate(prompts)
            ]
            return [f.result() for f in futs]
