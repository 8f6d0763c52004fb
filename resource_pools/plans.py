"""Placement plans: which pools exist (devices per node) and which role runs in which pool.

    plan = placement_plan("split_critic", devices_per_node=4, nnodes=1, critic_per_node=1)
    plan.pool_spec     # {"actor_pool": [3], "critic_pool": [1]}
    plan.role_to_pool  # actor, rollout, ref, reward -> actor_pool; critic -> critic_pool
    ResourcePoolManager(plan.pool_spec, plan.role_to_pool)

* ``colocated``: one pool; every role shares every device (one process per device holds them all).
* ``disaggregated``: the rollout engines on a pool of their own (``rollout_per_node`` devices per node); the
  training roles (actor, reference, critic, reward) share the rest.
* ``split_critic``: the critic on a pool of its own (``critic_per_node``); actor + rollout (the hybrid engine),
  reference and reward share the rest, so actor and critic train on different devices.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("colocated", "disaggregated", "split_critic")
PLAN_ROLES = ("actor", "rollout", "ref", "critic", "reward")


@dataclass(frozen=True)
class PlacementPlan:
    name: str
    pool_spec: dict[str, list[int]]  # pool -> devices on each node
    role_to_pool: dict[str, str]

    def pool_of(self, role: str) -> str:
        return self.role_to_pool[role]

    def world_size(self, role: str) -> int:
        """Devices (= ranks of the worker group) of the pool ``role`` runs in."""
        return sum(self.pool_spec[self.role_to_pool[role]])

    @property
    def total_devices(self) -> int:
        return sum(sum(nodes) for nodes in self.pool_spec.values())


def _two_pools(
    name: str, what: str, apart: int, devices_per_node: int, nnodes: int, shared: str, role: str
) -> PlacementPlan:
    """``role`` on a pool of its own (``apart`` devices per node, named after it); every other role shares
    the rest of each node (pool ``shared``)."""
    if not 0 < apart < devices_per_node:
        raise ValueError(
            f"placement {name!r} needs 0 < {what} < devices per node (a pool on each side), "
            f"got {what}={apart}, devices per node={devices_per_node}"
        )
    spec = {shared: [devices_per_node - apart] * nnodes, f"{role}_pool": [apart] * nnodes}
    return PlacementPlan(name, spec, dict.fromkeys(PLAN_ROLES, shared) | {role: f"{role}_pool"})


def placement_plan(
    placement: str,
    devices_per_node: int,
    nnodes: int = 1,
    *,
    rollout_per_node: int = 0,
    critic_per_node: int = 0,
) -> PlacementPlan:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; known: {list(PLACEMENTS)}")
    if devices_per_node < 1 or nnodes < 1:
        raise ValueError(
            f"placement {placement!r}: devices per node and nodes must be >= 1, got {devices_per_node}, {nnodes}"
        )
    if placement == "colocated":
        return PlacementPlan(
            placement, {"global_pool": [devices_per_node] * nnodes}, dict.fromkeys(PLAN_ROLES, "global_pool")
        )
    if placement == "disaggregated":
        return _two_pools(
            placement, "rollout_per_node", rollout_per_node, devices_per_node, nnodes, "train_pool", "rollout"
        )
    return _two_pools(
        placement, "critic_per_node", critic_per_node, devices_per_node, nnodes, "actor_pool", "critic"
    )
