"""`WeightSync`: the controller-side driver that pushes a trainer group's current weights into its rollout
engines; one object per (actor group, rollout group) pair, owned by ``recipes.trainer.roles.Roles``.

It runs on the controller but lives here, not in ``controller/`` (which knows no model): it knows which
worker methods move weights and what their metrics mean. It is not in ``recipes/`` either, so tests and
benchmarks that build worker groups by hand drive the same code (nothing imports ``recipes/``).

Strategies, one sequence of group calls each:

* ``colocated``: the rollout engines live in the trainer's processes (the hybrid engine: a rollout role sharing
  the actor, `workers.roles.hybrid_engine`; the two groups run on the same actors). One call, the rollout
  role's ``sync_weights``: every rank all-gathers each parameter and streams the full tensor into its own
  rollout replica in process.
* ``resharded``: colocated, with tensor-parallel rollout replicas laid out differently from the training
  shards (``rollout.tensor_model_parallel_size > 1``, Megatron trainer). One call, ``sync_resharded_weights``:
  each rank receives only the generation shard it lacks, over the micro-DP groups of the 3D-HybridEngine
  reshard plan (`workers.weight_sync.reshard`).
* ``disaggregated``: the rollout group is separate (`workers.roles.rollout.RolloutWorker` on its own pool).
  The first sync sets up a weight-sync process group (`workers.weight_sync.sync_group`) of trainer rank 0
  and every rollout rank: ``open_weight_sync_store`` on trainer rank 0, then ``init_weight_sync`` on both
  sides at once. Every sync then issues ``send_weights`` on every trainer rank (all take part in the
  gathers, rank 0 broadcasts size-bounded buckets) and ``receive_weights`` on every rollout rank at once and
  waits for both with `controller.wait_all`, so the first error of either side is raised at once instead of
  leaving the other side waiting in a collective. The group is held by this object (``link``).

Every ``sync()`` returns metrics: ``timing_s/update_weights`` (controller wall time of the whole sync; of a
``submit()``-ted one, the wait for it after the call it queued behind),
``perf/weight_sync_bytes`` (tensor bytes loaded into one rollout replica) and the strategy's
``weight_sync/*`` details; ``syncs`` counts the syncs and ``last`` keeps the latest metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controller import DataProtoFuture, GroupMethod, RayWorkerGroup, WorkerGroupError, wait_all

STRATEGIES = ("colocated", "resharded", "disaggregated")
# Method of the colocated rollout group that runs a whole in-process sync, per colocated strategy
_IN_PROCESS_METHOD = {"colocated": "sync_weights", "resharded": "sync_resharded_weights"}
# Disaggregated: what trainer rank 0 reports of a stream that every receiver got too
_SENDER_METRICS = (
    "perf/weight_sync_bytes",
    "weight_sync/buckets",
    "weight_sync/tensors",
    "weight_sync/wire_bytes",
    "weight_sync/max_bucket_bytes",
)


def _method(group: RayWorkerGroup, name: str) -> GroupMethod:
    """``group``'s worker method ``name``: `RayWorkerGroup` binds its worker's methods with setattr at
    construction, so they are not attributes a type checker sees."""
    return getattr(group, name)


@dataclass
class WeightSyncLink:
    """The weight-sync process group set up between a trainer group and a separate rollout group, and the
    number of weight streams it carried."""

    group_name: str
    backend: str
    world_size: int
    syncs: int = 0


class WeightSync:
    """Pushes ``actor``'s current weights into ``rollout``'s engines with one of `STRATEGIES`."""

    def __init__(
        self,
        actor: RayWorkerGroup,
        rollout: RayWorkerGroup,
        strategy: str,
        *,
        backend: str | None = None,
        setup_timeout_s: float = 300.0,
        adapter_only: bool = False,
    ):
        """``backend`` (disaggregated): the weight-sync group's backend, default nccl when both pools use GPUs,
        else gloo; ``setup_timeout_s`` bounds joining that group; ``adapter_only`` (disaggregated): the actor
        trains LoRA adapters and the rollout engines load them, so only the adapter travels (in process, the
        rollout role decides that itself)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"weight-sync strategy must be one of {STRATEGIES}, got {strategy!r}")
        if (strategy == "disaggregated") == actor.shares_processes_with(rollout):
            where = "a separate" if strategy == "disaggregated" else "the actor group as its"
            raise ValueError(f"weight-sync strategy {strategy!r} needs {where} rollout group")
        self.actor, self.rollout, self.strategy = actor, rollout, strategy
        self.backend, self.setup_timeout_s = backend, setup_timeout_s
        self.adapter_only = adapter_only
        self.link: WeightSyncLink | None = None
        self.syncs = 0
        self.last: dict[str, float] = {}
        self.version: int | None = None  # the policy version last synced with one (None: never given)
        # the trainer side's call of a disaggregated sync or setup whose rollout side failed (it may still wait
        # for the lost ranks), and how long a replacement waits for it to end
        self._trainer_call: DataProtoFuture | None = None
        self.abandon_timeout_s = 30.0

    @classmethod
    def for_groups(
        cls, actor: RayWorkerGroup, rollout: RayWorkerGroup, *, rollout_tp: int = 1, **kwargs
    ) -> WeightSync:
        """The strategy the placement implies: disaggregated when the groups run on different processes, else
        resharded when the rollout replicas are ``rollout_tp``-way tensor parallel (> 1), else colocated."""
        if not actor.shares_processes_with(rollout):
            strategy = "disaggregated"
        else:
            strategy = "resharded" if rollout_tp > 1 else "colocated"
        return cls(actor, rollout, strategy, **kwargs)

    def sync(
        self, bucket_bytes: int | None = None, version: int | None = None, abort_running: bool = False
    ) -> dict[str, float]:
        """Push the weights once; returns the metrics. ``version`` (the trainer's update count) is the policy
        version the rollout engines then tag their tokens with (None: they keep theirs). Disaggregated only:
        ``bucket_bytes`` overrides the trainer's ``rollout.weight_bucket_mb``; ``abort_running`` aborts the
        requests that a concurrent rollout worker started on the old weights (``RolloutWorker.receive_weights``)."""
        if self.strategy == "disaggregated":
            t0 = time.perf_counter()
            return self._record(self._stream(bucket_bytes, version, abort_running), t0)
        if bucket_bytes is not None or abort_running:
            what = "bucket_bytes" if bucket_bytes is not None else "abort_running"
            raise ValueError(f"{what} applies to the disaggregated weight sync, not to {self.strategy!r}")
        wait = self.submit(version)
        assert wait is not None  # in process
        return wait()

    def submit(self, version: int | None = None) -> Callable[[], dict[str, float]] | None:
        """An in-process sync sent now without waiting for it: the trainer ranks run it after the calls already
        sent to them (e.g. the update that produced the weights), so no controller round trip sits between the
        two. Returns the function that waits for it and returns `sync`'s metrics, timed from that wait (the
        sync's own time, not the call it queued behind); None for the disaggregated strategy (use `sync`)."""
        if self.strategy == "disaggregated":
            return None
        if version is not None:
            self.version = version
        method = _method(self.rollout, _IN_PROCESS_METHOD[self.strategy])  # it reads the trainer it shares
        pending = method.with_options(blocking=False)(version=version)

        def wait() -> dict[str, float]:
            t0 = time.perf_counter()
            pending.restart_clock()  # its time limit starts when the call it queued behind has returned
            return self._record(pending.get(), t0)  # the worker returns rank 0's metrics

        return wait

    def _record(self, metrics: dict, t0: float) -> dict[str, float]:
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["timing_s/update_weights"] = time.perf_counter() - t0
        self.syncs += 1
        self.last = metrics
        return metrics

    def close(self) -> None:
        """Destroy the disaggregated weight-sync group on both sides (a later sync sets up a new one)."""
        link, self.link = self.link, None
        if link is None:
            return
        wait_all(
            [
                _method(self.actor, "destroy_weight_sync").with_options(blocking=False)(
                    group_name=link.group_name
                ),
                _method(self.rollout, "destroy_weight_sync").with_options(blocking=False)(
                    group_name=link.group_name
                ),
            ]
        )

    def replace_rollout(self, rollout: RayWorkerGroup) -> None:
        """Sync into ``rollout`` from now on (a new group in place of one whose rank died: disaggregated only).
        The old weight-sync group is dropped; the next sync sets up one with the new ranks (trainer rank 0
        leaves its end of the old one as it joins)."""
        if self.strategy != "disaggregated":
            raise ValueError(f"the {self.strategy!r} weight sync has no rollout group of its own to replace")
        pending, self._trainer_call = self._trainer_call, None
        if pending is not None and not pending.resolved:
            try:  # a broadcast to a dead peer fails at once; a setup waiting for one waits out its timeout
                pending.get(timeout_s=self.abandon_timeout_s)
            except WorkerGroupError as err:
                if err.kind == "timeout":  # trainer rank 0 is stuck with the lost ranks: a fault of its own
                    raise
        self.rollout, self.link = rollout, None

    # -- disaggregated ---------------------------------------------------------------------------------------

    def _connect(self) -> WeightSyncLink:
        """Trainer rank 0 (member 0) hosts the group's store on a port its OS picks; every rollout rank
        (members 1..N) dials it, both sides joining at once."""
        backend = self.backend
        if backend is None:
            pools = (self.actor.resource_pool, self.rollout.resource_pool)
            backend = "nccl" if all(getattr(p, "use_gpu", False) for p in pools) else "gloo"
        world, timeout = 1 + self.rollout.world_size, self.setup_timeout_s
        name = f"hyflow_weight_sync/{self.actor.name}->{self.rollout.name}"
        addr, port = _method(self.actor, "open_weight_sync_store")(world, group_name=name, timeout_s=timeout)

        def join(group: RayWorkerGroup, member_ranks: Sequence[int | None]):
            """``init_weight_sync`` on every rank of ``group`` (None: the rank is not a member)."""
            n = group.world_size
            return _method(group, "init_weight_sync").with_options(blocking=False)(
                [addr] * n,
                [port] * n,
                member_ranks,
                [world] * n,
                backend=[backend] * n,
                group_name=[name] * n,
                timeout_s=[timeout] * n,
            )

        trainer_ranks = [0] + [None] * (self.actor.world_size - 1)  # trainer rank 0 is the source
        rollout_ranks = list(range(1, world))
        trainer = join(self.actor, trainer_ranks)
        try:
            wait_all([trainer, join(self.rollout, rollout_ranks)], timeout_s=timeout + 30.0)
        except WorkerGroupError:
            self._trainer_call = trainer
            raise
        return WeightSyncLink(name, backend, world)

    def _stream(self, bucket_bytes: int | None, version: int | None, abort_running: bool) -> dict:
        if version is not None:
            self.version = version
        if self.link is None:
            self.link = self._connect()
        name = self.link.group_name
        sending = _method(self.actor, "send_weights").with_options(blocking=False)(
            bucket_bytes=bucket_bytes, group_name=name, adapter_only=self.adapter_only
        )
        receiving = _method(self.rollout, "receive_weights").with_options(blocking=False)(
            group_name=name, version=version, abort_running=abort_running, adapter_only=self.adapter_only
        )
        try:
            sent, received = wait_all([sending, receiving])
        except (
            WorkerGroupError
        ):  # the trainer's side may still be in the broadcast: replace_rollout waits for it
            self._trainer_call = sending
            raise
        for rank, r in enumerate(received):
            if (r["perf/weight_sync_bytes"], r["weight_sync/tensors"]) != (
                sent["perf/weight_sync_bytes"],
                sent["weight_sync/tensors"],
            ):
                raise WorkerGroupError(
                    self.rollout.name,
                    rank,
                    "receive_weights",
                    f"received {r['weight_sync/tensors']} tensors / {r['perf/weight_sync_bytes']} bytes but "
                    f"the trainer sent {sent['weight_sync/tensors']} / {sent['perf/weight_sync_bytes']}",
                    kind="mismatch",
                )
        self.link.syncs += 1
        return {
            **{k: sent[k] for k in _SENDER_METRICS},
            "weight_sync/receivers": len(received),
            "timing_s/weight_sync_send": sent["timing_s/update_weights"],
            "timing_s/weight_sync_receive_max": max(r["timing_s/update_weights"] for r in received),
            "weight_sync/swap_s_max": max(r["weight_sync/swap_s"] for r in received),
            "weight_sync/aborted_requests": sum(r["weight_sync/aborted_requests"] for r in received),
        }
