"""``SGLangRollout``: hyflow's ``RolloutEngine`` over an in-process ``sglang.Engine`` (GPU clusters).

Same interface and ``meta_info`` contract as the native engine (``workers/rollout/base.py``,
``workers/rollout/native/engine.py``), so the rollout worker can hold either:

* ``generate_sequences(DataProto) -> DataProto``: left-padded ``input_ids`` (or ``prompts``) and
  ``attention_mask`` ``[B, P]`` in; out the keys of ``dataproto/BATCH_LAYOUT.md``: ``prompts``,
  right-padded ``responses``, ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``
  (float32, 1 through the EOS / stop token), ``rollout_log_probs`` (float32, 0 on padding). Sampling
  settings come from ``meta_info`` (see ``workers.rollout.sampling.sampling_from_meta``) with the configured
  ``SamplingParams`` as defaults. With ``n > 1`` every row (tensors and non-tensor columns) is
  repeated n times, interleaved (a, a, b, b). Output ``meta_info`` = input meta + ``eos_token_id``,
  ``pad_token_id``, ``timing_s/gen``, ``rollout/generated_tokens``, ``rollout/tokens_per_s``.
* ``async generate(prompt_ids, sampling_params)``: one ``GenerationOutput`` through
  ``Engine.async_generate`` (a list of n when ``sampling_params.n > 1``).
* ``update_weights(named_tensors)``: HF-named tensors through ``Engine.update_weights_from_tensor`` in
  size-bounded buckets (``bucket_mb``, each sent with ``flush_cache=False``), then one
  ``Engine.flush_cache()``.
* ``release_memory(weights=False)`` / ``resume_memory(kv_cache=True)``: ``release_memory_occupation``
  / ``resume_memory_occupation`` with tags ``"kv_cache"``, ``"weights"`` (when asked) and
  ``"cuda_graph"`` (when ``release_cuda_graph``). Needs the engine started with
  ``enable_memory_saver=True`` (the default here). Released weights hold garbage after
  ``resume_memory()``: refill them with ``update_weights`` before generating. The colocated order that
  keeps peak memory low is ``resume_memory(kv_cache=False)`` -> ``update_weights`` ->
  ``resume_memory()``.
* ``flush_cache()``, ``shutdown()``.

sglang is imported only when an engine is built; on a machine without it the constructor raises an
``ImportError`` that says how to install it. Tests pass an ``engine`` object instead.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dataproto import DataProto
from workers.rollout.base import RolloutEngine
from workers.rollout.sampling import GenerationOutput, SamplingParams, sampling_from_meta, token_id_list
from workers.rollout.sglang.convert import (
    build_rollout_batch,
    expand_requests,
    output_to_generation,
    prompt_id_lists,
)
from workers.weight_sync.buckets import bucket_mb_to_bytes, flatten_bucket, iter_buckets

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install hyflow[sglang] on a CUDA machine (SGLang's kernels are CUDA-only wheels)"

KV_CACHE = "kv_cache"  # sglang.srt.constants.GPU_MEMORY_TYPE_KV_CACHE
WEIGHTS = "weights"  # sglang.srt.constants.GPU_MEMORY_TYPE_WEIGHTS
CUDA_GRAPH = "cuda_graph"  # sglang.srt.constants.GPU_MEMORY_TYPE_CUDA_GRAPH

WEIGHT_LOAD_FORMATS = ("tensor", "flattened_bucket")

# tensor keys of the input batch that generate_sequences rebuilds (the others are repeated and kept)
_REBUILT_KEYS = ("prompts", "input_ids", "attention_mask", "position_ids")


def import_sglang():
    """The ``sglang`` module, or an ImportError saying how to get it."""
    try:
        import sglang
    except ImportError as err:
        raise ImportError(f"SGLang is not installed ({err}); {INSTALL_HINT}") from err
    return sglang


def _flattened_bucket_api():
    """(FlattenedTensorMetadata class, serialize function, multi-dtype support) from sglang."""
    import_sglang()
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:  # moved into a submodule in some versions
        from sglang.srt.utils.common import MultiprocessingSerializer
    multi_dtype = bool(getattr(FlattenedTensorBucket, "supports_multi_dtypes", False))
    return FlattenedTensorMetadata, MultiprocessingSerializer.serialize, multi_dtype


@dataclass
class SGLangRolloutConfig:
    """How to start the SGLang engine and how to talk to it.

    Engine fields map to ``sglang.srt.server_args.ServerArgs`` (``model_path``, ``tp_size``,
    ``mem_fraction_static``, ``dtype``, ``random_seed`` <- ``seed``, ``enable_memory_saver``,
    ``enable_deterministic_inference`` <- ``deterministic``, ``attention_backend``, ``base_gpu_id``,
    ``log_level``, ``trust_remote_code``); ``engine_kwargs`` passes any other ServerArgs field.
    """

    model_path: str
    tp_size: int = 1
    mem_fraction_static: float = 0.5  # share of GPU memory for weights + KV cache (colocated: leave room)
    dtype: str = "auto"
    seed: int = 0
    bucket_mb: float = 512.0  # weight update bucket bound, MiB
    weight_load_format: str = "tensor"  # "tensor" or "flattened_bucket" (one IPC handle per bucket)
    enable_memory_saver: bool = True  # required for release_memory / resume_memory to free anything
    release_cuda_graph: bool = False  # also release the "cuda_graph" tag (newer SGLang versions)
    deterministic: bool = False  # enable_deterministic_inference: needed for seeded sampling
    attention_backend: str | None = None
    base_gpu_id: int = 0
    log_level: str = "error"
    trust_remote_code: bool = False
    response_length: int | None = None  # pad responses to this (None: meta_info's, else the longest)
    pad_token_id: int | None = None  # None: meta_info["pad_token_id"], else the tokenizer's
    eos_token_ids: list[int] | None = None  # reported in meta_info; None: generation config + tokenizer
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.weight_load_format not in WEIGHT_LOAD_FORMATS:
            raise ValueError(
                f"weight_load_format must be one of {WEIGHT_LOAD_FORMATS}, got {self.weight_load_format!r}"
            )
        bucket_mb_to_bytes(self.bucket_mb)  # validates
        if isinstance(self.sampling, Mapping):
            self.sampling = SamplingParams(**self.sampling)

    def server_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``sglang.Engine(**kwargs)`` (= ``ServerArgs`` fields)."""
        kwargs: dict[str, Any] = dict(
            model_path=self.model_path,
            tp_size=self.tp_size,
            mem_fraction_static=self.mem_fraction_static,
            dtype=self.dtype,
            random_seed=self.seed,
            enable_memory_saver=self.enable_memory_saver,
            base_gpu_id=self.base_gpu_id,
            log_level=self.log_level,
            trust_remote_code=self.trust_remote_code,
        )
        if self.deterministic:
            kwargs["enable_deterministic_inference"] = True
        if self.attention_backend is not None:
            kwargs["attention_backend"] = self.attention_backend
        clash = sorted(set(kwargs) & set(self.engine_kwargs))
        if clash:
            raise ValueError(f"engine_kwargs repeats field(s) {clash} that have their own config entries")
        kwargs.update(self.engine_kwargs)
        return kwargs


