"""The placement cost model on hand-made rates: stage times, step time and idle time per pool computed by hand;
fitting recovers the rates that generated the observations; ranking and errors."""

from __future__ import annotations

import math

import pytest

from benchmarks import placement_cost_model as cm
from resource_pools.plans import placement_plan

WORK = cm.Workload(sequences=32, response_tokens=32 * 40, total_tokens=32 * 70, weight_bytes=1e8)
RATES = cm.StageRates(
    decode_t0=0.01,
    decode_t1=0.001,
    forward_tokens_per_s=10_000,
    train_tokens_per_s=2_000,
    sync_local_s=0.5,
    sync_bytes_per_s=1e9,
    sync_latency_s=0.0,
    reward_s=0.05,
    controller_s=0.02,
)
COLOCATED = placement_plan("colocated", 4)
DISAGG = placement_plan("disaggregated", 4, rollout_per_node=1)
SPLIT = placement_plan("split_critic", 4, critic_per_node=1)


def test_colocated_by_hand():
    p = cm.predict(RATES, COLOCATED, WORK)
    fwd, upd = 2240 / (10_000 * 4), 2240 / (2_000 * 4)
    assert p.timings["gen"] == pytest.approx(40 * (0.01 + 0.001 * 8))  # 8 sequences per device
    assert p.timings["old_log_prob"] == p.timings["ref"] == p.timings["values"] == pytest.approx(fwd)
    assert p.timings["update_actor"] == p.timings["update_critic"] == pytest.approx(upd)
    assert p.timings["update_weights"] == pytest.approx(0.5)  # in-process: rollout shares the actor's pool
    assert p.step_s == pytest.approx(0.72 + 3 * fwd + 2 * upd + 0.5 + 0.05 + 0.02)
    assert p.idle_s == {"global_pool": pytest.approx(0.02)}  # only the controller's own time


def test_disaggregated_by_hand():
    p = cm.predict(RATES, DISAGG, WORK)
    fwd, upd = 2240 / (10_000 * 3), 2240 / (2_000 * 3)
    gen = 40 * (0.01 + 0.001 * 32)  # one rollout device decodes all 32 sequences
    assert p.timings["gen"] == pytest.approx(gen)
    assert p.timings["update_weights"] == pytest.approx(1e8 / 1e9)  # broadcast: bytes / bandwidth
    step = gen + 3 * fwd + 2 * upd + 0.1 + 0.05 + 0.02
    assert p.step_s == pytest.approx(step)
    assert p.idle_s["rollout_pool"] == pytest.approx(step - gen - 0.1)
    assert p.idle_s["train_pool"] == pytest.approx(step - (0.05 + 3 * fwd + 2 * upd + 0.1))


def test_split_critic_by_hand():
    p = cm.predict(RATES, SPLIT, WORK)
    assert p.timings["gen"] == pytest.approx(40 * (0.01 + 0.001 * 32 / 3))
    assert p.timings["old_log_prob"] == pytest.approx(2240 / 30_000)
    assert p.timings["values"] == pytest.approx(2240 / 10_000)  # the critic pool has 1 device
    assert p.timings["update_critic"] == pytest.approx(2240 / 2_000)
    assert p.timings["update_actor"] == pytest.approx(2240 / 6_000)
    busy_critic = p.timings["values"] + p.timings["update_critic"]
    assert p.idle_s["critic_pool"] == pytest.approx(p.step_s - busy_critic)
    assert p.idle_s["actor_pool"] == pytest.approx(busy_critic + 0.02)


def test_devices_sharing_cores_are_slower():
    shared = cm.StageRates(**{**RATES.__dict__, "parallel_limit": 2})
    p, q = cm.predict(RATES, COLOCATED, WORK), cm.predict(shared, COLOCATED, WORK)
    for stage in ("gen", "old_log_prob", "update_actor"):  # 4 devices on 2 cores: twice as long
        assert q.timings[stage] == pytest.approx(2 * p.timings[stage])
    assert q.timings["update_weights"] == p.timings["update_weights"]
    d1 = placement_plan("disaggregated", 4, rollout_per_node=2)  # pools of 2: no contention
    assert cm.predict(shared, d1, WORK).step_s == pytest.approx(cm.predict(RATES, d1, WORK).step_s)
    # fitting with the same limit recovers the rates
    ob = cm.Observation(COLOCATED, WORK, {k: v for k, v in q.timings.items() if k != cm.CONTROLLER})
    ob2 = cm.Observation(d1, WORK, dict(cm.predict(shared, d1, WORK).timings))
    fit = cm.fit_rates([ob, ob2], parallel_limit=2)
    assert fit.train_tokens_per_s == pytest.approx(2_000) and fit.decode_t1 == pytest.approx(0.001)


