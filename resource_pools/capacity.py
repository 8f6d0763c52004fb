"""Pre-flight capacity check: does a set of placement-group requests fit on the live Ray nodes?

Ray itself would just leave an unplaceable placement group pending forever, so before any group is
created we compare what is asked (per node group: a STRICT_PACK set of bundles that must land on one
node) with what each alive node still has available, and raise an error that names both sides.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray

# Fractional resources (e.g. 1/3 CPU per colocated actor) make exact float comparison brittle.
_EPS = 1e-6


class InsufficientResourcesError(RuntimeError):
    """A resource pool asks for more than the cluster has available (raised before anything starts)."""


@dataclass(frozen=True)
class NodeGroupRequest:
    """One STRICT_PACK placement group: ``num_bundles`` bundles of ``bundle`` that must share a node."""

    pool_name: str
    node_index: int
    num_bundles: int
    bundle: dict[str, float]

    @property
    def demand(self) -> dict[str, float]:
        return {k: v * self.num_bundles for k, v in self.bundle.items()}

    def describe(self) -> str:
        return (
            f"pool {self.pool_name!r} node group {self.node_index}: {self.num_bundles} x {self.bundle} "
            f"= {_fmt(self.demand)} on one node"
        )


@dataclass(frozen=True)
class NodeResources:
    node_id: str
    address: str
    available: dict[str, float]
    total: dict[str, float]

    def describe(self, keys: Sequence[str]) -> str:
        parts = [f"{k} {self.available.get(k, 0.0):g}/{self.total.get(k, 0.0):g}" for k in keys]
        return f"node {self.address} ({self.node_id[:8]}): " + ", ".join(parts) + " available/total"


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def alive_nodes() -> list[NodeResources]:
    """Available and total resources of every alive node of the connected Ray cluster."""
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised: call ray.init() before creating resource pools")
    # Per-node *available* resources are only exposed through Ray's state module; ray.nodes() has totals.
    from ray._private import state as ray_state

    available = ray_state.available_resources_per_node()
    nodes = []
    for info in ray.nodes():
        if not info.get("Alive", False):
            continue
        node_id = info["NodeID"]
        total = {k: float(v) for k, v in info.get("Resources", {}).items()}
        avail = {k: float(v) for k, v in available.get(node_id, {}).items()}
        nodes.append(NodeResources(node_id, info.get("NodeManagerAddress", "?"), avail, total))
    return nodes


def _first_unplaceable(requests: Sequence[NodeGroupRequest], capacity: Sequence[dict[str, float]]):
    """First-fit decreasing (largest node group first, onto the first node with room); returns the first
    request that finds no node, or None when all fit."""
    remaining = [dict(c) for c in capacity]
    for req in sorted(requests, key=lambda r: -sum(r.demand.values())):
        for free in remaining:
            if all(free.get(k, 0.0) + _EPS >= v for k, v in req.demand.items()):
                for k, v in req.demand.items():
                    free[k] = free.get(k, 0.0) - v
                break
        else:
            return req
    return None


def check_fits(
    requests: Sequence[NodeGroupRequest],
    nodes: Sequence[NodeResources] | None = None,
    wait_s: float = 0.0,
) -> None:
    """Raise InsufficientResourcesError unless every request can be given its own share of one node.

    A request that exceeds the nodes' *total* resources fails at once. One that only exceeds what is
    *available* is re-checked for up to ``wait_s`` seconds: resources of just-removed placement groups
    and killed actors reach the cluster's resource view with a delay. This is a pre-flight check; Ray
    still does the placing.
    """
    live = nodes is None
    nodes = list(alive_nodes() if nodes is None else nodes)
    failed = _first_unplaceable(requests, [n.total for n in nodes])
    if failed is not None:
        raise InsufficientResourcesError(
            _explain(failed, requests, nodes, "more than the nodes hold in total")
        )
    deadline = time.monotonic() + wait_s
    while (failed := _first_unplaceable(requests, [n.available for n in nodes])) is not None:
        if not live or time.monotonic() >= deadline:
            raise InsufficientResourcesError(
                _explain(
                    failed,
                    requests,
                    nodes,
                    "not enough available now (the rest is held by other placement groups or actors)",
                )
            )
        time.sleep(0.1)
        nodes = alive_nodes()


def _explain(
    failed: NodeGroupRequest, requests: Sequence[NodeGroupRequest], nodes: Sequence[NodeResources], why: str
) -> str:
    keys = sorted({k for r in requests for k in r.bundle})
    asked_total: dict[str, float] = {}
    for r in requests:
        for k, v in r.demand.items():
            asked_total[k] = asked_total.get(k, 0.0) + v
    cluster_avail = {k: sum(n.available.get(k, 0.0) for n in nodes) for k in keys}
    lines = [
        f"cannot place {failed.describe()}: {why}.",
        f"Asked for ({len(requests)} node group(s), {_fmt(asked_total)} in all):",
        *[f"  - {r.describe()}" for r in requests],
        f"Cluster has {len(nodes)} alive node(s), {_fmt(cluster_avail)} available in all:",
        *[f"  - {n.describe(keys)}" for n in nodes],
    ]
    if not nodes:
        lines.append("  (no alive nodes)")
    return "\n".join(lines)
