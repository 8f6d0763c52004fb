"""Resource pools and WorkerGroups from the config, for every placement (``resource_pools.placement_plan``).

Placement is a mapping of roles to pools (`pool_roles`): each role is its own small worker class, and every
process of a pool holds one instance of each of the pool's roles (``create_colocated_worker_cls`` + ``spawn``:
one group per role, all on the pool's actors). A role that needs another's object in process says so with
`controller.Shared` (the rollout role shares the actor in the hybrid engine; an env role shares the rollout
role). A recipe adds roles with ``extra_roles`` (`PooledRole`: the class and the role whose pool it joins),
touching no other role's class.

``colocated`` (one pool of ``n_gpus_per_node * nnodes`` devices): every device runs ONE process holding the
actor and the rollout role sharing it (the hybrid engine, `workers.roles.hybrid_roles`), the reference, the critic
(PPO) and the reward scorer. Weights reach the rollout engines in process (``WeightSync``'s colocated strategy,
or resharded when ``rollout.tensor_model_parallel_size > 1``).

``disaggregated`` (two pools): the rollout pool (``rollout_gpus_per_node`` per node) runs ``RolloutWorker``;
the training pool (the rest) runs actor + reference + critic + reward. Weights go from the actor group to the
rollout group over a weight-sync process group (``WeightSync``'s disaggregated strategy).

``split_critic`` (two pools): the actor pool runs the hybrid engine + reference + reward colocated as above; the
critic pool (``critic_gpus_per_node`` per node) runs ``CriticWorker`` alone, so actor and critic train on
different devices.

    roles = build_roles(cfg, run, critic=False)
    out = roles.generate(prompts, meta)        # rows repeated rollout.n times, interleaved
    roles.actor.compute_log_prob(out)          # each group typed as its role's handle (workers/roles/handles.py)
    roles.sync_weights()                       # -> {"timing_s/update_weights": ..., "perf/weight_sync_bytes": ...}

``Roles.weight_sync`` (a `workers.weight_sync.WeightSync`, made by ``build_roles``) is the one object that
moves weights; ``roles.sync_weights()`` is the recipes' call to it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from controller import RayClassWithInitArgs, RayWorkerGroup, WorkerGroupError, create_colocated_worker_cls
from dataproto import DataProto
from recipes.sections import RecipeConfig, device_counts, needs_reference, reference_is_actor, syncs_adapters
from recipes.trainer.run import Run, model_config
from resource_pools import (
    InsufficientResourcesError,
    PlacementPlan,
    ResourcePoolManager,
    alive_nodes,
    placement_plan,
)
from workers.agents.env_worker import env_role
from workers.roles import ActorWorker, CriticWorker, RefWorker, RewardWorker, RolloutWorker, hybrid_roles
from workers.roles.handles import (
    ActorGroup,
    CriticGroup,
    GeneratorGroup,
    RefGroup,
    RewardGroup,
    RoleGroup,
    RolloutGroup,
    role_group,
)
from workers.weight_sync import WeightSync

logger = logging.getLogger("recipes")
T = TypeVar("T")


class FaultPolicy(Protocol):
    """What `Roles` asks before it replaces a rollout pool whose rank died (``allow``: a fault it may spend on
    it) and tells after (``replaced``: the error, the seconds the replacement took, the roles replaced)."""

    def allow(self, err: WorkerGroupError) -> bool: ...

    def replaced(self, err: WorkerGroupError, seconds: float, roles: list[str]) -> None: ...


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
    """One group per role (groups of one pool share its processes). ``rollout`` holds the engines that take the
    weights; ``generator`` makes the batches (the rollout role, or e.g. the env role that runs agents on it)."""

    placement: str
    actor: ActorGroup
    rollout: RolloutGroup
    generator: GeneratorGroup
    reward: RewardGroup
    weight_sync: WeightSync
    ref: RefGroup | None = None
    critic: CriticGroup | None = None
    extra: dict[str, RayWorkerGroup] = field(default_factory=dict)
    n_devices: int = 1
    manager: ResourcePoolManager | None = None
    groups: list[RayWorkerGroup] = field(default_factory=list)
    # a rollout pool apart from the trainer's (disaggregated): its roles hold nothing a checkpoint holds, so a
    # dead rank there is mended by a new group on the same pool (`rebuild_rollout_pool`, made by build_roles)
    rebuild_rollout_pool: Callable[[], tuple[RayWorkerGroup, dict[str, RayWorkerGroup]]] | None = None
    faults: FaultPolicy | None = None  # who allows and records a replacement (the session); None: never

    def generate(self, prompts: DataProto, meta: dict) -> DataProto:
        """The generator's batch; a rollout-pool rank that dies or hangs in it is replaced and the whole batch
        generated again (the same seeds: the same samples), when ``faults`` allows."""
        prompts.meta_info.update(meta)
        return self._replacing(lambda: self.generator.generate_sequences(prompts))

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Push the actor's current weights to the rollout engine(s) as policy ``version`` (the number of
        updates they have had; the engines tag sampled tokens with it): ``weight_sync.sync()``. A rollout rank
        lost on the way is replaced as in `generate`."""
        return self._replacing(lambda: self.weight_sync.sync(version=version))

    def _replacing(self, call: Callable[[], T]) -> T:
        while True:  # each fault of the rollout pool replaced while ``faults`` allows, the call run again
            try:
                return call()
            except WorkerGroupError as err:
                rollout_pool = self.rollout_pool_roles()
                if not (err.is_fault and err.role in rollout_pool and self.faults and self.faults.allow(err)):
                    raise
                t0 = time.perf_counter()
                self.replace_rollout_pool()  # a fault while replacing is the session's to recover from
                self.faults.replaced(err, time.perf_counter() - t0, sorted(rollout_pool))

    def rollout_pool_roles(self) -> set[str]:
        """The roles of a rollout pool that can be replaced (none when the rollout shares the trainer's)."""
        if self.rebuild_rollout_pool is None:
            return set()
        return {
            g.name
            for g in (self.rollout, self.generator, *self.extra.values())
            if not g.shares_processes_with(self.actor)
        }

    def replace_rollout_pool(self) -> None:
        """A new group on the rollout pool in place of the old one (shut down), its roles initialised and
        given the current weights at the current version (``weight_sync.version``)."""
        assert self.rebuild_rollout_pool is not None
        old = self.rollout
        for wg in self.groups:
            if wg.shares_processes_with(old):
                wg.shutdown()
        group, spawned = self.rebuild_rollout_pool()
        self.groups = [group if g.shares_processes_with(old) else g for g in self.groups]
        self.rollout = role_group(spawned["rollout"], RolloutGroup)
        self.generator = role_group(spawned.get(self.generator.name, self.generator), GeneratorGroup)
        self.extra = {name: spawned.get(name, wg) for name, wg in self.extra.items()}
        self.weight_sync.replace_rollout(self.rollout)
        self.weight_sync.sync(version=self.weight_sync.version)

    def reference(self) -> RefGroup:
        """The reference role's group, which exists exactly when ``needs_reference(cfg)`` (the actor's, with LoRA)."""
        if self.ref is None:
            raise RuntimeError(
                "this run has no reference role: no KL term or teacher asks for one (needs_reference)"
            )
        return self.ref

    def checkpointed(self) -> dict[str, ActorGroup | CriticGroup]:
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


