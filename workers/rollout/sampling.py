"""Sampling parameters and per-request outputs shared by every rollout engine (native, SGLang), and the one
translation of a ``generate_sequences`` call's ``meta_info`` into them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class SamplingParams:
    """What one generation request asks for. Field names follow SGLang/vLLM where they overlap."""

    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    seed: int | None = None  # per-request seed: same seed, same prompt, same weights -> same tokens
    stop_token_ids: list[int] = field(default_factory=list)  # added to the engine's EOS ids
    stop: list[str] = field(default_factory=list)  # stop strings, matched on decoded text
    n: int = 1  # samples per prompt
    logprobs: bool = True  # return the log-prob of each sampled token

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationOutput:
    """One finished sample: the engine's own token ids (never re-tokenised) and their log-probs."""

    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str  # "stop" (EOS / stop id / stop string), "length", or "abort"
    text: str | None = None
    versions: list[int] | None = None  # per token: the weight version that sampled it (None: not tracked)
    # mixture of experts: the expert ids each MoE layer routed every position the engine ran to, [prompt + tokens
    # - 1, MoE layers, top-k] (the last sampled token is never run); None: a dense model or an engine without them
    routes: torch.Tensor | None = None


def token_id_list(value: Any) -> list[int]:
    """``None`` / an int / a sequence of ints -> a list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def sampling_from_meta(
    meta_info: Mapping[str, Any] | None, default: SamplingParams, response_length: int | None = None
) -> tuple[SamplingParams, int | None]:
    """The sampling parameters of one ``generate_sequences`` call and the response width to pad to.

    Every engine's ``generate_sequences`` reads these ``meta_info`` keys, with the engine's configured
    ``SamplingParams`` as the defaults: ``do_sample`` (default ``not validate``;
    False means greedy and n = 1), ``temperature``, ``top_p``, ``top_k``, ``n``, ``response_length``
    (pad to exactly this and cap generation at it; default ``response_length``, else pad to the longest
    response), ``max_new_tokens`` (default ``response_length``, else ``default.max_new_tokens``),
    ``seed`` (row i of the output is sampled with seed + i), ``stop_token_ids``, ``stop``,
    ``eos_token_id`` (extra stop ids).
    """
    meta = meta_info or {}
    validate = bool(meta.get("validate", False))
    do_sample = bool(meta.get("do_sample", not validate))
    response_length = meta.get("response_length", response_length)
    max_new = meta.get(
        "max_new_tokens", response_length if response_length is not None else default.max_new_tokens
    )
    if response_length is not None:
        response_length = int(response_length)
        max_new = min(int(max_new), response_length)
    stop_ids: list[int] = []
    for t in (
        list(default.stop_token_ids)
        + token_id_list(meta.get("stop_token_ids"))
        + token_id_list(meta.get("eos_token_id"))
    ):
        if t not in stop_ids:
            stop_ids.append(t)
    seed = meta.get("seed", default.seed)
    params = SamplingParams(
        max_new_tokens=int(max_new),
        temperature=float(meta.get("temperature", default.temperature)) if do_sample else 0.0,
        top_p=float(meta.get("top_p", default.top_p)) if do_sample else 1.0,
        top_k=int(meta.get("top_k", default.top_k)) if do_sample else -1,
        seed=None if seed is None else int(seed),
        stop_token_ids=stop_ids,
        stop=list(meta.get("stop", default.stop)),
        n=int(meta.get("n", default.n)) if do_sample else 1,
        logprobs=default.logprobs,
    )
    return params, response_length
