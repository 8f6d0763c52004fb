"""Rollout on its own resource pool (disaggregated placement), and what every rollout role shares.

* `RolloutWorker(model, rollout)`: one full rollout replica per rank (native engine, or SGLang when
  ``rollout.name == "sglang"``), no training engine. ``generate_sequences`` has the same contract as
  `workers.roles.actor_rollout.ActorRolloutWorker.generate_sequences`; new weights arrive over a
  weight-sync process group (`workers.weight_sync.sync_group`) that it joins with ``init_weight_sync``
  and reads with ``receive_weights``.
* `sync_weights_disaggregated(actor_wg, rollout_wg)`: the controller-side helper. The first call sets the
  group up (trainer rank 0 hosts its store on a port the OS picks on that node); every call then issues
  ``send_weights`` on all trainer ranks and ``receive_weights`` on all rollout ranks without blocking and
  waits for both, failing fast on the first error of either side (so neither side is left waiting in a
  collective while the controller waits on the other).
* Shared by both rollout roles: `build_rollout_engine`, `rollout_sampling_meta` (RolloutConfig defaults,
  validation settings), `run_rollout` (memory resume/release around a generation, timings, token counts)
  and two dispatch modes:

  - `ROLLOUT_DP_DISPATCH` for ``generate_sequences``: the batch is split into one contiguous chunk per rank
    (sizes differ by at most one row; no padding rows are generated), outputs are concatenated in rank
    order. Unlike ``Dispatch.DP_COMPUTE_PROTO`` this stays correct when the engine repeats every row
    ``n`` times (GRPO groups): DP_COMPUTE_PROTO pads the input to a multiple of the group size and strips
    ``pad_size`` output rows, but a padded prompt comes back as ``n`` rows. A rank whose chunk would be
    empty (fewer rows than ranks) gets one copy of row 0 marked as padding and returns no rows.
  - `ROLLOUT_MESH_DISPATCH` (`make_rollout_mesh_dispatch`): the same split over generation replicas
    instead of ranks, for a colocated worker whose replicas span several tensor-parallel ranks; every rank
    of a replica gets its chunk, one rank per replica is collected (mesh "rollout").
  - `ONE_TO_ALL_RANK_ZERO`: every rank runs the call with the same arguments (collective work); the
    result is rank 0's return value (weight-sync metrics).
"""

from __future__ import annotations

import logging
import time
import weakref

import ray

from controller import (
    DataProtoFuture,
    Dispatch,
    Dispatched,
    DispatchMode,
    Worker,
    WorkerGroupError,
    WorkerGroupTimeoutError,
    register,
)
from controller.dispatch import collect_rank_zero, dispatch_one_to_all, mesh_layout
from dataproto import DataProto
from workers.config import ModelConfig, RolloutConfig

logger = logging.getLogger(__name__)

# meta_info key set by ROLLOUT_DP_DISPATCH on a chunk: rows at its end that are padding (dropped after generation)
PAD_ROWS_KEY = "_hyflow_pad_rows"

# ----------------------------------------------------------------------------------------------------------------
# Dispatch modes
# ----------------------------------------------------------------------------------------------------------------


