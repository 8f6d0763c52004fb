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

With ``return_routed_experts=True`` (on an engine started with ``enable_return_routed_experts=True``),
``meta_info["routed_experts"]`` holds the experts every position was routed to: see `decode_routed_experts`.

The sampled-token log-prob SGLang reports is ``log softmax(logits / T)`` over the full vocabulary
(``torch.log(probs)`` before top-k/top-p filtering in ``layers/sampler.py``; raw ``log_softmax`` for
greedy rows), the same quantity hyflow's native engine reports.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
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


# ------------------------------------------------------------------------------------------ routed experts
#
# SGLang 0.5.20's route recording (R3), read from the installed wheel (paths under python/sglang/):
#
# * server argument ``enable_return_routed_experts`` (srt/arg_groups/fields/exec_.py:91) creates the
#   ``RoutedExpertsCapturer`` (srt/state_capturer/routed_experts.py:41-60): an int32 buffer
#   ``[KV slots, num_hidden_layers, num_experts_per_tok]`` (``hf_text_config`` values, lines 71-72 and
#   srt/state_capturer/base.py:63-75, zero-filled). Each ``TopK`` writes its ids into row ``layer_id`` of the
#   positions it ran (base.py:48-50, srt/layers/moe/topk.py:2106-2122, called before any EPLB remapping at
#   topk.py:2141), so the layer axis is EVERY decoder layer, and a dense layer's rows stay 0;
# * request field ``return_routed_experts`` (srt/managers/io_struct.py:252; ``Engine.generate`` /
#   ``async_generate`` keyword, srt/entrypoints/engine.py:418 and 531; the HTTP /generate body key,
#   benchmark/serving.py:679); ``routed_experts_start_len`` (io_struct.py:253-256, default 0: from the first
#   prompt token);
# * when the request finishes the scheduler gathers rows ``[start_len, seqlen - 1)`` with ``seqlen = prompt +
#   output_ids_through_stop`` (srt/managers/scheduler_components/batch_result_processor.py:135-160,
#   base.py:173-188): every position the model ran, the prompt's and the sampled tokens' but the last -- the
#   positions the native engine records (``GenerationOutput.routes``);
# * the detokenizer sends them as ``base64(tensor.numpy().tobytes())`` of that int32 [positions, layers, k]
#   tensor (srt/managers/detokenizer_manager.py:424-441, 459), put into ``meta_info["routed_experts"]`` by the
#   tokenizer manager (srt/managers/tokenizer_manager.py:2446-2453); SGLang's own reader is
#   ``extract_routed_experts_from_meta_info`` (routed_experts.py:153-161: ``np.frombuffer(b64decode, int32)``,
#   flat).
#
# The conversion to hyflow's routes: reshape to [positions, num_hidden_layers, k], keep the layers that route
# (HF's rule for which layers are sparse, the trainer's router order: its routes' layer axis counts routers),
# int16 (the batch column's dtype).

# SGLang model classes whose ``TopK`` is built with its decoder layer's index (``TopK(..., layer_id=layer_id)``:
# srt/models/qwen3_moe.py:255-260, qwen2_moe.py:313-317), so the capture writes each layer's own row. Mixtral's and
# OLMoE's ``TopK`` get none (srt/models/mixtral.py:92-95, olmoe.py:83-86): the capture then indexes the layer
# axis with ``None``, which copies one layer's ids into every layer, or raises for most batch sizes; the
# adapter asks those for no routes.
ROUTE_RECORDING_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
EXPERT_COUNT_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
)  # recipes' model_is_moe reads these


@dataclass(frozen=True)
class RouteLayout:
    """What SGLang's routed-experts payload holds for one model and which part of it hyflow keeps."""

    num_layers: int  # decoder layers: SGLang's layer axis (num_hidden_layers)
    top_k: int  # num_experts_per_tok
    moe_layers: tuple[int, ...]  # the decoder layers that route, in order: the routes' layer axis


