"""Rollout on its own resource pool (disaggregated placement), and what every rollout role shares.

* `RolloutWorker(model, rollout)`: one full rollout replica per rank (native engine, or SGLang when
  ``rollout.name == "sglang"``), no training engine. ``generate_sequences`` has the same contract as
  `workers.roles.actor_rollout.ActorRolloutWorker.generate_sequences` (``Dispatch.DP_SPLIT_PROTO``: one
  unpadded chunk of prompts per rank, since every prompt comes back ``n`` times); new weights arrive over a
  weight-sync process group (`workers.weight_sync.sync_group`) that it joins with ``init_weight_sync`` and
  reads with ``receive_weights``, driven from the controller by `workers.weight_sync.WeightSync`.
* Shared by both rollout roles: `RolloutEngineMixin` (the rank's engine, built from the config),
  `build_rollout_engine`, `rollout_sampling_meta` (RolloutConfig defaults, validation settings),
  `run_rollout` (memory resume/release around a generation, placeholder rows of the split dispatch dropped,
  timings, token counts) and `load_weights_into` (either engine).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from controller import PAD_ROWS_KEY, Dispatch, Worker, register
from dataproto import DataProto
from workers.config import ModelConfig, RolloutConfig
from workers.device_memory import PeakDeviceMemory
from workers.engine.distributed import default_device
from workers.models import load_config, load_model, load_tokenizer, pad_token_id_of, resolve_dtype
from workers.models.loading import build_on_meta, can_build_on_meta
from workers.models.meta_init import full_tensors, use_placeholders
from workers.roles.sync_member import WeightSyncMember
from workers.rollout.native import EngineConfig, NativeEngine
from workers.rollout.sampling import SamplingParams
from workers.rollout.sglang import SGLangRollout, SGLangRolloutConfig
from workers.weight_sync import DEFAULT_GROUP_NAME, stream_metrics

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------------
# Engines and generation
# ----------------------------------------------------------------------------------------------------------------


def build_rollout_engine(
    model: ModelConfig, rollout: RolloutConfig, tokenizer, *, rank: int = 0, tp_group=None
):
    """The rollout engine of one rank, loaded from ``model.path`` (a random-init directory: its seeded weights): `NativeEngine` (``rollout.name ==
    "native"``) or `SGLangRollout` (``"sglang"``). Pad/EOS ids come from the tokenizer (and the model's
    generation config for EOS); responses are padded to ``rollout.response_length``; sampling streams are
    seeded from ``(rollout.seed, rank)`` so data-parallel ranks draw different samples. ``tp_group``: the
    torch.distributed group of this rank's tensor-parallel native replica (None: a full replica)."""
    seed = rollout.seed * 1_000_003 + rank
    if rollout.name == "native":
        hf_config = load_config(model.path, trust_remote_code=model.trust_remote_code)
        max_len = rollout.prompt_length + rollout.response_length
        max_pos = getattr(hf_config, "max_position_embeddings", None)
        if max_pos:
            max_len = min(max_len, int(max_pos))
        cfg = EngineConfig(
            max_num_seqs=rollout.max_num_seqs,
            max_model_len=max_len,
            dtype=resolve_dtype(rollout_dtype(model, rollout)),
            device=str(default_device()),
            pad_token_id=pad_token_id_of(tokenizer, hf_config),
            response_length=rollout.response_length,
            seed=seed,
        )
        load = dict(dtype=cfg.dtype, attn_implementation=None, trust_remote_code=model.trust_remote_code)
        if not can_build_on_meta(model.path):
            return NativeEngine(load_model(model.path, **load), tokenizer, cfg, tp_group=tp_group)
        # One copy of the weights, the engine's: its layout is made from a model without weights, then the
        # weights are read in one tensor at a time (a random-init directory: the trainer's seeded weights).
        hf_model, source = build_on_meta(model.path, **load)
        engine = NativeEngine(use_placeholders(hf_model), tokenizer, cfg, tp_group=tp_group)
        engine.update_weights(full_tensors(hf_model, source))
        return engine
    if rollout.name == "sglang":
        if tp_group is not None:
            raise ValueError("rollout.name='sglang' takes no tp_group (SGLang: rollout.tensor_parallel_size)")
        device = default_device().type  # "cuda", or "cpu": SGLang's CPU engine (tests, CI)
        engine_kwargs = {"max_running_requests": rollout.max_num_seqs}
        if device == "cpu":  # no GPU memory to size the KV cache from: room for max_num_seqs whole sequences
            max_tokens = rollout.max_num_seqs * (rollout.prompt_length + rollout.response_length)
            engine_kwargs |= {"max_total_tokens": max_tokens, "chunked_prefill_size": min(max_tokens, 2048)}
            engine_kwargs["sleep_on_idle"] = True  # an idle scheduler otherwise busy-polls a core
        cfg = SGLangRolloutConfig(
            model_path=model.path,
            device=device,
            tp_size=rollout.tensor_parallel_size,
            mem_fraction_static=rollout.gpu_memory_utilization,
            dtype=rollout_dtype(model, rollout),
            seed=seed,
            bucket_mb=rollout.weight_bucket_mb,
            trust_remote_code=model.trust_remote_code,
            response_length=rollout.response_length,
            pad_token_id=pad_token_id_of(tokenizer),
            sampling=SamplingParams(
                max_new_tokens=rollout.response_length,
                temperature=rollout.temperature,
                top_p=rollout.top_p,
                top_k=rollout.top_k,
            ),
            engine_kwargs=engine_kwargs,
        )
        return SGLangRollout(cfg)
    raise ValueError(f"rollout.name must be 'native' or 'sglang', got {rollout.name!r}")