def _split_rows(num_rows: int, num_ranks: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) row ranges, one per rank, sizes differing by at most one (larger ones first)."""
    base, extra = divmod(num_rows, num_ranks)
    bounds, start = [], 0
    for r in range(num_ranks):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _rollout_chunk_refs(args: tuple, kwargs: dict, num_chunks: int) -> tuple[DataProto, list]:
    """(the single DataProto argument, object refs of its ``num_chunks`` contiguous chunks; a chunk that
    would be empty is one copy of row 0 marked as padding)."""
    protos = [("positional arg", i) for i, a in enumerate(args) if isinstance(a, DataProto)]
    protos += [("keyword arg", k) for k, v in kwargs.items() if isinstance(v, DataProto)]
    if len(protos) != 1:
        raise TypeError(f"rollout dispatch takes exactly one DataProto argument, got {len(protos)}")
    kind, key = protos[0]
    data = args[key] if kind == "positional arg" else kwargs[key]
    if len(data) == 0:
        raise ValueError("rollout dispatch: the batch is empty")
    chunks = []
    for start, end in _split_rows(len(data), num_chunks):
        if end > start:
            chunk = data.slice(start, end)
            chunk.meta_info[PAD_ROWS_KEY] = 0
        else:  # fewer rows than ranks: a placeholder row whose output is dropped
            chunk = data.slice(0, 1)
            chunk.meta_info[PAD_ROWS_KEY] = 1
        chunks.append(ray.put(chunk))
    return data, chunks


def dispatch_rollout_chunks(wg, *args, **kwargs) -> Dispatched:
    """One contiguous chunk of the (single) DataProto argument per rank; other arguments go to every rank."""
    data, chunks = _rollout_chunk_refs(args, kwargs, wg.world_size)

    def per_rank(value):
        return chunks if value is data else [value] * wg.world_size

    return Dispatched([per_rank(a) for a in args], {k: per_rank(v) for k, v in kwargs.items()})


def collect_rollout_chunks(wg, outputs: list, ranks: list[int] | None = None) -> DataProto:
    """Concatenate the outputs (of ``ranks``, default every rank in order) in order."""
    for rank, out in zip(ranks if ranks is not None else range(len(outputs)), outputs):
        if not isinstance(out, DataProto):
            raise TypeError(
                f"rollout dispatch: rank {rank} of worker group {wg.name!r} returned {type(out).__name__}, "
                "not a DataProto"
            )
    return DataProto.concat(outputs)


ROLLOUT_DP_DISPATCH = DispatchMode("rollout_dp_proto", dispatch_rollout_chunks, collect_rollout_chunks)


def make_rollout_mesh_dispatch(mesh_name: str) -> DispatchMode:
    """`ROLLOUT_DP_DISPATCH` over the generation replicas registered on ``mesh_name``
    (``register_dispatch_collect_info(mesh_name, replica index, is_collect)``) instead of over ranks: the
    prompts are split (before the ``n``-sample repetition, same chunk sizes and placeholder rule) into one
    chunk per replica, every rank of a replica gets its replica's chunk (tensor-parallel ranks generate in
    lockstep) and only the replica's collect rank is collected, in replica order. With one rank per
    replica (replica = rank, all collected) it is exactly `ROLLOUT_DP_DISPATCH`."""

    def dispatch(wg, *args, **kwargs) -> Dispatched:
        replica_of_rank, collect_ranks = mesh_layout(wg, mesh_name)
        data, chunks = _rollout_chunk_refs(args, kwargs, len(collect_ranks))

        def per_rank(value):
            if value is data:
                return [chunks[replica] for replica in replica_of_rank]
            return [value] * wg.world_size

        return Dispatched([per_rank(a) for a in args], {k: per_rank(v) for k, v in kwargs.items()})

    def collect(wg, outputs: list) -> DataProto:
        collect_ranks = mesh_layout(wg, mesh_name)[1]
        return collect_rollout_chunks(wg, [outputs[r] for r in collect_ranks], collect_ranks)

    return DispatchMode(f"rollout_mesh_proto[{mesh_name}]", dispatch, collect)


# Generation methods of the colocated actor-rollout worker: one chunk per generation replica ("rollout" mesh).
ROLLOUT_MESH_DISPATCH = make_rollout_mesh_dispatch("rollout")
ONE_TO_ALL_RANK_ZERO = DispatchMode("one_to_all_rank_zero", dispatch_one_to_all, collect_rank_zero)

# ----------------------------------------------------------------------------------------------------------------
# Engines and generation
# ----------------------------------------------------------------------------------------------------------------


def build_rollout_engine(
    model: ModelConfig, rollout: RolloutConfig, tokenizer, *, rank: int = 0, tp_group=None
):
    """The rollout engine of one rank, loaded from ``model.path``: `NativeEngine` (``rollout.name ==
    "native"``) or `SGLangRollout` (``"sglang"``). Pad/EOS ids come from the tokenizer (and the model's
    generation config for EOS); responses are padded to ``rollout.response_length``; sampling streams are
    seeded from ``(rollout.seed, rank)`` so data-parallel ranks draw different samples. ``tp_group``: the
    torch.distributed group of this rank's tensor-parallel native replica (None: a full replica)."""
    from workers.engine.distributed import default_device
    from workers.models import load_config, pad_token_id_of, resolve_dtype

    seed = rollout.seed * 1_000_003 + rank
    if rollout.name == "native":
        from workers.rollout.native import EngineConfig, NativeEngine

        hf_config = load_config(model.path, trust_remote_code=model.trust_remote_code)
        max_len = rollout.prompt_length + rollout.response_length
        max_pos = getattr(hf_config, "max_position_embeddings", None)
        if max_pos:
            max_len = min(max_len, int(max_pos))
        cfg = EngineConfig(
            max_num_seqs=rollout.max_num_seqs,
            max_model_len=max_len,
            dtype=resolve_dtype(model.dtype),
            device=str(default_device()),
            pad_token_id=pad_token_id_of(tokenizer, hf_config),
            response_length=rollout.response_length,
            seed=seed,
        )
        return NativeEngine.from_pretrained(
            model.path,
            tokenizer=tokenizer,
            config=cfg,
            tp_group=tp_group,
            trust_remote_code=model.trust_remote_code,
        )
    if rollout.name == "sglang":
        if tp_group is not None:
            raise ValueError("rollout.name='sglang' takes no tp_group (SGLang: rollout.tensor_parallel_size)")
        from workers.rollout.sampling import SamplingParams
        from workers.rollout.sglang import SGLangRollout, SGLangRolloutConfig

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
            dtype=model.dtype,
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
    ``rollout/tokens_per_s`` (this rank's chunk; a group call reports rank 0's)."""
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
        }
    )
    return out


def is_sglang(engine) -> bool:
    return type(engine).__name__ == "SGLangRollout"


def rollout_device(engine):
    """The torch device an engine's weights live on (SGLang: this process's current GPU, or the CPU)."""
    import torch

    if not is_sglang(engine):
        return engine.model.device
    if engine.config.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def load_weights_into(engine, named_tensors, flush_cache: bool = True) -> None:
    """``engine.update_weights`` for either engine (SGLang: tensors moved to its device, prefix cache flushed
    only when ``flush_cache``)."""
    if is_sglang(engine):
        device = rollout_device(engine)
        engine.update_weights(((n, t.to(device)) for n, t in named_tensors), flush_cache=flush_cache)
    else:
        engine.update_weights(named_tensors)


# ----------------------------------------------------------------------------------------------------------------
# RolloutWorker
# ----------------------------------------------------------------------------------------------------------------


class RolloutWorker(Worker):
    """A rollout replica per rank on its own resource pool; receives weights from the trainer's rank 0."""

    def __init__(self, model: ModelConfig, rollout: RolloutConfig):
        self.model_config = model
        self.rollout_config = rollout
        self.rollout_engine = None
        self.tokenizer = None
        self._weight_sync = {}  # group name -> WeightSyncGroup
        self.sync_count = 0  # weight syncs received

    def _require_rollout(self, method: str):
        if self.rollout_engine is None:
            raise RuntimeError(f"{self.tag}: {method} called before init_model()")
        return self.rollout_engine

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the tokenizer and build this rank's rollout engine from ``model.path``."""
        from workers.models import load_tokenizer

        m = self.model_config
        self.tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
        self.rollout_engine = build_rollout_engine(m, self.rollout_config, self.tokenizer, rank=self.rank)
        if self.rollout_config.free_cache_engine:
            self.rollout_engine.release_memory()

    @register(ROLLOUT_DP_DISPATCH)
    def generate_sequences(self, data: DataProto) -> DataProto:
        """Responses for this rank's chunk of prompts (see `run_rollout` for the output contract)."""
        engine = self._require_rollout("generate_sequences")
        return run_rollout(engine, data, self.rollout_config, tag=self.tag)

    @register(Dispatch.ALL_TO_ALL)
    def init_weight_sync(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str | None = None,
        group_name: str | None = None,
        timeout_s: float = 300.0,
    ) -> dict:
        """Join the weight-sync group as member ``rank`` (>= 1; rank 0 is the trainer). Blocks until every
        member joined, so the controller issues it on both sides without blocking (ALL_TO_ALL: every
        argument is a list with one entry per rollout rank)."""
        from workers.weight_sync import DEFAULT_GROUP_NAME, WeightSyncGroup

        name = group_name or DEFAULT_GROUP_NAME
        if rank < 1:
            raise ValueError(f"{self.tag}: weight-sync rank must be >= 1 (0 is the trainer), got {rank}")
        old = self._weight_sync.pop(name, None)
        if old is not None:
            old.destroy()
        self._weight_sync[name] = WeightSyncGroup(
            rank,
            world_size,
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            timeout_s=timeout_s,
            group_name=name,
            label=f"{self.tag} (weight-sync rank {rank}/{world_size})",
        )
        return {"rank": rank, "world_size": world_size, "backend": self._weight_sync[name].backend_name}

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, group_name: str | None = None) -> dict:
        """Receive one full weight stream from the trainer into this rank's engine; returns this rank's
        metrics (``timing_s/update_weights``, ``perf/weight_sync_bytes``, bucket/tensor counts)."""
        from workers.weight_sync import DEFAULT_GROUP_NAME

        t0 = time.perf_counter()
        engine = self._require_rollout("receive_weights")
        name = group_name or DEFAULT_GROUP_NAME
        group = self._weight_sync.get(name)
        if group is None:
            raise RuntimeError(f"{self.tag}: receive_weights before init_weight_sync (group {name!r})")
        engine.resume_memory(kv_cache=False)
        stats = group.receive(lambda named: load_weights_into(engine, named, flush_cache=False))
        if is_sglang(engine) and stats["buckets"]:
            engine.flush_cache()
        self.sync_count += 1
        return {
            "timing_s/update_weights": time.perf_counter() - t0,
            "perf/weight_sync_bytes": stats["bytes"],
            "weight_sync/wire_bytes": stats["wire_bytes"],
            "weight_sync/buckets": stats["buckets"],
            "weight_sync/tensors": stats["tensors"],
            "weight_sync/apply_s": stats["apply_s"],
            "weight_sync/count": self.sync_count,
        }

    @register(Dispatch.ONE_TO_ALL)
    def destroy_weight_sync(self, group_name: str | None = None) -> None:
        from workers.weight_sync import DEFAULT_GROUP_NAME

        group = self._weight_sync.pop(group_name or DEFAULT_GROUP_NAME, None)
        if group is not None:
            group.destroy()


