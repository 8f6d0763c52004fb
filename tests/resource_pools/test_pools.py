"""Resource pools on real placement groups: what fits, what does not (error before anything starts), the
role -> pool mapping, and the placement-group timeout."""

import re
import sys

import pytest
import ray
from ray.util import placement_group_table

import resource_pools.pool as pool_module
from controller import RayClassWithInitArgs, RayWorkerGroup, Worker
from resource_pools import (
    InsufficientResourcesError,
    NodeGroupRequest,
    PlacementGroupTimeoutError,
    ResourcePool,
    ResourcePoolManager,
    check_fits,
)
from resource_pools.capacity import NodeResources

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _states(pgs):
    return [placement_group_table(pg)["state"] for pg in pgs]


def _pending_groups():
    return [t for t in placement_group_table().values() if t["state"] == "PENDING"]


def test_pool_that_fits_gets_one_strict_pack_group_per_node(ray_session):
    pool = ResourcePool([2, 1], name="fits")
    try:
        pgs = pool.get_placement_groups()
        assert len(pgs) == 2 and _states(pgs) == ["CREATED", "CREATED"]
        tables = [placement_group_table(pg) for pg in pgs]
        assert [t["strategy"] for t in tables] == ["STRICT_PACK", "STRICT_PACK"]
        assert [list(t["bundles"].values()) for t in tables] == [[{"CPU": 1.0}] * 2, [{"CPU": 1.0}]]
        slots = pool.bundle_slots()
        assert [(s.rank, s.node_index, s.local_rank, s.bundle_index) for s in slots] == [
            (0, 0, 0, 0),
            (1, 0, 1, 1),
            (2, 1, 0, 0),
        ]
        assert [s.placement_group for s in slots] == [pgs[0], pgs[0], pgs[1]]
        assert pool.get_placement_groups() is pgs  # created once
    finally:
        pool.remove()
    assert _states(pgs) == ["REMOVED", "REMOVED"] and not pool.created


def test_actor_share_of_a_bundle():
    assert ResourcePool([1], max_colocate_count=3).actor_resources() == {"num_cpus": 0.3333}
    gpu = ResourcePool([1], use_gpu=True, max_colocate_count=2, cpus_per_gpu=4)
    assert gpu.bundle == {"CPU": 4, "GPU": 1.0}
    assert gpu.actor_resources() == {"num_cpus": 2.0, "num_gpus": 0.5}
    with pytest.raises(ValueError, match=r"pool 'p': process_on_nodes .* got \[2, 0\]"):
        ResourcePool([2, 0], name="p")


class MarkerWorker(Worker):
    def __init__(self, path):
        open(path, "w").close()


def test_pool_too_big_fails_before_any_actor_starts(ray_session, tmp_path):
    marker = tmp_path / "started"
    pool = ResourcePool([9], name="too_big")
    with pytest.raises(InsufficientResourcesError) as info:
        RayWorkerGroup(pool, RayClassWithInitArgs(MarkerWorker, str(marker)))
    msg = str(info.value)
    assert "pool 'too_big' node group 0: 9 x {'CPU': 1.0} = {CPU: 9} on one node" in msg
    assert re.search(r"1 alive node\(s\).*\n  - node .*: CPU [\d.]+/8 available/total", msg)
    assert not marker.exists() and not pool.created


def test_gpu_pool_on_cpu_cluster_names_gpus(ray_session):
    with pytest.raises(InsufficientResourcesError, match=r"(?s)pool 'gpus'.*\{CPU: 2, GPU: 2\}.*GPU 0/0"):
        ResourcePool([2], use_gpu=True, name="gpus", cpus_per_gpu=1).get_placement_groups()


def test_manager_checks_all_pools_together(ray_session):
    manager = ResourcePoolManager(
        {"actor_pool": [5], "rollout_pool": [5]}, {"actor": "actor_pool", "rollout": "rollout_pool"}
    )
    with pytest.raises(InsufficientResourcesError) as info:
        manager.create_resource_pools()  # each fits alone, not both
    msg = str(info.value)
    assert "pool 'actor_pool'" in msg and "pool 'rollout_pool'" in msg and "{CPU: 10} in all" in msg
    assert not any(p.created for p in manager.pools.values())  # nothing half-created


def test_manager_switches_role_between_colocated_and_disaggregated(ray_session):
    roles = {"actor": "global_pool", "rollout": "global_pool", "ref": "global_pool"}
    colocated = ResourcePoolManager({"global_pool": [2]}, roles)
    assert colocated.is_colocated("actor", "rollout")
    assert colocated.roles_by_pool() == {"global_pool": ["actor", "rollout", "ref"]}

    split = ResourcePoolManager(
        {"global_pool": [2], "rollout_pool": [1]}, {**roles, "rollout": "rollout_pool"}
    )
    assert not split.is_colocated("actor", "rollout") and split.is_colocated("actor", "ref")
    try:
        pools = split.create_resource_pools()
        pgs = [pg for p in pools.values() for pg in p.get_placement_groups()]
        assert _states(pgs) == ["CREATED", "CREATED"]
        assert split.get_pool("rollout") is pools["rollout_pool"] and pools["rollout_pool"].world_size == 1
    finally:
        split.remove()
    assert _states(pgs) == ["REMOVED", "REMOVED"]
    with pytest.raises(KeyError, match=r"role 'critic'; mapped roles: \['actor', 'ref', 'rollout'\]"):
        split.get_pool("critic")
    with pytest.raises(KeyError, match=r"undefined pool\(s\) \{'critic': 'critic_pool'\}"):
        ResourcePoolManager({"global_pool": [2]}, {"critic": "critic_pool"})


def test_first_fit_is_per_node():
    nodes = [
        NodeResources("a" * 8, "10.0.0.1", {"CPU": 4.0}, {"CPU": 4.0}),
        NodeResources("b" * 8, "10.0.0.2", {"CPU": 4.0}, {"CPU": 4.0}),
    ]
    check_fits([NodeGroupRequest("p", 0, 4, {"CPU": 1.0}), NodeGroupRequest("p", 1, 4, {"CPU": 1.0})], nodes)
    with pytest.raises(InsufficientResourcesError, match=r"pool 'p' node group 0: 5 x.*in total"):
        check_fits([NodeGroupRequest("p", 0, 5, {"CPU": 1.0})], nodes)  # 8 CPUs in all, 4 per node
    busy = [NodeResources("c" * 8, "10.0.0.3", {"CPU": 2.0}, {"CPU": 4.0})]
    with pytest.raises(
        InsufficientResourcesError, match=r"not enough available now(?s:.*)CPU 2/4 available/total"
    ):
        check_fits([NodeGroupRequest("q", 0, 3, {"CPU": 1.0})], busy)


def test_placement_group_timeout_errors_and_cleans_up(ray_session, monkeypatch):
    monkeypatch.setattr(pool_module, "check_fits", lambda *a, **kw: None)  # let an impossible group through
    pool = ResourcePool([9], name="never_ready", pg_timeout_s=0.5)
    with pytest.raises(PlacementGroupTimeoutError, match=r"pool 'never_ready'.*node group\(s\) \[0\].*0.5s"):
        pool.get_placement_groups()
    assert not pool.created and _pending_groups() == []  # the pending group was removed