def rollout_dtype(model: ModelConfig, rollout: RolloutConfig) -> str:
    """The name of the rollout engine's weight and KV-cache dtype: ``rollout.dtype``, where ``auto`` is bfloat16
    on CUDA (what every peer samples in: half the weight and KV bytes that decode streams) and the training dtype
    (``model.dtype``) on CPU, where bfloat16 matmuls are slower than float32 ones."""
    if rollout.dtype != "auto":
        return rollout.dtype
    return "bfloat16" if default_device().type == "cuda" else model.dtype


def rollout_sampling_meta(rollout: RolloutConfig, meta: dict) -> dict:
    """The sampling settings of one ``generate_sequences`` call, as the engines' ``meta_info`` keys.

    Keys in ``meta`` win; the defaults come from ``rollout``: ``temperature``/``n`` (``val_temperature``/
    ``val_n`` when ``meta["validate"]``), ``top_p``, ``top_k``, ``response_length``. ``do_sample`` defaults
    to ``temperature > 0``; ``do_sample=False`` means greedy and n = 1.
    """
    validate = bool(meta.get("validate", False))
    temperature = float(meta.get("temperature", rollout.val_temperature if validate else rollout.temperature))
    n = int(meta.get("n", rollout.val_n if validate else rollout.n))
    do_sample = bool(meta.get("do_sample", temperature > 0))
    if n < 1:
        raise ValueError(f"rollout n must be >= 1, got {n}")
    return {
        "validate": validate,
        "do_sample": do_sample,
        "temperature": temperature,
        "top_p": float(meta.get("top_p", rollout.top_p)),
        "top_k": int(meta.get("top_k", rollout.top_k)),
        "n": n if do_sample else 1,
        "response_length": int(meta.get("response_length", rollout.response_length)),
    }