# ----------------------------------------------------------------------------------------------------------------
# Controller side
# ----------------------------------------------------------------------------------------------------------------


def wait_all(futures: list[DataProtoFuture], timeout_s: float | None = None) -> list:
    """Results of several group calls in flight at once; the first error of any of them is raised at once
    (a WorkerGroupError naming its group and rank) instead of waiting on the others."""
    owner = {ref: f for f in futures for ref in f.refs}
    pending = list(owner)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            f = owner[pending[0]]
            stuck = sorted(f.ranks[f.refs.index(r)] for r in pending if owner[r] is f)
            raise WorkerGroupTimeoutError(f.role, f.method, stuck, timeout_s)
        if pending:
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready += more
        for ref in ready:
            try:
                ray.get(ref)
            except Exception:
                owner[ref].get(timeout_s=0)  # raises the WorkerGroupError naming the group and rank
                raise  # not reached: get() raised
    return [f.get() for f in futures]


class WeightSyncLink:
    """The set-up weight-sync group between one trainer group and one rollout group."""

    def __init__(self, group_name: str, backend: str, world_size: int):
        self.group_name, self.backend, self.world_size = group_name, backend, world_size
        self.syncs = 0


# actor_wg -> {rollout_wg -> WeightSyncLink}; weak both ways, so a link goes away with its groups
_LINKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_weight_sync_link(actor_wg, rollout_wg) -> WeightSyncLink | None:
    """The weight-sync group set up between these two groups (``group_name``, ``backend``, ``world_size``,
    ``syncs``), or None before the first sync."""
    return _LINKS.get(actor_wg, {}).get(rollout_wg)


