"""ResourcePoolManager: named pools from config, and which role runs in which pool.

Roles mapped to the same pool are colocated (their workers share bundles, typically one process per
bundle holding every role); mapping a role to its own pool disaggregates it. Switching between the two
is a config change of ``role_to_pool`` only.
"""

from __future__ import annotations

from resource_pools.capacity import check_fits
from resource_pools.pool import ResourcePool

# The roles a recipe uses; other names are accepted (a recipe may add its own).
KNOWN_ROLES = ("actor", "rollout", "ref", "critic", "reward", "env")


class ResourcePoolManager:
    def __init__(
        self,
        pool_spec: dict[str, list[int]],
        role_to_pool: dict[str, str],
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        pg_timeout_s: float = 60.0,
    ):
        if not pool_spec:
            raise ValueError("ResourcePoolManager: pool_spec is empty; name at least one pool")
        unknown = {role: pool for role, pool in role_to_pool.items() if pool not in pool_spec}
        if unknown:
            raise KeyError(
                f"ResourcePoolManager: role(s) mapped to undefined pool(s) {unknown}; "
                f"defined pools: {sorted(pool_spec)}"
            )
        self.role_to_pool = dict(role_to_pool)
        self.pools = {
            name: ResourcePool(
                nodes,
                use_gpu=use_gpu,
                max_colocate_count=max_colocate_count,
                name=name,
                pg_timeout_s=pg_timeout_s,
            )
            for name, nodes in pool_spec.items()
        }

    def create_resource_pools(self) -> dict[str, ResourcePool]:
        """Check that all pools fit together, then create their placement groups."""
        pending = [p for p in self.pools.values() if not p.created]
        wait_s = min([p.pg_timeout_s for p in pending] + [10.0])
        check_fits([req for pool in pending for req in pool.requests()], wait_s=wait_s)
        for pool in pending:
            pool.get_placement_groups()
        return dict(self.pools)

    def get_pool(self, role: str) -> ResourcePool:
        if role not in self.role_to_pool:
            raise KeyError(
                f"no resource pool mapped for role {role!r}; mapped roles: {sorted(self.role_to_pool)}"
            )
        return self.pools[self.role_to_pool[role]]

    def roles_by_pool(self) -> dict[str, list[str]]:
        """Pool name -> roles placed in it (roles sharing a pool are the ones to colocate)."""
        out: dict[str, list[str]] = {name: [] for name in self.pools}
        for role, pool in self.role_to_pool.items():
            out[pool].append(role)
        return out

    def is_colocated(self, role_a: str, role_b: str) -> bool:
        return self.get_pool(role_a) is self.get_pool(role_b)

    def remove(self) -> None:
        for pool in self.pools.values():
            pool.remove()
