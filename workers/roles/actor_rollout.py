"""The hybrid actor-rollout worker (colocated placement) and the trainer side of disaggregated weight sync.

`ActorRolloutWorker(model, actor, rollout)` is an `ActorWorker` (FSDP2 training engine: log-probs, PPO
updates, SFT steps, checkpoints) that also holds a full rollout replica on the same device: the native
engine by default, or the one ``rollout.name`` names (`workers.rollout.registry`). The two time-share the device:

    init_model          build both; the trainer is then offloaded until its first use
    generate_sequences  offload the trainer (if resident), resume the rollout KV cache, generate,
                        release the KV cache (rollout.free_cache_engine)
    compute_log_prob,   the trainer is reloaded on first use (the `_require_engine` hook every engine
    update_actor, ...   method of ActorWorker goes through)
    sync_weights        stream the full weights from the FSDP2 shards into this rank's rollout replica,
                        then offload the trainer (parameters and optimizer state) for generation
                        (`workers.weight_sync.WeightSync`'s colocated strategy)

On CPU ``offload``/``reload`` do not move anything; the calls are kept so the order is the same on GPU.

Weight streaming (``sync_weights``): ``FSDPEngine.full_state_dict_iter`` all-gathers one parameter at a
time (every rank takes part in every gather: each DTensor's ``full_tensor()`` is a collective over the
FSDP group) and each rank feeds the full tensor straight into its own rollout replica, so the peak extra
memory is one full parameter (the native engine copies into its weight store in place; SGLang groups
them into ``rollout.weight_bucket_mb`` buckets). Tied embeddings travel once.

3D-HybridEngine (``rollout.tensor_model_parallel_size = tp_g > 1``, Megatron actor only): the rollout
replicas are ``tp_g``-way tensor parallel on the trainer's own ranks (``MegatronEngine.reshard_plan(tp_g)``:
generation replica ``gen_coords(rank)[0]``, its ranks ``gen_tp_group``). ``init_model`` creates every
generation-TP process group on every rank in one fixed order (group creation is collective) and builds the
native engine on this rank's group; ``sync_resharded_weights`` (the resharded strategy) feeds it
``engine.generation_shard_iter(tp_g)`` (the micro-DP regrouped reshard: each rank receives only the part of
its generation shard that it does not already hold: ``M/tp_g - M/(tp*pp)`` bytes); ``generate_sequences``
dispatches on the "rollout" mesh (`ROLLOUT_MESH`, the split mode over replicas): all ranks of a replica get
the same prompts and generate in lockstep, only its generation-TP rank 0 is collected. With ``tp_g == 1``
the mesh is one replica per rank, all collected (``Dispatch.DP_SPLIT_PROTO``), and the weights travel as
full tensors through ``sync_weights`` as described above.

Disaggregated placement (`WeightSenderMixin`, `DisaggregatedActorWorker`): the trainer group's rank 0
joins a separate weight-sync process group with every rank of a `workers.roles.rollout.RolloutWorker`
group. ``send_weights`` runs on every trainer rank (all take part in the gathers); rank 0 packs the full
tensors into size-bounded buckets (``rollout.weight_bucket_mb``, or ``bucket_bytes``), flattens each
into one buffer and broadcasts it. The controller drives it with `workers.weight_sync.WeightSync`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from controller import (
    Dispatch,
    get_dispatch_mode,
    make_nd_split_dataproto_dispatch_fn,
    register,
    registered_methods,
)
from dataproto import DataProto
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.roles.actor import ActorWorker
from workers.roles.rollout import RolloutEngineMixin, run_rollout
from workers.roles.sync_member import WeightSyncMember
from workers.rollout.registry import rollout_engine_class
from workers.weight_sync import (
    DEFAULT_GROUP_NAME,
    bucket_mb_to_bytes,
    hf_named_tensors,
    stream_metrics,
    tensor_nbytes,
)


def rollout_tp_size(actor: ActorConfig, rollout: RolloutConfig, tag: str) -> int:
    """``rollout.tensor_model_parallel_size`` checked against the actor (errors name the keys)."""
    tp_g = rollout.tensor_model_parallel_size
    if not isinstance(tp_g, int) or tp_g < 1:
        raise ValueError(f"{tag}: rollout.tensor_model_parallel_size must be an int >= 1, got {tp_g!r}")
    if tp_g == 1:
        return 1
    if actor.strategy != "megatron":
        raise ValueError(
            f"{tag}: rollout.tensor_model_parallel_size={tp_g} needs actor.strategy=megatron (the "
            "3D-HybridEngine reshards Megatron TP shards into the rollout replicas); an FSDP trainer streams "
            f"full tensors and has no TP layout to reshard from (actor.strategy={actor.strategy!r}): use 1"
        )
    tp = actor.megatron.tensor_model_parallel_size
    if tp % tp_g:
        raise ValueError(
            f"{tag}: rollout.tensor_model_parallel_size={tp_g} must divide "
            f"actor.megatron.tensor_model_parallel_size={tp} (a generation shard is a union of whole training "
            "shards)"
        )
    if not rollout_engine_class(rollout.name).accepts_tp_group:
        raise ValueError(
            f"{tag}: rollout.tensor_model_parallel_size={tp_g} is for the native engine or another that can be a "
            f"tensor-parallel replica on the trainer's ranks; got rollout.name={rollout.name!r} (SGLang: "
            "rollout.tensor_parallel_size)"
        )
    return tp_g


def _counted(stream, stats: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in stream:
        stats["tensors"] += 1
        stats["bytes"] += tensor_nbytes(tensor)
        yield name, tensor


# Generation methods of the colocated actor-rollout worker: one chunk per generation replica ("rollout" mesh).
ROLLOUT_MESH = make_nd_split_dataproto_dispatch_fn("rollout")


class WeightSenderMixin(WeightSyncMember):
    """Trainer side of the disaggregated weight sync. Needs ``self.engine`` (an `FSDPEngine`, through
    ``self._require_engine``), ``self.rollout_config``, ``self.rank`` and ``self.tag`` (an `ActorWorker`
    has them all)."""

    def hf_weight_stream(
        self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` for every parameter (and persistent buffer) of the training model, one
        all-gather at a time. Collective: every rank of the trainer group must consume it to the end."""
        engine = self._require_engine("hf_weight_stream")
        tied = bool(getattr(engine.hf_config, "tie_word_embeddings", False))
        return hf_named_tensors(
            engine.full_state_dict_iter(device=device, dtype=dtype), tie_word_embeddings=tied
        )

    @register(Dispatch.RANK_ZERO)
    def open_weight_sync_store(
        self, world_size: int, group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = 300.0
    ) -> tuple[str, int]:
        """Host the weight-sync group's TCPStore on this process (trainer rank 0) on a port the OS picks;
        returns ``(node address, port)`` for the rollout ranks to dial. ``init_weight_sync`` then joins
        through it."""
        return self.weight_sync_groups.host_store(group_name, world_size, timeout_s)

    @register(Dispatch.ONE_TO_ALL_RANK_ZERO)
    def send_weights(self, bucket_bytes: int | None = None, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        """Broadcast the full weights to the weight-sync group; every trainer rank must run it (each takes
        part in gathering every parameter), rank 0 sends. Buckets hold at most ``bucket_bytes`` (default
        ``rollout.weight_bucket_mb`` MiB); a larger tensor travels alone. Returns rank 0's metrics."""
        t0 = time.perf_counter()
        if bucket_bytes is None:
            bucket_bytes = bucket_mb_to_bytes(self.rollout_config.weight_bucket_mb)
        group = self.weight_sync_groups.get(group_name) if self.rank == 0 else None
        if self.rank == 0 and group is None:
            # Still consume the stream so the other ranks' gathers do not hang, then fail.
            for _ in self.hf_weight_stream():
                pass
            self.weight_sync_groups.require(group_name, f"{self.tag}: send_weights")
        if group is None:  # ranks > 0: take part in the gathers only (full tensors stay where they are made)
            for _ in self.hf_weight_stream(device=self._require_engine("send_weights").device):
                pass
            return {}
        stream = self.hf_weight_stream(device=group.device)
        try:
            stats = group.send(stream, bucket_bytes)
        finally:
            for _ in stream:  # a failed broadcast must not leave the other trainer ranks in a gather
                pass
        return stream_metrics(stats, time.perf_counter() - t0) | {
            "weight_sync/max_bucket_bytes": stats["max_bucket_bytes"],
            "weight_sync/bucket_bytes": bucket_bytes,
        }


class DisaggregatedActorWorker(WeightSenderMixin, ActorWorker):
    """A training-only actor that feeds a separate rollout pool (`workers.roles.rollout.RolloutWorker`)
    through `workers.weight_sync.WeightSync`'s disaggregated strategy."""


class ActorRolloutWorker(RolloutEngineMixin, WeightSenderMixin, ActorWorker):
    """FSDP2 actor + rollout replica in one process per rank (colocated, time-sharing the device)."""

    def __init__(self, model: ModelConfig, actor: ActorConfig, rollout: RolloutConfig):
        super().__init__(model, actor, rollout)
        self._trainer_offloaded = False
        self.sync_count = 0  # weight syncs into the rollout replica
        self.rollout_tp = rollout_tp_size(actor, rollout, self.tag)
        if self.rollout_tp > 1:
            # every generation method must give the ranks of one TP replica the same prompts
            per_rank = sorted(
                n
                for n, spec in registered_methods(type(self)).items()
                if get_dispatch_mode(spec.dispatch_mode) is get_dispatch_mode(Dispatch.DP_SPLIT_PROTO)
            )
            if per_rank:
                raise ValueError(
                    f"{self.tag}: rollout.tensor_model_parallel_size={self.rollout_tp} needs every generation "
                    f"method on the 'rollout' mesh, but {type(self).__name__}.{per_rank} dispatch one chunk per "
                    "rank (Dispatch.DP_SPLIT_PROTO), which would give the TP ranks of a replica different prompts"
                )

    # -- time-sharing -----------------------------------------------------------------------------------------

    def _require_engine(self, method: str):
        """Every engine method of ActorWorker starts here: bring the trainer back if generation had it."""
        engine = super()._require_engine(method)
        if self._trainer_offloaded:
            engine.reload()
            self._trainer_offloaded = False
        return engine

    def _offload_trainer(self) -> float:
        t0 = time.perf_counter()
        if self.engine is not None and not self._trainer_offloaded:
            self.engine.offload()
            self._trainer_offloaded = True
        return time.perf_counter() - t0

    # -- setup ------------------------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the training engine (ActorWorker.init_model) and this rank's rollout replica from the same
        HF path; the rollout's KV cache is released (``free_cache_engine``) and the trainer offloaded until
        first used."""
        super().init_model()
        tp_group = None
        if self.rollout_tp > 1:
            tp_group, replica, gen_tp_rank = self._generation_tp_group()
            self.register_dispatch_collect_info("rollout", replica, gen_tp_rank == 0)
        else:  # one full replica per rank: the plain rollout dispatch
            self.register_dispatch_collect_info("rollout", self.rank, True)
        self._build_rollout_engine(tp_group)
        self._offload_trainer()

    def _generation_tp_group(self):
        """(this rank's generation-TP process group, its replica index, its TP rank in the replica) under the
        trainer's reshard plan for ``rollout.tensor_model_parallel_size``. Creates every replica's group, on
        every rank, in one fixed order (``dist.new_group`` is collective over the whole default group)."""
        plan = self.engine.reshard_plan(self.rollout_tp)
        me = dist.get_rank()
        replicas = sorted({tuple(plan.gen_tp_group(r)) for r in range(plan.train.world)})
        mine = None
        for ranks in replicas:
            group = dist.new_group(list(ranks))
            if me in ranks:
                mine = group
        replica, gen_tp_rank = plan.gen_coords(me)
        if dist.get_rank(mine) != gen_tp_rank:  # torch orders group ranks by global rank
            raise RuntimeError(
                f"{self.tag}: generation-TP group {plan.gen_tp_group(me)} puts this rank at group rank "
                f"{dist.get_rank(mine)}, the reshard plan at generation TP rank {gen_tp_rank}"
            )
        return mine, replica, gen_tp_rank

    # -- generation -------------------------------------------------------------------------------------------

    @register(ROLLOUT_MESH)
    def generate_sequences(self, data: DataProto) -> DataProto:
        """Responses for this rank's chunk of prompts (left-padded ``input_ids``/``attention_mask``).

        ``meta_info`` may set ``n``, ``temperature``, ``top_p``, ``top_k``, ``do_sample``, ``validate``
        (defaults: rollout.temperature / rollout.n, or val_temperature / val_n when validating),
        ``response_length``, ``seed``, ``stop_token_ids``. Rows come back repeated ``n`` times
        (a, a, b, b); output keys as in dataproto/BATCH_LAYOUT.md with ``rollout_log_probs``. Dispatched per
        generation replica ("rollout" mesh): with ``rollout.tensor_model_parallel_size > 1`` every rank of a
        replica generates the same chunk in lockstep and one of them is collected. ``meta_info``
        gains ``temperature`` (of the reported log-probs), ``eos_token_id``, ``pad_token_id``,
        ``timing_s/gen`` and ``rollout/*`` token counts (see `workers.roles.rollout.run_rollout`)."""
        engine = self._require_rollout("generate_sequences")
        self._offload_trainer()
        return run_rollout(engine, data, self.rollout_config, tag=self.tag)

    # -- weight sync ------------------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL_RANK_ZERO)
    def sync_weights(self, version: int | None = None) -> dict:
        """Load the trainer's current weights into every rank's rollout replica (as policy ``version``, which
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
        return self._load_rollout_weights(
            "sync_weights",
            lambda trainer, engine: self.hf_weight_stream(device=engine.device),
            version,
        )

    @register(Dispatch.ONE_TO_ALL_RANK_ZERO)
    def sync_resharded_weights(self, version: int | None = None) -> dict:
        """``sync_weights`` for tensor-parallel rollout replicas: this rank's generation shards straight from
        the 3D-HybridEngine reshard (collective over the micro-DP groups; the native engine all-gathers
        vocabulary shards in its TP group, in the same name order on every rank). ``perf/weight_sync_bytes``
        is what rank 0's replica shard holds; ``weight_sync/bytes_received`` / ``bytes_sent`` what the
        reshard moved."""
        if self.rollout_tp == 1:
            raise RuntimeError(f"{self.tag}: rollout.tensor_model_parallel_size=1: use sync_weights")
        metrics = self._load_rollout_weights(
            "sync_resharded_weights",
            lambda trainer, engine: trainer.generation_shard_iter(self.rollout_tp),
            version,
        )
        # counts of the stream just consumed (the engine keeps one Resharder per generation TP size)
        reshard = self.engine.reshard_stats(self.rollout_tp)  # not _require_engine: it would reload
        return metrics | {
            "weight_sync/bytes_received": reshard.bytes_received,  # moved by the reshard (0: shard in place)
            "weight_sync/bytes_sent": reshard.bytes_sent,
            "weight_sync/gen_shard_bytes": metrics["perf/weight_sync_bytes"],
            "weight_sync/held_bytes": reshard.held_bytes,
            "weight_sync/peak_transient_bytes": reshard.peak_transient_bytes,
            "weight_sync/rollout_tp": self.rollout_tp,
        }

    def _load_rollout_weights(self, method: str, stream_of, version: int | None) -> dict:
        """Load ``stream_of(trainer, rollout engine)`` (collective over the trainer group) into this rank's
        replica as policy ``version``, then offload the trainer for generation; the sync's metrics."""
        t0 = time.perf_counter()
        engine = self._require_rollout(method)
        trainer = self._require_engine(method)  # reloads the trainer if it was offloaded
        engine.resume_memory(kv_cache=False)  # weights only; the KV cache waits for generation
        stats = {"tensors": 0, "bytes": 0}
        stream = _counted(stream_of(trainer, engine), stats)
        try:
            engine.update_weights(stream, version=version)
        finally:
            for _ in stream:  # a failed load must not leave the other ranks waiting in a collective
                pass
        t_loaded = time.perf_counter()
        offload_s = self._offload_trainer()
        self.sync_count += 1
        return {
            "timing_s/update_weights": time.perf_counter() - t0,
            "perf/weight_sync_bytes": stats["bytes"],
            "weight_sync/tensors": stats["tensors"],
            "weight_sync/load_s": t_loaded - t0,
            "weight_sync/offload_s": offload_s,
            "weight_sync/count": self.sync_count,
        }