@dataclass(frozen=True)
class PooledRole:
    """A role a recipe adds to the standard ones: its worker class and arguments, and the role whose pool it
    joins (``beside``: the same processes, so it may take that role's instance as a `controller.Shared`
    argument). The env role joins the rollout role; the PRM joins it too with ``prm.placement=colocated``."""

    spec: RayClassWithInitArgs
    beside: str = "rollout"


def plan_of(cfg: RecipeConfig) -> PlacementPlan:
    """The placement plan ``trainer`` asks for: pools and the standard roles' pools."""
    t = cfg.trainer
    return placement_plan(
        t.placement,
        t.n_gpus_per_node,
        t.nnodes,
        rollout_per_node=t.rollout_gpus_per_node,
        critic_per_node=t.critic_gpus_per_node,
    )


def pool_roles(
    cfg: RecipeConfig,
    run: Run,
    plan: PlacementPlan,
    *,
    critic: bool = False,
    extra_roles: Mapping[str, PooledRole] | None = None,
    async_rollout: bool = False,
    reference_path: str | None = None,
) -> dict[str, dict[str, RayClassWithInitArgs]]:
    """``{pool: {role: worker class with arguments}}``, each pool's roles in build order, from the placement
    plan: the actor's pool holds actor (colocated: + the rollout role sharing it), reference, critic (unless on
    its own pool), reward; the rollout and critic roles go to their own pools where the plan says so; each of
    ``extra_roles`` joins its ``beside`` role's pool; ``reference_path``: the reference role's model (default: the
    policy's start, ``run.model_path``)."""
    mc = model_config(cfg, run.model_path)
    # asynchronous recipes: the rollout workers take weights and aborts while they generate
    rollout_kw = {"concurrent": True} if async_rollout else {}
    roles: dict[str, tuple[str, RayClassWithInitArgs]] = {}
    if plan.pool_of("rollout") == plan.pool_of("actor"):  # the hybrid engine
        for name, spec in hybrid_roles(mc, cfg.actor, cfg.rollout).items():
            roles[name] = (plan.pool_of("actor"), spec)
    else:
        roles["actor"] = (
            plan.pool_of("actor"),
            RayClassWithInitArgs(ActorWorker, mc, cfg.actor, cfg.rollout),
        )
        rollout = RayClassWithInitArgs(
            RolloutWorker, model=mc, rollout=cfg.rollout, lora=cfg.actor.lora, **rollout_kw
        )
        roles["rollout"] = (plan.pool_of("rollout"), rollout)
    if needs_reference(cfg) and not reference_is_actor(cfg):
        ref_mc = model_config(cfg, reference_path) if reference_path else mc
        roles["ref"] = (
            plan.pool_of("ref"),
            RayClassWithInitArgs(
                RefWorker, model=ref_mc, rollout=cfg.rollout, reference_replay=cfg.actor.moe.reference_replay
            ),
        )
    if critic:
        critic_mc = model_config(cfg, cfg.critic.model_path or run.model_path)
        spec = RayClassWithInitArgs(CriticWorker, model=critic_mc, critic=cfg.critic, rollout=cfg.rollout)
        roles["critic"] = (plan.pool_of("critic"), spec)
    crf = cfg.custom_reward_function
    reward = RayClassWithInitArgs(RewardWorker, run.model_path, cfg.reward, crf.path, crf.name)
    roles["reward"] = (plan.pool_of("reward"), reward)
    for name, extra in (extra_roles or {}).items():
        if name in roles:
            raise ValueError(f"extra role {name!r} is already a role of this recipe ({sorted(roles)})")
        if extra.beside not in roles:
            raise ValueError(
                f"extra role {name!r} joins role {extra.beside!r}, which this run has not: {sorted(roles)}"
            )
        roles[name] = (roles[extra.beside][0], extra.spec)
    pools: dict[str, dict[str, RayClassWithInitArgs]] = {}
    for name, (pool, spec) in roles.items():
        pools.setdefault(pool, {})[name] = spec
    return pools