def test_decode_rate_saturates_with_concurrency():
    rates = [RATES.decode_tokens_per_s(c) for c in (1, 4, 16, 64)]
    assert rates == sorted(rates) and rates[-1] < 1 / RATES.decode_t1
    assert RATES.decode_tokens_per_s(1) == pytest.approx(1 / 0.011)


def test_workload_without_ref_and_critic_skips_their_stages():
    w = cm.Workload(8, 80, 200, 1e6, has_ref=False, has_critic=False)
    p = cm.predict(RATES, COLOCATED, w)
    assert not {"ref", "values", "update_critic"} & set(p.timings)


def test_fit_recovers_the_rates_that_made_the_observations():
    plans = [COLOCATED, DISAGG, SPLIT, placement_plan("disaggregated", 4, rollout_per_node=2)]
    obs = []
    for plan in plans:
        p = cm.predict(RATES, plan, WORK)
        timings = {k: v for k, v in p.timings.items() if k != cm.CONTROLLER}
        obs.append(cm.Observation(plan, WORK, timings | {"step": p.step_s}))
    fit = cm.fit_rates(obs)
    for field in ("decode_t0", "decode_t1", "forward_tokens_per_s", "train_tokens_per_s", "sync_local_s"):
        assert getattr(fit, field) == pytest.approx(getattr(RATES, field), rel=1e-9), field
    assert fit.sync_bytes_per_s == pytest.approx(1e9) and fit.reward_s == pytest.approx(0.05)
    assert fit.controller_s == pytest.approx(0.02)
    # and so predicts each placement's step exactly
    for plan, ob in zip(plans, obs):
        assert cm.predict(fit, plan, WORK).step_s == pytest.approx(ob.timings["step"])


def test_fit_decode_edge_cases():
    assert cm.fit_decode([(4, 0.2), (4, 0.4)]) == (pytest.approx(0.3), 0.0)  # one concurrency: no slope
    assert cm.fit_decode([(1, 0.5), (8, 0.1)]) == (pytest.approx(0.3), 0.0)  # faster when busier: flat
    t0, t1 = cm.fit_decode([(2, 0.1), (4, 0.3)])  # line through the points would have t0 < 0
    assert t0 == 0.0 and t1 > 0
    with pytest.raises(ValueError, match="no observation measured gen"):
        cm.fit_decode([])


def test_one_sync_kind_unseen_borrows_the_other():
    p = cm.predict(RATES, COLOCATED, WORK)
    ob = cm.Observation(COLOCATED, WORK, {k: v for k, v in p.timings.items() if k != cm.CONTROLLER})
    fit = cm.fit_rates([ob])
    assert fit.sync_local_s == pytest.approx(0.5) and fit.sync_bytes_per_s == pytest.approx(1e8 / 0.5)


def test_rank_plans_orders_and_filters():
    plans = cm.candidate_plans(4)
    assert len(plans) == 1 + 3 + 3
    ranked = cm.rank_plans(RATES, WORK, plans)
    steps = [p.step_s for p in ranked]
    assert steps == sorted(steps) and all(math.isfinite(s) and s > 0 for s in steps)
    only_colocated = cm.rank_plans(RATES, WORK, plans, feasible=lambda p: p.name == "colocated")
    assert [cm.describe(p.plan) for p in only_colocated] == ["colocated(4)"]
    assert len(cm.candidate_plans(4, critic=False)) == 4


def test_describe():
    assert cm.describe(COLOCATED) == "colocated(4)"
    assert cm.describe(DISAGG) == "disaggregated(rollout=1,train=3)"
    assert cm.describe(SPLIT) == "split_critic(critic=1,actor=3)"


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="sequences >= 1"):
        cm.Workload(0, 10, 10, 1)
    with pytest.raises(ValueError, match="train_tokens_per_s"):
        cm.StageRates(0.01, 0.0, 1.0, 0.0, 0.1, 1.0)
    with pytest.raises(ValueError, match="at least one observation"):
        cm.fit_rates([])
    ob = cm.Observation(COLOCATED, WORK, {"gen": 1.0, "update_actor": 1.0, "update_weights": 0.1})
    with pytest.raises(ValueError, match="the forward rate"):
        cm.fit_rates([ob])
    with pytest.raises(KeyError, match="no cost model for stage"):
        cm.stage_seconds(RATES, COLOCATED, WORK, "testing")
