"""The hybrid engine: a rollout role that shares its process and device with the actor (colocated placement).

`workers.roles.rollout.RolloutWorker` built with ``trainer=Shared("actor")`` (`controller.colocate.Shared`) holds a
full rollout replica beside the FSDP2 / Megatron trainer of the same rank: the native engine by default, or the
one ``rollout.name`` names (`workers.rollout.registry`). The two time-share the device:

    init_model          (after the actor's) build the replica from the same HF path; its KV cache is released
                        (rollout.free_cache_engine) and the trainer offloaded until its first use
    generate_sequences  offload the trainer (if resident), resume the KV cache, generate, release it
    compute_log_prob,   on the actor role: the trainer is reloaded on first use (`EngineRoleWorker._require_engine`)
    update_actor, ...
    sync_weights        stream the full weights from the trainer's shards into this rank's replica, then offload
                        the trainer (`workers.weight_sync.WeightSync`'s colocated strategy)

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
the mesh is one replica per rank, all collected, and the weights travel as full tensors through
``sync_weights`` as described above.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from controller import make_nd_split_dataproto_dispatch_fn
from workers.config import ActorConfig, RolloutConfig
from workers.engine.base import LoRAConfig, TrainEngine, as_resharding_engine
from workers.engine.registry import train_engine_class
from workers.rollout.base import RolloutEngine
from workers.rollout.registry import rollout_engine_class
from workers.weight_sync import tensor_nbytes


def rollout_tp_size(actor: ActorConfig, rollout: RolloutConfig, tag: str) -> int:
    """``rollout.tensor_model_parallel_size`` checked against the actor (errors name the keys)."""
    tp_g = rollout.tensor_model_parallel_size
    if not isinstance(tp_g, int) or tp_g < 1:
        raise ValueError(f"{tag}: rollout.tensor_model_parallel_size must be an int >= 1, got {tp_g!r}")
    if tp_g == 1:
        return 1
    if not train_engine_class(actor.strategy, "actor.strategy").reshards_for_generation:
        raise ValueError(
            f"{tag}: rollout.tensor_model_parallel_size={tp_g} needs actor.strategy=megatron or another training "
            "engine that reshards for generation (the 3D-HybridEngine reshards Megatron TP shards into the rollout "
            "replicas); an FSDP trainer streams full tensors and has no TP layout to reshard from "
            f"(actor.strategy={actor.strategy!r} declares reshards_for_generation=False): use 1"
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


# The rollout role's generation: one chunk per generation replica ("rollout" mesh; one replica per rank unless
# the replicas are tensor parallel over the trainer's ranks).
ROLLOUT_MESH = make_nd_split_dataproto_dispatch_fn("rollout")


def generation_tp_group(trainer_engine: TrainEngine, tp_g: int, tag: str):
    """(this rank's generation-TP process group, its replica index, its TP rank in the replica) under the
    trainer's reshard plan for ``rollout.tensor_model_parallel_size = tp_g``. Creates every replica's group, on
    every rank, in one fixed order (``dist.new_group`` is collective over the whole default group)."""
    plan = as_resharding_engine(trainer_engine, tag).reshard_plan(tp_g)
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
            f"{tag}: generation-TP group {plan.gen_tp_group(me)} puts this rank at group rank "
            f"{dist.get_rank(mine)}, the reshard plan at generation TP rank {gen_tp_rank}"
        )
    return mine, replica, gen_tp_rank


def load_weights(
    engine: RolloutEngine, named_tensors, *, adapter: LoRAConfig | None, version: int | None, **kwargs
) -> Any:
    """Load a weight stream into ``engine``: LoRA adapter tensors with ``load_adapter`` when ``adapter`` (the
    actor's LoRA settings) is given, else full weights with ``update_weights``; returns what that returns."""
    if adapter is not None:
        return engine.load_adapter(
            named_tensors, scaling=adapter.alpha / adapter.rank, version=version, **kwargs
        )
    return engine.update_weights(named_tensors, version=version, **kwargs)


def load_from_trainer(
    trainer, engine: RolloutEngine, stream, version: int | None, adapter: LoRAConfig | None = None
) -> dict:
    """Load ``stream`` (collective over the trainer group: drained to the end whatever happens, so no rank
    waits in a gather) into this rank's replica as policy ``version`` (``adapter``: the stream is a LoRA
    adapter, `load_weights`), then offload the trainer for generation; the sync's metrics."""
    t0 = time.perf_counter()
    engine.resume_memory(kv_cache=False)  # weights only; the KV cache waits for generation
    stats = {"tensors": 0, "bytes": 0}
    counted = _counted(stream, stats)
    try:
        load_weights(engine, counted, adapter=adapter, version=version)
    finally:
        for _ in counted:
            pass
    t_loaded = time.perf_counter()
    offload_s = trainer.offload_engine()
    return {
        "timing_s/update_weights": time.perf_counter() - t0,
        "perf/weight_sync_bytes": stats["bytes"],
        "weight_sync/tensors": stats["tensors"],
        "weight_sync/load_s": t_loaded - t0,
        "weight_sync/offload_s": offload_s,
    }
