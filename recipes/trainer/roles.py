"""Resource pools and WorkerGroups from the config, for every placement (``resource_pools.placement_plan``).

``colocated`` (one pool of ``n_gpus_per_node * nnodes`` devices): every device runs ONE process holding the
actor + rollout engines (``ActorRolloutWorker``, the hybrid engine), the reference, the critic (PPO) and the
reward scorer (``create_colocated_worker_cls`` + ``spawn``). Weights reach the rollout engines in process
(``WeightSync``'s colocated strategy, or resharded when ``rollout.tensor_model_parallel_size > 1``).

``disaggregated`` (two pools): the rollout pool (``rollout_gpus_per_node`` per node) runs ``RolloutWorker``;
the training pool (the rest) runs ActorWorker + reference + critic + reward colocated. Weights go from the
actor group to the rollout group over a weight-sync process group (``WeightSync``'s disaggregated strategy).

``split_critic`` (two pools): the actor pool runs the hybrid engine + reference + reward colocated as above; the
critic pool (``critic_gpus_per_node`` per node) runs ``CriticWorker`` alone, so actor and critic train on
different devices.

    roles = build_roles(cfg, run, critic=False)
    out = roles.generate(prompts, meta)        # rows repeated rollout.n times, interleaved
    roles.actor.compute_log_prob(out)          # the groups are plain RayWorkerGroups
    roles.sync_weights()                       # -> {"timing_s/update_weights": ..., "perf/weight_sync_bytes": ...}

``Roles.weight_sync`` (a `workers.weight_sync.WeightSync`, made by ``build_roles``) is the one object that
moves weights; ``roles.sync_weights()`` is the recipes' call to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from controller import RayClassWithInitArgs, RayWorkerGroup, create_colocated_worker_cls
from dataproto import DataProto
from recipes.schemas import RecipeConfig
from recipes.sections import device_counts, needs_reference
from recipes.trainer.reward import TaskRewardWorker
from recipes.trainer.run import Run, model_config
from resource_pools import InsufficientResourcesError, ResourcePoolManager, alive_nodes, placement_plan
from workers.roles import ActorWorker, CriticWorker, RefWorker
from workers.roles.actor_rollout import ActorRolloutWorker, DisaggregatedActorWorker
from workers.roles.rollout import RolloutWorker
from workers.weight_sync import WeightSync

logger = logging.getLogger("recipes")


def metrics_of(result) -> dict[str, float]:
    """The metrics a worker call returned: the metric-like ("group/name") entries of a DataProto's
    ``meta_info`` or of a dict, and its ``["metrics"]`` dict; rank 0's of a list of per-rank results."""
    if isinstance(result, list):
        result = result[0] if result else {}
    meta = result.meta_info if isinstance(result, DataProto) else (result or {})
    m = {k: v for k, v in meta.items() if "/" in k} | meta.get("metrics", {})
    return {k: float(v) for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@dataclass
class Roles:
    placement: str
    actor: RayWorkerGroup
    rollout: RayWorkerGroup
    reward: RayWorkerGroup
    weight_sync: WeightSync
    ref: RayWorkerGroup | None = None
    critic: RayWorkerGroup | None = None
    n_devices: int = 1
    manager: ResourcePoolManager | None = None
    groups: list[RayWorkerGroup] = field(default_factory=list)

    def generate(self, prompts: DataProto, meta: dict) -> DataProto:
        prompts.meta_info.update(meta)
        return self.rollout.generate_sequences(prompts)

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Push the actor's current weights to the rollout engine(s) as policy ``version`` (the number of
        updates they have had; the engines tag sampled tokens with it): ``weight_sync.sync()``."""
        return self.weight_sync.sync(version=version)

    def checkpointed(self) -> dict[str, RayWorkerGroup]:
        """The roles whose state a checkpoint holds (the reference is frozen, the rollout is synced)."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def shutdown(self) -> None:
        for wg in self.groups:
            try:
                wg.shutdown()
            except Exception:  # already gone
                pass
        if self.manager is not None:
            self.manager.remove()


def check_nodes(cfg: RecipeConfig) -> None:
    """``trainer.nnodes`` nodes must be alive: the per-node placement groups of a pool would otherwise pack
    onto fewer nodes and the run would go on without a word on less hardware than asked for."""
    nodes = alive_nodes()
    if len(nodes) < cfg.trainer.nnodes:
        raise InsufficientResourcesError(
            f"trainer.nnodes={cfg.trainer.nnodes} asks for {cfg.trainer.nnodes} nodes, but the Ray cluster has "
            f"{len(nodes)} alive: {[n.address for n in nodes]}"
        )


def _role_classes(
    cfg: RecipeConfig, run: Run, *, hybrid: bool, critic: bool, hybrid_cls=None, rollout_kwargs=None
) -> dict[str, RayClassWithInitArgs]:
    """The training-side roles: actor (hybrid: + rollout engine), reference, critic, reward."""
    mc = model_config(cfg, run.model_path)
    if hybrid:
        actor_cls, kw = hybrid_cls or ActorRolloutWorker, dict(rollout_kwargs or {})
    else:
        actor_cls, kw = DisaggregatedActorWorker, {}  # it sends weights out
    out = {"actor": RayClassWithInitArgs(actor_cls, model=mc, actor=cfg.actor, rollout=cfg.rollout, **kw)}
    if needs_reference(cfg):
        out["ref"] = RayClassWithInitArgs(RefWorker, model=mc, rollout=cfg.rollout)
    if critic:
        out["critic"] = _critic_class(cfg, run)
    crf = cfg.custom_reward_function
    out["reward"] = RayClassWithInitArgs(TaskRewardWorker, run.model_path, cfg.reward, crf.path, crf.name)
    return out


