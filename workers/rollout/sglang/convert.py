"""Pure conversions between hyflow's rollout types and SGLang's ``Engine`` request/response shapes.

Nothing here imports sglang, so every function is unit-testable on a CPU-only machine. The shapes
follow the SGLang source read for this adapter (see ``workers/rollout/sglang/__init__.py`` for the
version and file list):

Request (``Engine.generate`` / ``Engine.async_generate``, ``GenerateReqInput``): ``input_ids`` is a
``list[int]`` (one request) or ``list[list[int]]`` (a batch); ``sampling_params`` a dict or one dict
per request, keys from ``sglang/srt/sampling/sampling_params.py::SamplingParams``:
``max_new_tokens``, ``temperature`` (SGLang turns ``temperature < 1e-6`` into greedy ``top_k=1``),
``top_p``, ``top_k`` (``-1`` = whole vocabulary), ``stop`` (strings), ``stop_token_ids``, ``n``,
``sampling_seed`` (used only when the server runs with ``enable_deterministic_inference``);
``return_logprob=True`` asks for per-token log-probs.

Response (``TokenizerManager._handle_batch_output``): one dict per request (a list for a batch)::

    {"text": str, "output_ids": list[int],
     "meta_info": {"id": rid, "finish_reason": {"type": "stop", "matched": 2} | {"type": "length",
                   "length": 8} | {"type": "abort", "message": ...} | None,
                   "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
                   "weight_version": str, "e2e_latency": float,
                   # with return_logprob=True:
                   "input_token_logprobs": [(logprob, token_id, text_or_None), ...],
                   "output_token_logprobs": [(logprob, token_id, text_or_None), ...]}}

The sampled-token log-prob SGLang reports is ``log softmax(logits / T)`` over the full vocabulary
(``torch.log(probs)`` before top-k/top-p filtering in ``layers/sampler.py``; raw ``log_softmax`` for
greedy rows), the same quantity hyflow's native engine reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from workers.rollout.sampling import (
    GenerationOutput,
    SamplingParams,
)

# hyflow SamplingParams field -> SGLang sampling_params key (fields not listed are handled apart)
_SAMPLING_KEYS = {
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
}


def to_sglang_sampling_params(params: SamplingParams, seed: int | None = None) -> dict[str, Any]:
    """One SGLang ``sampling_params`` dict for one request (``n`` is always 1: see ``expand_requests``).

    ``seed`` overrides ``params.seed`` (per-row seeds); it becomes ``sampling_seed``, which SGLang
    honours only on an engine started with ``enable_deterministic_inference=True``.
    """
    out: dict[str, Any] = {key: getattr(params, field) for field, key in _SAMPLING_KEYS.items()}
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    seed = params.seed if seed is None else seed
    if seed is not None:
        out["sampling_seed"] = int(seed)
    out["n"] = 1
    return out


def expand_requests(
    id_lists: Sequence[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list[dict[str, Any]], list[int]]:
    """Expand B prompts to ``B * n`` single-sample requests, interleaved (a, a, b, b for n = 2).

    Returns ``(input_ids, sampling_params, source_row)``. Each request asks for one sample, so a
    seeded batch gives every row its own seed: row ``r`` of the expanded batch gets ``seed + r``
    (the same prompt repeated n times must not draw n identical samples). The row order matches
    ``DataProto.repeat(n, interleave=True)`` and SGLang's own n-expansion order.
    """
    input_ids: list[list[int]] = []
    sampling: list[dict[str, Any]] = []
    source: list[int] = []
    for b, ids in enumerate(id_lists):
        for _ in range(params.n):
            row = len(input_ids)
            input_ids.append(list(ids))
            sampling.append(
                to_sglang_sampling_params(params, None if params.seed is None else params.seed + row)
            )
            source.append(b)
    return input_ids, sampling, source


def parse_finish_reason(finish_reason: Any) -> str:
    """SGLang's ``meta_info["finish_reason"]`` -> ``"stop"`` / ``"length"`` / ``"abort"``.

    SGLang sends ``BaseFinishReason.to_json()``: ``{"type": "stop" | "length" | "abort", ...}``;
    ``None`` means the request never finished (treated as an abort).
    """
    if finish_reason is None:
        return "abort"
    kind = finish_reason.get("type") if isinstance(finish_reason, Mapping) else finish_reason
    kind = str(kind).lower()
    if kind in ("stop", "length", "abort"):
        return kind
    raise ValueError(f"unknown SGLang finish_reason {finish_reason!r}")


def output_to_generation(output: Mapping[str, Any], want_log_probs: bool = True) -> GenerationOutput:
    """One SGLang response dict -> ``GenerationOutput`` (the engine's own ids, never re-tokenised).

    Token ids come from ``output_ids``; log-probs from ``meta_info["output_token_logprobs"]`` tuples
    ``(logprob, token_id, text)``, whose ids must match ``output_ids`` one for one.
    """
    meta = output.get("meta_info") or {}
    logprob_entries = meta.get("output_token_logprobs")
    if "output_ids" in output:
        token_ids = [int(t) for t in output["output_ids"]]
    elif logprob_entries is not None:
        token_ids = [int(entry[1]) for entry in logprob_entries]
    else:
        raise KeyError("SGLang output has neither 'output_ids' nor meta_info['output_token_logprobs']")
    log_probs = None
    if want_log_probs:
        if logprob_entries is None:
            raise KeyError(
                "SGLang output has no meta_info['output_token_logprobs']; the request needs return_logprob=True"
            )
        if len(logprob_entries) != len(token_ids):
            raise ValueError(
                f"SGLang returned {len(logprob_entries)} output log-probs for {len(token_ids)} output ids"
            )
        ids_from_logprobs = [int(entry[1]) for entry in logprob_entries]
        if ids_from_logprobs != token_ids:
            raise ValueError("SGLang output_token_logprobs token ids differ from output_ids")
        log_probs = [float(entry[0]) for entry in logprob_entries]
    return GenerationOutput(
        token_ids=token_ids,
        log_probs=log_probs,
        finish_reason=parse_finish_reason(meta.get("finish_reason")),
        text=output.get("text"),
    )