def build_roles(
    cfg: RecipeConfig,
    run: Run,
    *,
    critic: bool = False,
    extra_roles: Mapping[str, PooledRole] | None = None,
    generator: str = "rollout",
    async_rollout: bool = False,
    reference_path: str | None = None,
) -> Roles:
    """Create the pools and one worker group per pool (its roles composed into each process, `pool_roles`),
    and initialise every role (``init_model``, in build order: a shared role before the roles that share it).

    ``extra_roles``: roles a recipe adds (e.g. an agent env, `workers.agents.env_worker.env_role`, beside the
    rollout role); ``generator``: the role whose ``generate_sequences`` makes the batch (``roles.generate``), the
    rollout role or one of ``extra_roles``. ``async_rollout`` (asynchronous recipes): the rollout workers take
    weights and aborts while they generate (``RolloutWorker(concurrent=True)``, Ray actors running several
    calls at once). ``reference_path``: another model for the reference role (the hybrid recipe's OPD teacher,
    ``hybrid.teacher_path``)."""
    t = cfg.trainer
    counts = device_counts(cfg)
    plan = plan_of(cfg)
    pools = pool_roles(
        cfg, run, plan, critic=critic, extra_roles=extra_roles, async_rollout=async_rollout,
        reference_path=reference_path,
    )  # fmt: skip
    if not any(generator in roles for roles in pools.values()):
        names = sorted(r for roles in pools.values() for r in roles)
        raise ValueError(f"generator role {generator!r} is not a role of this run: {names}")
    check_nodes(cfg)
    manager = ResourcePoolManager(plan.pool_spec, plan.role_to_pool, use_gpu=run.use_gpu)
    manager.create_resource_pools()

    def start(pool: str) -> RayWorkerGroup:
        roles = pools[pool]
        hybrid = "actor" in roles and "rollout" in roles
        concurrent = async_rollout and "rollout" in roles and not hybrid
        return RayWorkerGroup(
            manager.pools[pool],
            create_colocated_worker_cls(roles),
            name_prefix="hybrid" if hybrid else ("train" if "actor" in roles else next(iter(roles))),
            call_timeout_s=t.call_timeout_s,
            call_timeout_per_row_s=t.call_timeout_per_row_s,
            # a generation, a weight receive and an abort at once
            actor_options={"max_concurrency": 3} if concurrent else None,
            wait=False,  # every pool's processes start at once
        )

    groups: list[RayWorkerGroup] = []
    wgs: dict[str, RayWorkerGroup] = {}
    try:
        for pool, roles in pools.items():
            groups.append(start(pool))
            wgs |= groups[-1].spawn(list(roles))
        RayWorkerGroup.wait_ready(groups)
        for roles in pools.values():
            for name in roles:  # actor first: it joins the process group the others then reuse
                role_group(wgs[name], RoleGroup).init_model()
    except BaseException:
        for wg in groups:
            wg.shutdown()
        manager.remove()
        raise

    rollout_pool = plan.pool_of("rollout")

    def rebuild_rollout_pool() -> tuple[RayWorkerGroup, dict[str, RayWorkerGroup]]:
        """A new group of the rollout pool's roles on its placement groups, initialised (no weights yet)."""
        group = start(rollout_pool)
        try:
            RayWorkerGroup.wait_ready([group])
            spawned = group.spawn(list(pools[rollout_pool]))
            for name in pools[rollout_pool]:
                role_group(spawned[name], RoleGroup).init_model()
        except BaseException:
            group.shutdown()
            raise
        return group, spawned

    actor = role_group(wgs["actor"], ActorGroup)
    ref = wgs["actor"] if reference_is_actor(cfg) else wgs.get("ref")
    return Roles(
        placement=t.placement,
        actor=actor,
        rollout=role_group(wgs["rollout"], RolloutGroup),
        generator=role_group(wgs[generator], GeneratorGroup),
        reward=role_group(wgs["reward"], RewardGroup),
        weight_sync=WeightSync.for_groups(
            wgs["actor"],
            wgs["rollout"],
            rollout_tp=cfg.rollout.tensor_model_parallel_size,
            adapter_only=syncs_adapters(cfg),
        ),
        ref=role_group(ref, RefGroup) if ref is not None else None,
        critic=role_group(wgs["critic"], CriticGroup) if "critic" in wgs else None,
        extra={name: wgs[name] for name in extra_roles or {}},
        n_devices=counts["total"],
        manager=manager,
        groups=groups,
        rebuild_rollout_pool=rebuild_rollout_pool if rollout_pool != plan.pool_of("actor") else None,
    )


def env_generator(cfg: RecipeConfig, run: Run, env) -> dict:
    """``build_roles``' options that make an agent environment (``env``, an ``AgentEnvConfig``) generate: the env
    role beside the rollout role, sharing its engine, in either placement."""
    spec = env_role(model_config(cfg, run.model_path), cfg.rollout, env)
    return {"extra_roles": {"env": PooledRole(spec)}, "generator": "env"}


def build_actor_group(cfg, run: Run, actor_cfg) -> tuple[ActorGroup, ResourcePoolManager]:
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
    actor = role_group(wg, ActorGroup)
    actor.init_model()
    return actor, manager
