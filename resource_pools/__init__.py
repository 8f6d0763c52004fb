"""Ray placement-group resource pools, the role -> pool mapping and placement plans (colocated,
disaggregated, split_critic)."""

from resource_pools.capacity import InsufficientResourcesError, NodeGroupRequest, alive_nodes, check_fits
from resource_pools.manager import KNOWN_ROLES, ResourcePoolManager
from resource_pools.plans import PLACEMENTS, PlacementPlan, placement_plan
from resource_pools.pool import BundleSlot, PlacementGroupTimeoutError, ResourcePool

__all__ = [
    "KNOWN_ROLES",
    "PLACEMENTS",
    "BundleSlot",
    "InsufficientResourcesError",
    "NodeGroupRequest",
    "PlacementGroupTimeoutError",
    "PlacementPlan",
    "ResourcePool",
    "ResourcePoolManager",
    "alive_nodes",
    "check_fits",
    "placement_plan",
]
