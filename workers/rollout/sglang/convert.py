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

import torch

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


def prompt_id_lists(
    prompts: torch.Tensor, attention_mask: torch.Tensor | None = None, pad_token_id: int | None = None
) -> list[list[int]]:
    """Left-padded ``[B, P]`` prompt ids -> one list of real token ids per row.

    With ``attention_mask`` (``[B, P]`` or ``[B, P + R]``; only the first ``P`` columns are used) the
    real tokens are where the mask is 1, so a pad id that also occurs inside a prompt is kept. Without
    it, leading ``pad_token_id`` tokens are stripped.
    """
    if prompts.dim() != 2:
        raise ValueError(f"prompts must be [B, P], got shape {tuple(prompts.shape)}")
    rows = prompts.tolist()
    if attention_mask is not None:
        mask = attention_mask[:, : prompts.shape[1]].bool().tolist()
        ids = [[t for t, m in zip(row, keep) if m] for row, keep in zip(rows, mask)]
    elif pad_token_id is not None:
        ids = []
        for row in rows:
            start = 0
            while start < len(row) and row[start] == pad_token_id:
                start += 1
            ids.append(row[start:])
    else:
        raise ValueError("prompt_id_lists needs an attention_mask or a pad_token_id")
    empty = [i for i, row in enumerate(ids) if not row]
    if empty:
        raise ValueError(f"prompt rows {empty[:8]} have no tokens")
    return ids


def expand_requests(
    id_lists: Sequence[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list[dict[str, Any]], list[int]]:
    """Expand B prompts to ``B * n`` single-sample requests, interleaved (a, a, b, b for n = 2).

    Returns ``(input_ids, sampling_params, source_row)``. Each request asks for one sample, so a
    seeded batch gives every row its own seed: row ``r`` of the expanded batch gets ``seed + r``
    (the same prompt repeated n times must not draw n identical samples). The row order matches
    ``DataProto.repeat(n, interleave=True)`` and SGLang's own n-expansion order.
    """
    input_ids, sampling, source = [], [], []
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


def build_rollout_batch(
    prompts: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    outputs: Sequence[GenerationOutput],
    pad_token_id: int,
    response_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors of a rollout batch (``dataproto/BATCH_LAYOUT.md``) from left-padded prompts and samples.

    ``prompts`` / ``prompt_attention_mask`` are ``[B, P]`` and already row-aligned with ``outputs``.
    Responses are right-padded with ``pad_token_id`` to exactly ``response_length`` columns (a fixed
    width lets batches from several workers concatenate), or to the longest response when it is
    ``None``. Returns ``prompts``, ``responses``,
    ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``, ``rollout_versions`` (each
    token's weight version, 0 where the output tracks none), ``rollout_aborted`` (per row) and, when every
    output has log-probs, ``rollout_log_probs`` (0 on padding).
    """
    batch = len(outputs)
    if prompts.shape[0] != batch or prompt_attention_mask.shape[0] != batch:
        raise ValueError(
            f"{prompts.shape[0]} prompt rows / {prompt_attention_mask.shape[0]} mask rows for {batch} outputs"
        )
    if prompt_attention_mask.shape != prompts.shape:
        raise ValueError(
            f"prompt attention mask shape {tuple(prompt_attention_mask.shape)} != prompts {tuple(prompts.shape)}"
        )
    if response_length is None:
        response_length = max((len(o.token_ids) for o in outputs), default=0)
    responses = torch.full((batch, response_length), pad_token_id, dtype=torch.int64)
    response_mask = torch.zeros(batch, response_length, dtype=torch.float32)
    with_log_probs = all(o.log_probs is not None for o in outputs)
    log_probs = torch.zeros(batch, response_length, dtype=torch.float32)
    versions = torch.zeros(batch, response_length, dtype=torch.int64)
    for i, out in enumerate(outputs):
        n = len(out.token_ids)
        if n > response_length:
            raise ValueError(f"row {i} has {n} response tokens, more than response_length {response_length}")
        if n:
            responses[i, :n] = torch.tensor(out.token_ids, dtype=torch.int64)
            response_mask[i, :n] = 1.0
            if with_log_probs:
                log_probs[i, :n] = torch.tensor(out.log_probs, dtype=torch.float32)
            if out.versions:
                versions[i, :n] = torch.tensor(out.versions, dtype=torch.int64)
    prompts = prompts.to(torch.int64)
    attention_mask = torch.cat([prompt_attention_mask.to(torch.int64), response_mask.to(torch.int64)], dim=1)
    out = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0),
        "response_mask": response_mask,
        "rollout_versions": versions,
        "rollout_aborted": torch.tensor([o.finish_reason == "abort" for o in outputs], dtype=torch.bool),
    }
    if with_log_probs:
        out["rollout_log_probs"] = log_probs
    return out
