"""Placement plans: pools and role -> pool maps of colocated, disaggregated and split_critic."""

import pytest

from resource_pools import ResourcePoolManager, placement_plan


def test_colocated_one_pool_for_every_role():
    plan = placement_plan("colocated", 4, nnodes=2)
    assert plan.pool_spec == {"global_pool": [4, 4]}
    assert set(plan.role_to_pool.values()) == {"global_pool"}
    assert plan.world_size("critic") == 8 and plan.total_devices == 8


def test_disaggregated_rollout_apart():
    plan = placement_plan("disaggregated", 4, rollout_per_node=1)
    assert plan.pool_spec == {"train_pool": [3], "rollout_pool": [1]}
    assert plan.pool_of("rollout") == "rollout_pool"
    assert {plan.pool_of(r) for r in ("actor", "ref", "critic", "reward")} == {"train_pool"}


def test_split_critic_critic_apart_actor_keeps_rollout():
    plan = placement_plan("split_critic", 4, nnodes=2, critic_per_node=1)
    assert plan.pool_spec == {"actor_pool": [3, 3], "critic_pool": [1, 1]}
    assert plan.pool_of("critic") == "critic_pool" and plan.world_size("critic") == 2
    assert {plan.pool_of(r) for r in ("actor", "rollout", "ref", "reward")} == {"actor_pool"}
    # the manager accepts the plan as is (no Ray needed to build it)
    manager = ResourcePoolManager(plan.pool_spec, plan.role_to_pool)
    assert manager.is_colocated("actor", "rollout") and not manager.is_colocated("actor", "critic")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(placement="spread", devices_per_node=2), "unknown placement 'spread'"),
        (dict(placement="disaggregated", devices_per_node=2), "rollout_per_node=0"),
        (dict(placement="disaggregated", devices_per_node=2, rollout_per_node=2), "rollout_per_node=2"),
        (dict(placement="split_critic", devices_per_node=1, critic_per_node=1), "critic_per_node=1"),
        (dict(placement="colocated", devices_per_node=0), "must be >= 1"),
    ],
)
def test_bad_plans_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        placement_plan(**kwargs)
