"""The roles of the colocated placement's pool: which role shares which, said once.

A pool's processes hold one instance per role (`controller.create_colocated_worker_cls`); a role that must use
another's object in process names it with `controller.Shared`. The hybrid engine is the actor plus a rollout
role that shares it (weights in process, the device time-shared)."""

from __future__ import annotations

from controller import RayClassWithInitArgs, RayWorkerGroup, Shared, create_colocated_worker_cls
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.roles.actor import ActorWorker
from workers.roles.rollout import RolloutWorker


def hybrid_roles(
    model: ModelConfig, actor: ActorConfig, rollout: RolloutConfig, **rollout_kwargs
) -> dict[str, RayClassWithInitArgs]:
    """``{"actor": ActorWorker, "rollout": RolloutWorker(trainer=Shared("actor"))}``, in build order."""
    return {
        "actor": RayClassWithInitArgs(ActorWorker, model=model, actor=actor, rollout=rollout),
        "rollout": RayClassWithInitArgs(
            RolloutWorker, model=model, rollout=rollout, trainer=Shared("actor"), **rollout_kwargs
        ),
    }


def hybrid_groups(
    pool,
    model: ModelConfig,
    actor: ActorConfig,
    rollout: RolloutConfig,
    *,
    name_prefix: str = "hybrid",
    **kwargs,
) -> dict[str, RayWorkerGroup]:
    """The hybrid engine on ``pool`` by hand (tests, benchmarks): ``{"actor": group, "rollout": group}`` on the
    same actors; call ``init_model`` on the actor group, then on the rollout group. ``kwargs`` go to
    `controller.RayWorkerGroup`."""
    roles = hybrid_roles(model, actor, rollout)
    wg = RayWorkerGroup(pool, create_colocated_worker_cls(roles), name_prefix=name_prefix, **kwargs)
    return wg.spawn(list(roles))
