"""The rollout role: one rollout replica per rank (the engine ``rollout.name`` names: `workers.rollout.registry`).

`RolloutWorker(model, rollout)` in either placement; where its weights come from is the only difference:

* on its own resource pool (disaggregated), new weights arrive over a weight-sync process group
  (`workers.weight_sync.sync_group`) that it joins with ``init_weight_sync`` and reads with ``receive_weights``;
* colocated with the actor (``trainer=Shared("actor")``, `controller.colocate.Shared`: the hybrid engine,
  `workers.roles.hybrid_engine`), it reads them in process from the trainer (``sync_weights``, or
  ``sync_resharded_weights`` for tensor-parallel replicas) and offloads the trainer while it generates.

Both are driven from the controller by `workers.weight_sync.WeightSync`. ``generate_sequences`` (the "rollout"
mesh: one unpadded chunk of prompts per replica, since every prompt comes back ``n`` times) is `run_rollout`:
memory resume/release around a generation, placeholder rows of the split dispatch dropped, timings, token
counts; `rollout_sampling_meta` holds the RolloutConfig defaults and validation settings. Engines are used only
through `workers.rollout.base.RolloutEngine`: what differs between them is what they declare
(``swaps_weights_mid_generation``, ``device``, ...), never their class. An environment role (`workers.agents.
env_worker.EnvWorker`) shares this role to run agents on its engine.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from controller import PAD_ROWS_KEY, Dispatch, Worker, register
from dataproto import DataProto
from workers.config import ModelConfig, RolloutConfig
from workers.device_memory import PeakDeviceMemory
from workers.engine.base import LoRAConfig, as_resharding_engine
from workers.models import load_tokenizer
from workers.roles.hybrid_engine import (
    ROLLOUT_MESH,
    generation_tp_group,
    load_from_trainer,
    load_weights,
    rollout_tp_size,
)
from workers.roles.sync_member import WeightSyncMember
from workers.rollout.base import RolloutEngine
from workers.rollout.registry import build_rollout_engine
from workers.weight_sync import DEFAULT_GROUP_NAME, stream_metrics

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
# The role
# ----------------------------------------------------------------------------------------------------------------


class RolloutWorker(WeightSyncMember, Worker):
    """A rollout replica per rank; weights from a colocated ``trainer`` in process, else over a weight-sync group.

    ``trainer`` (colocated placement): the actor role of this process (an `ActorWorker`, passed as
    ``Shared("actor")``), whose engine is offloaded while this role generates and whose weights ``sync_weights``
    streams in. ``concurrent`` (asynchronous RL; the actor then runs with Ray ``max_concurrency`` > 1): weights
    and aborts may arrive while a generation runs. An engine that ``swaps_weights_mid_generation`` (native)
    receives the whole stream into a staging copy and swaps it in between two decode steps (generation pauses
    only for the copy; tokens after the swap record the new version, or the requests that started on the old
    weights are aborted at the swap); for any other (SGLang) weights change only between calls, so its receive
    waits for the running generation to finish."""

    def __init__(
        self,
        model: ModelConfig,
        rollout: RolloutConfig,
        concurrent: bool = False,
        trainer=None,
        lora: LoRAConfig | None = None,
    ):
        self.model_config = model
        self.rollout_config = rollout
        self.concurrent = concurrent
        self.trainer = trainer
        # the actor's LoRA settings (a colocated trainer's own, else given): the syncs then carry its adapter
        # alone where the engine loads adapters (``adapter``), else the weights with it merged in
        lora = trainer.actor_config.lora if trainer is not None else lora
        self.lora = lora if lora is not None and lora.enabled else None
        self.adapter: LoRAConfig | None = None  # set by init_model: self.lora where the engine loads adapters
        # tensor-parallel replicas over the trainer's ranks (3D-HybridEngine); 1 on a pool of its own
        self.rollout_tp = 1 if trainer is None else rollout_tp_size(trainer.actor_config, rollout, self.tag)
        self.rollout_engine: RolloutEngine | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.sync_count = 0  # weight syncs received
        # one generation at a time (the engine batches within a call); an env role sharing this one takes it too
        self.generating = threading.Lock()

    def _require_rollout(self, method: str) -> RolloutEngine:
        if self.rollout_engine is None:
            raise RuntimeError(f"{self.tag}: {method} called before init_model()")
        return self.rollout_engine

    def _require_trainer(self, method: str):
        if self.trainer is None:
            raise RuntimeError(
                f"{self.tag}: {method} reads weights from a colocated trainer, but this rollout role has none "
                "(on a pool of its own, weights arrive through receive_weights)"
            )
        return self.trainer

    def before_generate(self) -> None:
        """Free the device for generation: offload the colocated trainer (until its next use)."""
        if self.trainer is not None:
            self.trainer.offload_engine()

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build this rank's engine from ``model.path`` (colocated: after the actor's ``init_model``, whose
        tokenizer and, for tensor-parallel replicas, reshard plan it uses); its KV cache is released until the
        first generation when ``rollout.free_cache_engine``, and a colocated trainer offloaded."""
        m = self.model_config
        if self.trainer is not None and self.trainer.tokenizer is None:
            raise RuntimeError(f"{self.tag}: init_model before the colocated actor's init_model")
        tp_group = None
        if self.rollout_tp > 1:
            tp_group, replica, gen_tp_rank = generation_tp_group(
                self.trainer.engine, self.rollout_tp, self.tag
            )
            self.register_dispatch_collect_info("rollout", replica, gen_tp_rank == 0)
        else:  # one full replica per rank
            self.register_dispatch_collect_info("rollout", self.rank, True)
        if self.trainer is not None:
            self.tokenizer = self.trainer.tokenizer
        else:
            self.tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
        self.rollout_engine = build_rollout_engine(
            m, self.rollout_config, self.tokenizer, rank=self.rank, tp_group=tp_group
        )
        if self.lora is not None:
            if self.rollout_engine.loads_adapters:
                self.adapter = self.lora
            elif self.rank == 0:
                logger.warning(
                    "%s: rollout.name=%s does not load LoRA adapters (%s.loads_adapters is False): every weight "
                    "sync sends the full weights with the adapter merged in",
                    self.tag, self.rollout_config.name, type(self.rollout_engine).__name__,
                )  # fmt: skip
        if self.rollout_config.free_cache_engine:
            self.rollout_engine.release_memory()
        self.before_generate()

    @register(ROLLOUT_MESH)
    def generate_sequences(self, data: DataProto) -> DataProto:
        """Responses for this replica's chunk of prompts (left-padded ``input_ids``/``attention_mask``).

        ``meta_info`` may set ``n``, ``temperature``, ``top_p``, ``top_k``, ``do_sample``, ``validate``
        (defaults: rollout.temperature / rollout.n, or val_temperature / val_n when validating),
        ``response_length``, ``seed``, ``stop_token_ids``. Rows come back repeated ``n`` times (a, a, b, b);
        output keys as in dataproto/BATCH_LAYOUT.md. With ``rollout.tensor_model_parallel_size > 1`` every rank
        of a replica generates the same chunk in lockstep and one of them is collected. ``meta_info`` gains
        ``temperature`` (of the reported log-probs), ``eos_token_id``, ``pad_token_id``, ``timing_s/gen`` and
        ``rollout/*`` token counts (`run_rollout`)."""
        engine = self._require_rollout("generate_sequences")
        with self.generating:
            self.before_generate()
            return run_rollout(engine, data, self.rollout_config, tag=self.tag)

    @register(Dispatch.ONE_TO_ALL)
    def rollout_named_weights(self, names: list[str] | None = None) -> dict:
        """This rank's rollout replica's weights (CPU copies), for tests and debugging (engines that expose
        them: `RolloutEngine.named_weights`)."""
        engine = self._require_rollout("rollout_named_weights")
        return {n: t.detach().cpu().clone() for n, t in engine.named_weights() if names is None or n in names}

    # -- weights from a colocated trainer ---------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL_RANK_ZERO)
    def sync_weights(self, version: int | None = None) -> dict:
        """Load the colocated trainer's current weights into every rank's replica (as policy ``version``, which
        the generated tokens then record), then offload the trainer.

        Collective over the trainer group (every rank gathers every parameter); each rank's replica receives
        the full tensors. Returns rank 0's metrics: ``timing_s/update_weights`` (the whole call),
        ``perf/weight_sync_bytes`` (tensor bytes loaded into one replica), ``weight_sync/tensors``,
        ``weight_sync/load_s`` (gather + load), ``weight_sync/offload_s``. Tensor-parallel replicas
        (``rollout.tensor_model_parallel_size > 1``) take ``sync_resharded_weights`` instead."""
        if self.rollout_tp > 1:
            raise RuntimeError(
                f"{self.tag}: rollout.tensor_model_parallel_size={self.rollout_tp}: the replicas load "
                "generation shards (sync_resharded_weights), not full tensors"
            )
        trainer, engine = self._require_trainer("sync_weights"), self._require_rollout("sync_weights")
        # reloads an offloaded trainer
        stream = trainer.hf_weight_stream(device=engine.device, adapter_only=self.adapter is not None)
        return self._counted_sync(load_from_trainer(trainer, engine, stream, version, self.adapter))

    @register(Dispatch.ONE_TO_ALL_RANK_ZERO)
    def sync_resharded_weights(self, version: int | None = None) -> dict:
        """``sync_weights`` for tensor-parallel rollout replicas: this rank's generation shards straight from
        the 3D-HybridEngine reshard (collective over the micro-DP groups; the native engine all-gathers
        vocabulary shards in its TP group, in the same name order on every rank). ``perf/weight_sync_bytes``
        is what rank 0's replica shard holds; ``weight_sync/bytes_received`` / ``bytes_sent`` what the
        reshard moved."""
        if self.rollout_tp == 1:
            raise RuntimeError(f"{self.tag}: rollout.tensor_model_parallel_size=1: use sync_weights")
        trainer = self._require_trainer("sync_resharded_weights")
        engine = self._require_rollout("sync_resharded_weights")
        # reloads an offloaded trainer
        shards = as_resharding_engine(trainer._require_engine("sync_resharded_weights"), self.tag)
        stream = shards.generation_shard_iter(self.rollout_tp)
        metrics = self._counted_sync(load_from_trainer(trainer, engine, stream, version))
        # counts of the stream just consumed (the engine keeps one Resharder per generation TP size)
        reshard = shards.reshard_stats(self.rollout_tp)
        return metrics | {
            "weight_sync/bytes_received": reshard.bytes_received,  # moved by the reshard (0: shard in place)
            "weight_sync/bytes_sent": reshard.bytes_sent,
            "weight_sync/gen_shard_bytes": metrics["perf/weight_sync_bytes"],
            "weight_sync/held_bytes": reshard.held_bytes,
            "weight_sync/peak_transient_bytes": reshard.peak_transient_bytes,
            "weight_sync/rollout_tp": self.rollout_tp,
        }

    def _counted_sync(self, metrics: dict) -> dict:
        self.sync_count += 1
        return metrics | {"weight_sync/count": self.sync_count}

    # -- weights over a weight-sync group ---------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(
        self,
        group_name: str = DEFAULT_GROUP_NAME,
        version: int | None = None,
        abort_running: bool = False,
        adapter_only: bool = False,
    ) -> dict:
        """Receive one full weight stream from the trainer into this rank's engine, as policy ``version``
        (``adapter_only``: the actor's LoRA adapter alone, which this rank's engine must load: `adapter`);
        ``abort_running`` (concurrent, an engine that swaps weights mid-generation): the requests that started
        on the old weights are aborted at the swap (flagged in ``rollout_aborted``) instead of going on with the
        new ones. Returns this rank's metrics (``timing_s/update_weights``, ``perf/weight_sync_bytes``,
        bucket/tensor counts, ``weight_sync/swap_s``: how long generation was held for the weights to change,
        ``weight_sync/aborted_requests``)."""
        t0 = time.perf_counter()
        engine = self._require_rollout("receive_weights")
        group = self.weight_sync_groups.require(group_name, f"{self.tag}: receive_weights")
        if adapter_only and self.adapter is None:
            raise ValueError(
                f"{self.tag}: receive_weights(adapter_only=True), but this rank loads no adapter (lora="
                f"{self.lora}, {type(engine).__name__}.loads_adapters={engine.loads_adapters})"
            )
        adapter = self.adapter if adapter_only else None
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
            aborted = load_weights(
                engine, staged, adapter=adapter, version=version, abort_running=abort_running
            )
            swap_s = time.perf_counter() - t_swap
        else:
            # Weights change between calls only: wait for the running generation, if any. Without
            # ``concurrent`` nothing else runs in this actor, so the lock is free at once.
            with self.generating:
                engine.resume_memory(kv_cache=False)
                if adapter is not None:  # one adapter at once (a wrapped weight needs its A and B together)
                    staged = []
                    stats = group.receive(lambda named: staged.extend((n, t.clone()) for n, t in named))
                    load_weights(engine, on_engine_device(engine, staged), adapter=adapter, version=version)
                else:  # every bucket's call carries the version (nothing generates until the stream ends)
                    stats = group.receive(
                        lambda named: engine.update_weights(
                            on_engine_device(engine, named), version=version, flush_cache=False
                        )
                    )
                    if not stats["buckets"] and version is not None:  # no weights: the version alone
                        engine.update_weights((), version=version, flush_cache=False)
                t_swap = time.perf_counter()
                if stats["buckets"]:
                    engine.flush_cache()
                swap_s = stats["apply_s"] + time.perf_counter() - t_swap
        return self._counted_sync(
            stream_metrics(stats, time.perf_counter() - t0)
            | {
                "weight_sync/apply_s": stats["apply_s"],
                "weight_sync/swap_s": swap_s,
                "weight_sync/aborted_requests": aborted,
            }
        )


__all__: list[str] = [
    "RolloutWorker",
    "on_engine_device",
    "rollout_sampling_meta",
    "run_rollout",
]