def setup_weight_sync(
    actor_wg, rollout_wg, *, backend: str | None = None, timeout_s: float = 300.0
) -> WeightSyncLink:
    """Create the weight-sync group: trainer rank 0 (member 0) + every rollout rank (members 1..N).

    Trainer rank 0 opens the group's TCPStore on a port the OS picks on its node, then both sides join
    concurrently (non-blocking calls, waited on together). ``backend`` defaults to nccl when both pools use
    GPUs, else gloo."""
    if backend is None:
        gpu = getattr(actor_wg.resource_pool, "use_gpu", False) and getattr(
            rollout_wg.resource_pool, "use_gpu", False
        )
        backend = "nccl" if gpu else "gloo"
    world = 1 + rollout_wg.world_size
    name = f"hyflow_weight_sync/{actor_wg.name}->{rollout_wg.name}"
    addr, port = actor_wg.open_weight_sync_store(world, group_name=name, timeout_s=timeout_s)
    n = rollout_wg.world_size
    joins = [
        actor_wg.init_weight_sync.with_options(blocking=False)(
            addr, port, 0, world, backend=backend, group_name=name, timeout_s=timeout_s
        ),
        rollout_wg.init_weight_sync.with_options(blocking=False)(
            [addr] * n,
            [port] * n,
            list(range(1, world)),
            [world] * n,
            backend=[backend] * n,
            group_name=[name] * n,
            timeout_s=[timeout_s] * n,
        ),
    ]
    wait_all(joins, timeout_s=timeout_s + 30.0)
    link = WeightSyncLink(name, backend, world)
    _LINKS.setdefault(actor_wg, weakref.WeakKeyDictionary())[rollout_wg] = link
    return link