def _critic_class(cfg: RecipeConfig, run: Run) -> RayClassWithInitArgs:
    critic_mc = model_config(cfg, cfg.critic.model_path or run.model_path)
    return RayClassWithInitArgs(CriticWorker, model=critic_mc, critic=cfg.critic, rollout=cfg.rollout)


def build_roles(
    cfg: RecipeConfig,
    run: Run,
    *,
    critic: bool = False,
    hybrid_cls: type | None = None,
    rollout_cls: type | None = None,
    rollout_kwargs: dict | None = None,
    async_rollout: bool = False,
) -> Roles:
    """Create the pools and worker groups and initialise every model (``init_model``).

    Hook for recipes whose rollout is not plain generation (e.g. ``recipes/rlm.py``): ``hybrid_cls`` replaces
    ``ActorRolloutWorker`` (colocated), ``rollout_cls`` replaces ``RolloutWorker`` (disaggregated), and both get
    ``rollout_kwargs`` as extra constructor arguments. ``async_rollout`` (disaggregated; asynchronous recipes):
    the rollout workers take weights and aborts while they generate (``RolloutWorker(concurrent=True)``, Ray
    actors running several calls at once)."""
    t = cfg.trainer
    counts = device_counts(cfg)
    plan = placement_plan(
        t.placement,
        t.n_gpus_per_node,
        t.nnodes,
        rollout_per_node=t.rollout_gpus_per_node,
        critic_per_node=t.critic_gpus_per_node,
    )
    colocated = plan.pool_of("rollout") == plan.pool_of("actor")  # the hybrid actor + rollout engine
    critic_apart = critic and plan.pool_of("critic") != plan.pool_of("actor")
    check_nodes(cfg)
    manager = ResourcePoolManager(plan.pool_spec, plan.role_to_pool, use_gpu=run.use_gpu)
    manager.create_resource_pools()
    groups: list[RayWorkerGroup] = []
    try:
        classes = _role_classes(
            cfg,
            run,
            hybrid=colocated,
            critic=critic and not critic_apart,
            hybrid_cls=hybrid_cls,
            rollout_kwargs=rollout_kwargs,
        )
        train_wg = RayWorkerGroup(
            manager.get_pool("actor"),
            create_colocated_worker_cls(classes),
            name_prefix="train" if not colocated else "hybrid",
            call_timeout_s=t.call_timeout_s,
            call_timeout_per_row_s=t.call_timeout_per_row_s,
        )
        groups.append(train_wg)
        wgs = train_wg.spawn(list(classes))
        for name in classes:  # actor first: it joins the process group the others then reuse
            wgs[name].init_model()
        if colocated:
            rollout_wg = wgs["actor"]
        else:
            concurrency = {"concurrent": True} if async_rollout else {}
            rollout_wg = RayWorkerGroup(
                manager.get_pool("rollout"),
                RayClassWithInitArgs(
                    rollout_cls or RolloutWorker,
                    model=model_config(cfg, run.model_path),
                    rollout=cfg.rollout,
                    **dict(rollout_kwargs or {}),
                    **concurrency,
                ),
                name_prefix="rollout",
                call_timeout_s=t.call_timeout_s,
                call_timeout_per_row_s=t.call_timeout_per_row_s,
                # a generation, a weight receive and an abort at once
                actor_options={"max_concurrency": 3} if async_rollout else None,
            )
            groups.append(rollout_wg)
            rollout_wg.init_model()
        if critic_apart:
            critic_wg = RayWorkerGroup(
                manager.get_pool("critic"),
                _critic_class(cfg, run),
                name_prefix="critic",
                call_timeout_s=t.call_timeout_s,
                call_timeout_per_row_s=t.call_timeout_per_row_s,
            )
            groups.append(critic_wg)
            critic_wg.init_model()
            wgs["critic"] = critic_wg
    except BaseException:
        for wg in groups:
            wg.shutdown()
        manager.remove()
        raise
    return Roles(
        placement=t.placement,
        actor=wgs["actor"],
        rollout=rollout_wg,
        reward=wgs["reward"],
        weight_sync=WeightSync.for_groups(
            wgs["actor"], rollout_wg, rollout_tp=cfg.rollout.tensor_model_parallel_size
        ),
        ref=wgs.get("ref"),
        critic=wgs.get("critic"),
        n_devices=counts["total"],
        manager=manager,
        groups=groups,
    )


def build_actor_group(cfg, run: Run, actor_cfg) -> tuple[RayWorkerGroup, ResourcePoolManager]:
    """A plain ActorWorker group on its own pool (the quickstart's supervised warm start)."""
    t = cfg.trainer
    check_nodes(cfg)
    manager = ResourcePoolManager(
        {"sft_pool": [device_counts(cfg)["train"]]}, {"actor": "sft_pool"}, use_gpu=run.use_gpu
    )
    manager.create_resource_pools()
    wg = RayWorkerGroup(
        manager.get_pool("actor"),
        RayClassWithInitArgs(
            ActorWorker, model=model_config(cfg, run.model_path), actor=actor_cfg, rollout=cfg.rollout
        ),
        name_prefix="sft",
        call_timeout_s=t.call_timeout_s,
        call_timeout_per_row_s=t.call_timeout_per_row_s,
    )
    wg.init_model()
    return wg, manager