class SGLangRollout(RolloutEngine):
    """Rollout engine adapter over ``sglang.Engine`` (see the module docstring for the contract)."""

    def __init__(self, config: SGLangRolloutConfig, engine: Any | None = None):
        self.config = config
        if engine is None:
            sglang = import_sglang()
            engine = sglang.Engine(**config.server_kwargs())
        self.engine = engine
        self.released_tags: set[str] = set()
        self._pad_token_id = config.pad_token_id
        self._eos_token_ids = None if config.eos_token_ids is None else token_id_list(config.eos_token_ids)
        self._tokenizer = None
        self._warned_seed = False

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate for every prompt row; the batch layout of ``dataproto/BATCH_LAYOUT.md``."""
        t0 = time.perf_counter()
        meta = dict(prompts.meta_info)
        key = "input_ids" if "input_ids" in prompts.batch else "prompts"
        if key not in prompts.batch:
            raise KeyError(
                f"generate_sequences needs batch['input_ids'] or batch['prompts']; got {sorted(prompts.batch)}"
            )
        prompt_ids = prompts.batch[key]
        pad = self._resolve_pad_token_id(meta)
        mask = prompts.batch.get("attention_mask")
        mask = (prompt_ids != pad).long() if mask is None else mask[:, : prompt_ids.shape[1]]
        params, response_length = sampling_from_meta(meta, self.config.sampling, self.config.response_length)
        self._check_seed(params)

        input_ids, sampling, source = expand_requests(prompt_id_lists(prompt_ids, mask), params)
        raw = self.engine.generate(
            input_ids=input_ids, sampling_params=sampling, return_logprob=params.logprobs
        )
        if isinstance(raw, Mapping):  # a single request comes back as a dict, a batch as a list
            raw = [raw]
        if len(raw) != len(input_ids):
            raise RuntimeError(f"SGLang returned {len(raw)} outputs for {len(input_ids)} requests")
        outputs = [output_to_generation(r, want_log_probs=params.logprobs) for r in raw]

        index = torch.tensor(source, dtype=torch.long)
        rows = {
            k: v.index_select(0, index.to(v.device))
            for k, v in prompts.batch.items()
            if k not in _REBUILT_KEYS
        }
        device = prompt_ids.device
        tensors = build_rollout_batch(
            prompt_ids.index_select(0, index.to(device)).cpu(),
            mask.index_select(0, index.to(mask.device)).cpu(),
            outputs,
            pad_token_id=pad,
            response_length=response_length,
        )
        rows.update({k: v.to(device) for k, v in tensors.items()})
        np_index = np.asarray(source, dtype=np.int64)
        non_tensor = {k: v[np_index] for k, v in prompts.non_tensor_batch.items()}

        generated = sum(len(o.token_ids) for o in outputs)
        elapsed = time.perf_counter() - t0
        meta.update(
            {
                "eos_token_id": self._resolve_eos_token_ids(),
                "pad_token_id": pad,
                "timing_s/gen": elapsed,
                "rollout/generated_tokens": generated,
                "rollout/tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
            }
        )
        return DataProto(batch=rows, non_tensor_batch=non_tensor, meta_info=meta)

    async def generate(
        self, prompt_ids: list[int], sampling_params: SamplingParams | None = None
    ) -> GenerationOutput | list[GenerationOutput]:
        """One request through ``Engine.async_generate``: one output, or a list of n when ``n > 1``
        (sample i of a seeded request uses seed + i)."""
        params = sampling_params if sampling_params is not None else self.config.sampling
        self._check_seed(params)
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("prompt_ids is empty")
        input_ids, sampling, _ = expand_requests([ids], params)
        if params.n == 1:
            raw = await self.engine.async_generate(
                input_ids=input_ids[0], sampling_params=sampling[0], return_logprob=params.logprobs
            )
        else:
            raw = await self.engine.async_generate(
                input_ids=input_ids, sampling_params=sampling, return_logprob=params.logprobs
            )
        raw = [raw] if isinstance(raw, Mapping) else list(raw)
        if len(raw) != params.n:
            raise RuntimeError(f"SGLang returned {len(raw)} outputs for {params.n} samples")
        outs = [output_to_generation(r, want_log_probs=params.logprobs) for r in raw]
        return outs if params.n > 1 else outs[0]

    # ------------------------------------------------------------------ weights and memory
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], flush_cache: bool = True
    ) -> dict:
        """Load HF-named tensors into the engine, ``bucket_mb`` at a time; returns bucket stats.

        Tensors should already be on the engine's GPU (``tensor`` format sends CUDA IPC handles, one
        serialization per TP rank, done by ``Engine.update_weights_from_tensor``). One bucket is
        materialised at a time; every bucket is sent with ``flush_cache=False`` and the prefix cache is
        flushed once at the end (``flush_cache=False`` skips that). SGLang's model loader raises on
        names the model does not have.
        """
        if WEIGHTS in self.released_tags:
            raise RuntimeError("weights are released; call resume_memory() before update_weights()")
        bucket_bytes = bucket_mb_to_bytes(self.config.bucket_mb)
        stats = {"buckets": 0, "tensors": 0, "bytes": 0, "max_bucket_bytes": 0}
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            self._send_bucket(bucket)
            stats["buckets"] += 1
            stats["tensors"] += len(bucket)
            stats["bytes"] += size
            stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], size)
        if flush_cache and stats["buckets"]:
            self.flush_cache()
        return stats

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if self.config.weight_load_format == "tensor":
            result = self.engine.update_weights_from_tensor(
                named_tensors=bucket, load_format=None, flush_cache=False
            )
            _check_result("update_weights_from_tensor", result)
            return
        # flattened_bucket: one buffer per bucket (per dtype on SGLang versions without multi-dtype
        # buckets), serialized once per TP rank by us -- Engine passes the list through unchanged.
        metadata_cls, serialize, multi_dtype = _flattened_bucket_api()
        for group in [bucket] if multi_dtype else _split_by_dtype(bucket):
            flat = flatten_bucket(group)
            metadata = [
                metadata_cls(
                    name=m.name,
                    shape=torch.Size(m.shape),
                    dtype=m.dtype,
                    start_idx=m.offset,
                    end_idx=m.end,
                    numel=m.nbytes,
                )
                for m in flat.metas
            ]
            payload = {"flattened_tensor": flat.buffer, "metadata": metadata}
            serialized = [serialize(payload) for _ in range(self.config.tp_size)]
            result = self.engine.update_weights_from_tensor(
                named_tensors=serialized, load_format="flattened_bucket", flush_cache=False
            )
            _check_result("update_weights_from_tensor", result)

    def release_memory(self, weights: bool = False) -> None:
        """Free the KV cache, and the weights too when ``weights``; the engine must be idle.

        CUDA-graph memory is released as well when ``config.release_cuda_graph`` is set.
        """
        tags = (
            [KV_CACHE]
            + ([WEIGHTS] if weights else [])
            + ([CUDA_GRAPH] if self.config.release_cuda_graph else [])
        )
        tags = [t for t in tags if t not in self.released_tags]
        if tags:
            self.engine.release_memory_occupation(tags=tags)
            self.released_tags.update(tags)

    def resume_memory(self, kv_cache: bool = True) -> None:
        """Re-allocate released weights (to be refilled by ``update_weights``) and, when ``kv_cache``,
        the KV cache (and CUDA graphs)."""
        tags = [t for t in (WEIGHTS, CUDA_GRAPH, KV_CACHE) if t in self.released_tags]
        if not kv_cache:
            tags = [t for t in tags if t == WEIGHTS]
        if tags:
            self.engine.resume_memory_occupation(tags=tags)
            self.released_tags.difference_update(tags)

    def flush_cache(self) -> None:
        """Drop SGLang's radix prefix cache (stale after a weight change); the engine must be idle."""
        result = self.engine.flush_cache()
        if getattr(result, "success", True) is False:  # FlushCacheReqOutput(success=False): not idle
            raise RuntimeError("SGLang flush_cache failed: the engine still has running requests")

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ------------------------------------------------------------------ helpers
    def _tokenizer_or_none(self):
        if self._tokenizer is None:
            self._tokenizer = getattr(getattr(self.engine, "tokenizer_manager", None), "tokenizer", None)
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self.config.model_path, trust_remote_code=self.config.trust_remote_code
            )
        return self._tokenizer

    def _resolve_pad_token_id(self, meta_info: Mapping[str, Any]) -> int:
        if meta_info.get("pad_token_id") is not None:
            return int(meta_info["pad_token_id"])
        if self._pad_token_id is None:
            tokenizer = self._tokenizer_or_none()
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            if pad is None:
                raise ValueError(
                    f"tokenizer of {self.config.model_path} has neither a pad nor an eos token; set "
                    "SGLangRolloutConfig.pad_token_id or meta_info['pad_token_id']"
                )
            self._pad_token_id = int(pad)
        return self._pad_token_id

    def _resolve_eos_token_ids(self) -> list[int]:
        """The ids SGLang stops on by default: generation config + model config + tokenizer EOS."""
        if self._eos_token_ids is None:
            from transformers import AutoConfig, GenerationConfig

            ids: list[int] = []
            path, trust = self.config.model_path, self.config.trust_remote_code
            try:
                ids += token_id_list(GenerationConfig.from_pretrained(path).eos_token_id)
            except OSError:  # no generation_config.json
                pass
            ids += token_id_list(AutoConfig.from_pretrained(path, trust_remote_code=trust).eos_token_id)
            ids += token_id_list(self._tokenizer_or_none().eos_token_id)
            self._eos_token_ids = sorted(set(ids))
        return list(self._eos_token_ids)

    def _check_seed(self, params: SamplingParams) -> None:
        if params.seed is not None and not self.config.deterministic and not self._warned_seed:
            self._warned_seed = True
            logger.warning(
                "SamplingParams.seed is set but the SGLang engine was started without "
                "enable_deterministic_inference (SGLangRolloutConfig.deterministic=False); SGLang ignores "
                "sampling_seed then, so seeded requests are not reproducible"
            )


def _split_by_dtype(bucket: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in bucket:
        groups.setdefault(tensor.dtype, []).append((name, tensor))
    return list(groups.values())


def _check_result(what: str, result: Any) -> None:
    """SGLang's weight calls return ``(success, message)``; raise on failure."""
    success, message = None, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        success, message = result
    elif isinstance(result, Mapping) and "success" in result:
        success, message = bool(result["success"]), result.get("message")
    if success is False:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def config_from_dict(cfg: Mapping[str, Any]) -> SGLangRolloutConfig:
    """An ``SGLangRolloutConfig`` from a plain mapping (e.g. an OmegaConf node); unknown keys are an error."""
    names = {f.name for f in dataclasses.fields(SGLangRolloutConfig)}
    unknown = sorted(set(cfg) - names)
    if unknown:
        raise KeyError(f"unknown SGLang rollout config key(s) {unknown}; known: {sorted(names)}")
    return SGLangRolloutConfig(**dict(cfg))