def sync_weights_disaggregated(
    actor_wg,
    rollout_wg,
    *,
    bucket_bytes: int | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
) -> dict:
    """Stream the trainer's current weights to every rank of ``rollout_wg``; returns metrics.

    ``actor_wg``: a group of a worker with the weight-sender methods (`workers.roles.actor_rollout`:
    ``DisaggregatedActorWorker`` or ``ActorRolloutWorker``); ``rollout_wg``: a `RolloutWorker` group. The
    group is set up on the first call for this pair. ``bucket_bytes`` overrides ``rollout.weight_bucket_mb``.

    Metrics: ``timing_s/update_weights`` (controller wall time of the whole sync), ``perf/weight_sync_bytes``
    (tensor bytes sent once by trainer rank 0 and received by every rollout rank), ``weight_sync/buckets``,
    ``weight_sync/tensors``, ``weight_sync/wire_bytes`` (with alignment), ``weight_sync/max_bucket_bytes``,
    ``weight_sync/receivers``, ``timing_s/weight_sync_send`` (trainer rank 0) and
    ``timing_s/weight_sync_receive_max`` (slowest rollout rank)."""
    t0 = time.perf_counter()
    link = get_weight_sync_link(actor_wg, rollout_wg)
    if link is None:
        link = setup_weight_sync(actor_wg, rollout_wg, backend=backend)
    send = actor_wg.send_weights.with_options(blocking=False)(
        bucket_bytes=bucket_bytes, group_name=link.group_name
    )
    recv = rollout_wg.receive_weights.with_options(blocking=False)(group_name=link.group_name)
    sent, received = wait_all([send, recv], timeout_s=timeout_s)
    for rank, r in enumerate(received):
        if (
            r["perf/weight_sync_bytes"] != sent["perf/weight_sync_bytes"]
            or r["weight_sync/tensors"] != sent["weight_sync/tensors"]
        ):
            raise WorkerGroupError(
                rollout_wg.name,
                rank,
                "receive_weights",
                f"received {r['weight_sync/tensors']} tensors / {r['perf/weight_sync_bytes']} bytes but the "
                f"trainer sent {sent['weight_sync/tensors']} / {sent['perf/weight_sync_bytes']}",
            )
    link.syncs += 1
    return {
        "timing_s/update_weights": time.perf_counter() - t0,
        "perf/weight_sync_bytes": sent["perf/weight_sync_bytes"],
        "weight_sync/buckets": sent["weight_sync/buckets"],
        "weight_sync/tensors": sent["weight_sync/tensors"],
        "weight_sync/wire_bytes": sent["weight_sync/wire_bytes"],
        "weight_sync/max_bucket_bytes": sent["weight_sync/max_bucket_bytes"],
        "weight_sync/receivers": len(received),
        "timing_s/weight_sync_send": sent["timing_s/update_weights"],
        "timing_s/weight_sync_receive_max": max(r["timing_s/update_weights"] for r in received),
    }


def teardown_weight_sync(actor_wg, rollout_wg) -> None:
    """Destroy the pair's weight-sync group on both sides (a later sync sets up a new one)."""
    link = _LINKS.get(actor_wg, {}).pop(rollout_wg, None)
    if link is None:
        return
    wait_all(
        [
            actor_wg.destroy_weight_sync.with_options(blocking=False)(group_name=link.group_name),
            rollout_wg.destroy_weight_sync.with_options(blocking=False)(group_name=link.group_name),
        ]
    )


__all__: list[str] = [
    "ONE_TO_ALL_RANK_ZERO",
    "PAD_ROWS_KEY",
    "ROLLOUT_DP_DISPATCH",
    "RolloutWorker",
    "WeightSyncLink",
    "build_rollout_engine",
    "get_weight_sync_link",
    "load_weights_into",
    "rollout_device",
    "rollout_sampling_meta",
    "run_rollout",
    "setup_weight_sync",
    "sync_weights_disaggregated",
    "teardown_weight_sync",
    "wait_all",
]