def run_rollout(engine, data: DataProto, rollout: RolloutConfig, *, tag: str) -> DataProto:
    """Generate for one rank's chunk: resume the engine's memory, generate, and release the KV cache
    afterwards when ``rollout.free_cache_engine``.

    Output: the engine's batch (dataproto/BATCH_LAYOUT.md keys, rows repeated ``n`` times interleaved),
    placeholder rows of the dispatch dropped, and ``meta_info`` = input meta + the sampling settings used
    (``temperature`` is the one ``rollout_log_probs`` were computed at: 1.0 for greedy) + ``eos_token_id``,
    ``pad_token_id``, ``timing_s/gen`` (this rank, memory resume/release included),
    ``rollout/generated_tokens``, ``rollout/prompt_tokens``, ``rollout/num_sequences``,
    ``rollout/tokens_per_s`` (this rank's chunk; a group call reports rank 0's), and on CUDA the generation's
    peak device memory (``perf/max_memory_allocated_gib/gen``, ``perf/max_memory_reserved_gib/gen``)."""
    t0 = time.perf_counter()
    if not isinstance(data, DataProto):
        raise TypeError(f"{tag}: generate_sequences takes a DataProto, got {type(data).__name__}")
    missing = [k for k in ("input_ids", "attention_mask") if k not in data.batch]
    if missing:
        raise KeyError(
            f"{tag}: generate_sequences needs left-padded prompt keys {missing}; the batch has {sorted(data.batch)}"
        )
    meta = dict(data.meta_info)
    pad_rows = int(meta.pop(PAD_ROWS_KEY, 0))
    settings = rollout_sampling_meta(rollout, meta)
    meta.update(settings)
    request = DataProto(batch=data.batch, non_tensor_batch=data.non_tensor_batch, meta_info=meta)

    with PeakDeviceMemory("gen") as peak:
        engine.resume_memory()
        try:
            out = engine.generate_sequences(request)
        except BaseException:
            if rollout.free_cache_engine:
                try:
                    engine.release_memory()
                except Exception:  # the engine may still hold the failed requests; keep the original error
                    logger.exception("%s: releasing the KV cache after a failed generation also failed", tag)
            raise
        if rollout.free_cache_engine:
            engine.release_memory()

    rows_per_prompt = len(out) // len(data)
    if pad_rows:
        out = out.slice(0, len(out) - pad_rows * rows_per_prompt)
    elapsed = time.perf_counter() - t0
    generated = int(out.batch["response_mask"].sum()) if len(out) else 0
    prompt_tokens = (
        int(out.batch["attention_mask"][:, : out.batch["prompts"].shape[1]].sum()) if len(out) else 0
    )
    sampled = settings["do_sample"] and settings["temperature"] > 0
    out.meta_info.pop(PAD_ROWS_KEY, None)
    out.meta_info.update(
        {
            "temperature": settings["temperature"] if sampled else 1.0,
            "n": rows_per_prompt,
            "timing_s/gen": elapsed,
            "rollout/generated_tokens": generated,
            "rollout/prompt_tokens": prompt_tokens,
            "rollout/num_sequences": len(out),
            "rollout/tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
            **peak.metrics,
        }
    )
    return out


def is_sglang(engine) -> bool:
    return type(engine).__name__ == "SGLangRollout"


def rollout_device(engine):
    """The torch device an engine's weights live on (SGLang: this process's current GPU, or the CPU)."""
    if not is_sglang(engine):
        return engine.model.device
    if engine.config.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def load_weights_into(engine, named_tensors, flush_cache: bool = True, version: int | None = None) -> None:
    """``engine.update_weights`` for either engine (SGLang: tensors moved to its device, prefix cache flushed
    only when ``flush_cache``); ``version`` (the trainer's update count) becomes the engine's
    ``weight_version`` once the tensors are in."""
    if is_sglang(engine):
        device = rollout_device(engine)
        named = ((n, t.to(device)) for n, t in named_tensors)
        engine.update_weights(named, flush_cache=flush_cache, version=version)
    else:
        engine.update_weights(named_tensors, version=version)


# ----------------------------------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------------------------------


class RolloutEngineMixin:
    """The rollout engine of one rank (``self.rollout_engine``), for a worker with ``model_config``,
    ``rollout_config``, ``tokenizer``, ``rank`` and ``tag``."""

    rollout_engine = None

    def _require_rollout(self, method: str):
        if self.rollout_engine is None:
            raise RuntimeError(f"{self.tag}: {method} called before init_model()")
        return self.rollout_engine

    def _build_rollout_engine(self, tp_group=None) -> None:
        """Build this rank's engine (`build_rollout_engine`); its KV cache is released until the first
        generation when ``rollout.free_cache_engine``."""
        self.rollout_engine = build_rollout_engine(
            self.model_config, self.rollout_config, self.tokenizer, rank=self.rank, tp_group=tp_group
        )
        if self.rollout_config.free_cache_engine:
            self.rollout_engine.release_memory()

    @register(Dispatch.ONE_TO_ALL)
    def rollout_named_weights(self, names: list[str] | None = None) -> dict:
        """This rank's rollout replica's weights (CPU copies), for tests and debugging; native engine only."""
        engine = self._require_rollout("rollout_named_weights")
        if is_sglang(engine):
            raise NotImplementedError(f"{self.tag}: rollout_named_weights reads the native engine's store")
        return {n: t.detach().cpu().clone() for n, t in engine.named_weights() if names is None or n in names}


