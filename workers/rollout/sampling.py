"""Sampling parameters and per-request outputs shared by every rollout engine (native, SGLang)."""

from dataclasses import dataclass, field


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
