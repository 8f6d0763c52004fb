"""ResourcePool: a fixed set of device slots on Ray placement groups, one actor per slot.

One STRICT_PACK placement group per node, one bundle per device (GPU, or CPU "device" when
``use_gpu=False``). Ranks are numbered node by node, bundle by bundle. Several worker groups can share
the same bundles: each actor takes ``1 / max_colocate_count`` of its bundle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from resource_pools.capacity import NodeGroupRequest, alive_nodes, check_fits


class PlacementGroupTimeoutError(RuntimeError):
    """Placement groups were not ready within the pool's timeout (they are removed again)."""


@dataclass(frozen=True)
class BundleSlot:
    """Where rank ``rank`` of a worker group goes: a bundle of one of the pool's placement groups."""

    rank: int
    node_index: int
    local_rank: int
    local_world_size: int
    placement_group: PlacementGroup
    bundle_index: int


def _floor4(x: float) -> float:
    # Ray accepts at most 4 decimal places; round down so max_colocate_count shares fit one bundle.
    return math.floor(x * 10_000) / 10_000


class ResourcePool:
    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        name: str = "global_pool",
        cpus_per_gpu: float = 1.0,
        pg_timeout_s: float = 60.0,
    ):
        if not process_on_nodes or any(not isinstance(n, int) or n < 1 for n in process_on_nodes):
            raise ValueError(
                f"resource pool {name!r}: process_on_nodes must be a non-empty list of positive ints, "
                f"got {process_on_nodes!r}"
            )
        if not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ValueError(
                f"resource pool {name!r}: max_colocate_count must be >= 1, got {max_colocate_count}"
            )
        self.name = name
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.cpus_per_gpu = cpus_per_gpu
        self.pg_timeout_s = pg_timeout_s
        self._pgs: list[PlacementGroup] | None = None

    # ------------------------------------------------------------------ what is asked
    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def bundle(self) -> dict[str, float]:
        return {"CPU": float(self.cpus_per_gpu), "GPU": 1.0} if self.use_gpu else {"CPU": 1.0}

    def requests(self) -> list[NodeGroupRequest]:
        return [
            NodeGroupRequest(self.name, i, n, dict(self.bundle)) for i, n in enumerate(self.process_on_nodes)
        ]

    def actor_resources(self) -> dict[str, float]:
        """``num_cpus`` / ``num_gpus`` for one actor: its bundle's share split max_colocate_count ways."""
        share = {"num_cpus": _floor4(self.bundle["CPU"] / self.max_colocate_count)}
        if self.use_gpu:
            share["num_gpus"] = _floor4(1.0 / self.max_colocate_count)
        return share

    # ------------------------------------------------------------------ placement groups
    @property
    def created(self) -> bool:
        return self._pgs is not None

    def get_placement_groups(self) -> list[PlacementGroup]:
        """The pool's placement groups, created on first use (capacity checked first, then a timeout)."""
        if self._pgs is None:
            self._pgs = self._create()
        return self._pgs

    def _create(self) -> list[PlacementGroup]:
        check_fits(self.requests(), wait_s=min(self.pg_timeout_s, 10.0))
        pgs = [
            placement_group([dict(self.bundle) for _ in range(n)], strategy="STRICT_PACK")
            for n in self.process_on_nodes
        ]
        ready_refs = [pg.ready() for pg in pgs]
        ready, _ = ray.wait(ready_refs, num_returns=len(pgs), timeout=self.pg_timeout_s)
        if len(ready) < len(pgs):
            waiting = [i for i, ref in enumerate(ready_refs) if ref not in ready]
            for pg in pgs:
                remove_placement_group(pg)
            nodes = "; ".join(n.describe(sorted(self.bundle)) for n in alive_nodes())
            raise PlacementGroupTimeoutError(
                f"resource pool {self.name!r}: placement groups for node group(s) {waiting} were not ready "
                f"after {self.pg_timeout_s:g}s (asked {self.process_on_nodes} bundles of {self.bundle} per "
                f"node, STRICT_PACK). Nodes now: {nodes}"
            )
        return pgs

    def bundle_slots(self) -> list[BundleSlot]:
        """One slot per rank, in rank order (creates the placement groups if needed)."""
        slots, rank = [], 0
        for node_index, (pg, n) in enumerate(zip(self.get_placement_groups(), self.process_on_nodes)):
            for bundle_index in range(n):
                slots.append(BundleSlot(rank, node_index, bundle_index, n, pg, bundle_index))
                rank += 1
        return slots

    def remove(self) -> None:
        """Release the placement groups (actors placed on them are killed by Ray)."""
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs = None

    def __repr__(self) -> str:
        return (
            f"ResourcePool(name={self.name!r}, process_on_nodes={self.process_on_nodes}, "
            f"use_gpu={self.use_gpu}, max_colocate_count={self.max_colocate_count}, created={self.created})"
        )