def is_moe_config(hf_config: Mapping[str, Any]) -> bool:
    """Whether a Hugging Face ``config.json`` names experts (as ``recipes.worker_sections.model_is_moe``)."""
    return any(int(hf_config.get(key) or 0) > 0 for key in EXPERT_COUNT_KEYS)


def architecture(hf_config: Mapping[str, Any]) -> str | None:
    """The model class SGLang picks for the config (``architectures[0]``)."""
    archs = hf_config.get("architectures") or []
    return str(archs[0]) if archs else None


def route_layout(hf_config: Mapping[str, Any]) -> RouteLayout:
    """The route layout of an MoE ``config.json``. The sparse layers follow HF's Qwen2/3-MoE rule (not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; every layer without those keys), as
    ``workers.models.memory.moe_layers`` and the trainer's routers do."""
    num_layers = int(hf_config["num_hidden_layers"])
    step = int(hf_config.get("decoder_sparse_step") or 1)
    dense = set(hf_config.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return RouteLayout(num_layers=num_layers, top_k=int(hf_config["num_experts_per_tok"]), moe_layers=sparse)


def decode_routed_experts(encoded: str, positions: int, layout: RouteLayout) -> torch.Tensor:
    """SGLang's ``meta_info["routed_experts"]`` -> ``GenerationOutput.routes``: int16 ``[positions, MoE layers,
    top-k]``; ``positions`` = prompt + output tokens - 1 (see the notes above)."""
    try:
        raw = base64.b64decode(encoded.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as err:
        raise ValueError(f"SGLang meta_info['routed_experts'] is not base64: {err}") from err
    ids = np.frombuffer(raw, dtype=np.int32)
    per_position = layout.num_layers * layout.top_k
    if ids.size != positions * per_position:
        raise ValueError(
            f"SGLang returned {ids.size} routed-expert ids; expected {positions} positions x "
            f"{layout.num_layers} layers x top-{layout.top_k} = {positions * per_position}"
        )
    routes = ids.reshape(positions, layout.num_layers, layout.top_k)[:, list(layout.moe_layers)]
    if routes.size and (routes.min() < 0 or routes.max() > torch.iinfo(torch.int16).max):
        raise ValueError(f"SGLang routed-expert ids out of range [{routes.min()}, {routes.max()}]")
    return torch.from_numpy(routes.astype(np.int16))


def output_to_generation(
    output: Mapping[str, Any],
    want_log_probs: bool = True,
    *,
    routes: RouteLayout | None = None,
    prompt_length: int | None = None,
) -> GenerationOutput:
    """One SGLang response dict -> ``GenerationOutput`` (the engine's own ids, never re-tokenised).

    Token ids come from ``output_ids``; log-probs from ``meta_info["output_token_logprobs"]`` tuples
    ``(logprob, token_id, text)``, whose ids must match ``output_ids`` one for one. With ``routes`` (a request
    sent with ``return_routed_experts=True``; ``prompt_length`` its prompt's tokens), ``routes`` of the output
    from ``meta_info["routed_experts"]`` (`decode_routed_experts`); an aborted request may bring none (or ones
    that do not decode: then None).
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
    finish_reason = parse_finish_reason(meta.get("finish_reason"))
    route_ids = None
    if routes is not None:
        if prompt_length is None:
            raise ValueError("output_to_generation: routes need the request's prompt_length")
        encoded = meta.get("routed_experts")
        if encoded is not None:
            try:
                route_ids = decode_routed_experts(encoded, prompt_length + len(token_ids) - 1, routes)
            except ValueError:
                if finish_reason != "abort":  # an aborted row is not trained on; its routers may choose
                    raise
        elif finish_reason != "abort":
            raise KeyError(
                "SGLang output has no meta_info['routed_experts']; the engine needs enable_return_routed_experts"
                "=True and the request return_routed_experts=True"
            )
    return GenerationOutput(
        token_ids=token_ids,
        log_probs=log_probs,
        finish_reason=finish_reason,
        text=output.get("text"),
        routes=route_ids,
    )
