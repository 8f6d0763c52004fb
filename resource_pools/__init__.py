"""Ray placement-group resource pools and the role -> pool mapping (colocated or disaggregated)."""

from resource_pools.capacity import InsufficientResourcesError, NodeGroupRequest, alive_nodes, check_fits
from resource_pools.manager import KNOWN_ROLES, ResourcePoolManager
from resource_pools.pool import BundleSlot, PlacementGroupTimeoutError, ResourcePool

__all__ = [
    "KNOWN_ROLES",
    "BundleSlot",
    "InsufficientResourcesError",
    "NodeGroupRequest",
    "PlacementGroupTimeoutError",
    "ResourcePool",
    "ResourcePoolManager",
    "alive_nodes",
    "check_fits",
]
