"""Rollout on its own resource pool (disaggregated placement), and what every rollout role shares.

* `RolloutWorker(model, rollout)`: one full rollout replica per rank (the engine ``rollout.name`` names:
  `workers.rollout.registry`), no training engine. ``generate_sequences`` has the same contract as
  `workers.roles.actor_rollout.ActorRolloutWorker.generate_sequences` (``Dispatch.DP_SPLIT_PROTO``: one
  unpadded chunk of prompts per rank, since every prompt comes back ``n`` times); new weights arrive over a
  weight-sync process group (`workers.weight_sync.sync_group`) that it joins with ``init_weight_sync`` and
  reads with ``receive_weights``, driven from the controller by `workers.weight_sync.WeightSync`.
* Shared by both rollout roles: `RolloutEngineMixin` (the rank's engine, built from the config),
  `rollout_sampling_meta` (RolloutConfig defaults, validation settings), `run_rollout` (memory
  resume/release around a generation, placeholder rows of the split dispatch dropped, timings, token counts)
  and `on_engine_device`. Engines are used only through `workers.rollout.base.RolloutEngine`: what differs
  between them is what they declare (``swaps_weights_mid_generation``, ``device``, ...), never their class.
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
from workers.models import load_tokenizer
from workers.roles.sync_member import WeightSyncMember
from workers.rollout.base import RolloutEngine
from workers.rollout.registry import build_rollout_engine
from workers.weight_sync import DEFAULT_GROUP_NAME, stream_metrics

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------------
# Engines and generation
# ----------------------------------------------------------------------------------------------------------------


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
    ``rollout/tokens_per_s`` (this rank's chunk; a group call merges them over the ranks: ``dataproto/metrics_merge.py``), and on CUDA the generation's
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


def on_engine_device(engine: RolloutEngine, named_tensors):
    """``(name, tensor)`` pairs moved to the engine's device, as ``update_weights`` takes them."""
    device = engine.device
    return ((n, t.to(device)) for n, t in named_tensors)


# ----------------------------------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------------------------------


class RolloutEngineMixin:
    """The rollout engine of one rank (``self.rollout_engine``), for a worker with ``model_config``,
    ``rollout_config``, ``tokenizer``, ``rank`` and ``tag``."""

    rollout_engine: RolloutEngine | None = None

    def _require_rollout(self, method: str) -> RolloutEngine:
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
        """This rank's rollout replica's weights (CPU copies), for tests and debugging (engines that expose
        them: `RolloutEngine.named_weights`)."""
        engine = self._require_rollout("rollout_named_weights")
        return {n: t.detach().cpu().clone() for n, t in engine.named_weights() if names is None or n in names}


class RolloutWorker(RolloutEngineMixin, WeightSyncMember, Worker):
    """A rollout replica per rank on its own resource pool; receives weights from the trainer's rank 0.

    ``concurrent`` (asynchronous RL; the actor then runs with Ray ``max_concurrency`` > 1): weights and
    aborts may arrive while a generation runs. An engine that ``swaps_weights_mid_generation`` (native)
    receives the whole stream into a staging copy and swaps it in between two decode steps (generation pauses
    only for the copy; tokens after the swap record the new version, or the requests that started on the old
    weights are aborted at the swap); for any other (SGLang) weights change only between calls, so its receive
    waits for the running generation to finish."""

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
        ``abort_running`` (concurrent, an engine that swaps weights mid-generation): the requests that started on the old weights are
        aborted at the swap (flagged in ``rollout_aborted``) instead of going on with the new ones. Returns
        this rank's metrics (``timing_s/update_weights``, ``perf/weight_sync_bytes``, bucket/tensor counts,
        ``weight_sync/swap_s``: how long generation was held for the weights to change,
        ``weight_sync/aborted_requests``)."""
        t0 = time.perf_counter()
        engine = self._require_rollout("receive_weights")
        group = self.weight_sync_groups.require(group_name, f"{self.tag}: receive_weights")
        swap_mid_generation = self.concurrent and engine.swaps_weights_mid_generation
        if abort_running and not swap_mid_generation:
            raise ValueError(
                f"{self.tag}: abort_running needs a concurrent rollout worker whose engine swaps weights "
                f"mid-generation (concurrent={self.concurrent}, {type(engine).__name__}."
                f"swaps_weights_mid_generation={engine.swaps_weights_mid_generation})"
            )
        aborted = 0
        if swap_mid_generation:
            staged: list[tuple[str, torch.Tensor]] = []  # bucket views are reused: keep copies
            stats = group.receive(lambda named: staged.extend((n, t.clone()) for n, t in named))
            t_swap = time.perf_counter()
            # one swap, between two decode steps
            aborted = engine.update_weights(staged, version=version, abort_running=abort_running)
            swap_s = time.perf_counter() - t_swap
        else:  # weights change between calls only: after the running generation, if any
            with self._generating:
                engine.resume_memory(kv_cache=False)
                stats = group.receive(
                    lambda named: engine.update_weights(on_engine_device(engine, named), flush_cache=False)
                )
                t_swap = time.perf_counter()
                if stats["buckets"]:
                    engine.flush_cache()
                if version is not None:
                    engine.weight_version = int(version)
                swap_s = stats["apply_s"] + time.perf_counter() - t_swap
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
    "on_engine_device",
    "rollout_sampling_meta",
    "run_rollout",
]