class RolloutWorker(RolloutEngineMixin, WeightSyncMember, Worker):
    """A rollout replica per rank on its own resource pool; receives weights from the trainer's rank 0.

    ``concurrent`` (asynchronous RL; the actor then runs with Ray ``max_concurrency`` > 1): weights and
    aborts may arrive while a generation runs. The native engine receives the whole stream into a staging
    copy and swaps it in between two decode steps (generation pauses only for the copy; tokens after the swap
    record the new version, or the requests that started on the old weights are aborted at the swap);
    SGLang's weights change only between calls, so its receive waits for the running generation to finish."""

    def __init__(self, model: ModelConfig, rollout: RolloutConfig, concurrent: bool = False):
        self.model_config = model
        self.rollout_config = rollout
        self.concurrent = concurrent
        self.tokenizer = None
        self.sync_count = 0  # weight syncs received
        self._generating = threading.Lock()  # one generation at a time (the engine batches within a call)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the tokenizer and build this rank's rollout engine from ``model.path``."""
        m = self.model_config
        self.tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
        self._build_rollout_engine()

    @register(Dispatch.DP_SPLIT_PROTO)
    def generate_sequences(self, data: DataProto) -> DataProto:
        """Responses for this rank's chunk of prompts (see `run_rollout` for the output contract)."""
        engine = self._require_rollout("generate_sequences")
        with self._generating:
            return run_rollout(engine, data, self.rollout_config, tag=self.tag)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(
        self, group_name: str = DEFAULT_GROUP_NAME, version: int | None = None, abort_running: bool = False
    ) -> dict:
        """Receive one full weight stream from the trainer into this rank's engine, as policy ``version``;
        ``abort_running`` (concurrent, native engine): the requests that started on the old weights are
        aborted at the swap (flagged in ``rollout_aborted``) instead of going on with the new ones. Returns
        this rank's metrics (``timing_s/update_weights``, ``perf/weight_sync_bytes``, bucket/tensor counts,
        ``weight_sync/swap_s``: how long generation was held for the weights to change,
        ``weight_sync/aborted_requests``)."""
        t0 = time.perf_counter()
        engine = self._require_rollout("receive_weights")
        group = self.weight_sync_groups.require(group_name, f"{self.tag}: receive_weights")
        if abort_running and (not self.concurrent or is_sglang(engine)):
            raise ValueError(
                f"{self.tag}: abort_running needs a concurrent rollout worker with the native engine "
                f"(concurrent={self.concurrent}, engine {type(engine).__name__})"
            )
        aborted = 0
        if not self.concurrent:
            engine.resume_memory(kv_cache=False)
            stats = group.receive(lambda named: load_weights_into(engine, named, flush_cache=False))
            if is_sglang(engine) and stats["buckets"]:
                engine.flush_cache()
            if version is not None:
                engine.weight_version = int(version)
            swap_s = stats["apply_s"]
        elif is_sglang(engine):  # weights change between calls only: after the running generation
            with self._generating:
                engine.resume_memory(kv_cache=False)
                stats = group.receive(lambda named: load_weights_into(engine, named, flush_cache=False))
                t_swap = time.perf_counter()
                engine.flush_cache()
                if version is not None:
                    engine.weight_version = int(version)
                swap_s = stats["apply_s"] + time.perf_counter() - t_swap
        else:
            staged: list[tuple[str, torch.Tensor]] = []  # bucket views are reused: keep copies
            stats = group.receive(lambda named: staged.extend((n, t.clone()) for n, t in named))
            t_swap = time.perf_counter()
            # one swap, between two decode steps
            aborted = engine.update_weights(staged, version=version, abort_running=abort_running)
            swap_s = time.perf_counter() - t_swap
        self.sync_count += 1
        return stream_metrics(stats, time.perf_counter() - t0) | {
            "weight_sync/apply_s": stats["apply_s"],
            "weight_sync/swap_s": swap_s,
            "weight_sync/aborted_requests": aborted,
            "weight_sync/count": self.sync_count,
        }


__all__: list[str] = [
    "RolloutEngineMixin",
    "RolloutWorker",
    "build_rollout_engine",
    "is_sglang",
    "load_weights_into",
    "rollout_device",
    "rollout_sampling_meta",
    "run_rollout",
]
