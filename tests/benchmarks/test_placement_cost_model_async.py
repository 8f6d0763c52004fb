"""The placement cost model's schedules (``sync``, ``one_step``, ``full``) and its long-tail generation, on
hand-made rates: the expected longest response, generation waiting for it, the overlapped step, streamed calls
and the errors, each against numbers worked out by hand."""

from __future__ import annotations

import pytest

from benchmarks import placement_cost_model as cm
from resource_pools.plans import placement_plan

RATES = cm.StageRates(
    decode_t0=0.01,
    decode_t1=0.001,
    forward_tokens_per_s=10_000,
    train_tokens_per_s=2_000,
    sync_local_s=0.5,
    sync_bytes_per_s=1e9,
    reward_s=0.05,
    controller_s=0.02,
)
# GRPO (no reference, no critic): 32 samples of mean length 40; a quarter of the responses run to 100 tokens
TAIL = (20, 20, 20, 100)
WORK = cm.Workload(32, 32 * 40, 32 * 70, 1e8, has_ref=False, has_critic=False, response_lengths=TAIL)
FLAT = cm.Workload(32, 32 * 40, 32 * 70, 1e8, has_ref=False, has_critic=False)
COLOCATED = placement_plan("colocated", 4)
ROLLOUT1 = placement_plan("disaggregated", 4, rollout_per_node=1)
ROLLOUT2 = placement_plan("disaggregated", 4, rollout_per_node=2)


def longest(k: int) -> float:
    """The longest of k draws from TAIL: 100 unless all k are 20 (probability 0.75^k)."""
    return 20 * 0.75**k + 100 * (1 - 0.75**k)


# trainer stages on the 3-device train pool: old_log_prob, update_actor, reward, controller; the broadcast
TRAIN = 2240 / 30_000 + 2240 / 6_000 + 0.05 + 0.02
SYNC_W = 1e8 / 1e9


def test_longest_response_by_hand():
    assert WORK.longest_response(1) == pytest.approx(40)  # one draw: the mean
    assert WORK.longest_response(2) == pytest.approx(55)  # 20 * 9/16 + 100 * 7/16
    assert WORK.longest_response(4) == pytest.approx(74.6875)
    assert FLAT.longest_response(32) == pytest.approx(40)  # no lengths: every response as long as the mean
    # never below the mean of the step's tokens (a sample of lengths shorter than the step's mean)
    short = cm.Workload(4, 4 * 40, 4 * 70, 1.0, response_lengths=(10, 10))
    assert short.longest_response(3) == pytest.approx(40)
    with pytest.raises(ValueError, match="response_lengths must be >= 1"):
        cm.Workload(4, 40, 70, 1.0, response_lengths=(0, 3))


def test_sync_generation_waits_for_the_longest_response():
    # one rollout device decodes all 32: 100-ish steps at t0, and 32 * 40 sequence-steps at t1
    gen = 0.01 * longest(32) + 0.001 * 32 * 40
    p = cm.predict(RATES, ROLLOUT1, WORK)
    assert p.timings["gen"] == pytest.approx(gen)
    assert cm.predict(RATES, ROLLOUT1, FLAT).timings["gen"] == pytest.approx(40 * (0.01 + 0.001 * 32))
    assert p.step_s == pytest.approx(gen + TRAIN + SYNC_W)
    assert p.trainer_wait_s == pytest.approx(gen)  # sync: the trainer waits for all of generation
    assert p.samples_per_s == pytest.approx(32 / p.step_s)
    d = p.as_dict()
    assert d["schedule"] == "sync" and d["trainer_idle_frac"] == pytest.approx(gen / p.step_s)
    assert d["rollout_idle_frac"] == pytest.approx((TRAIN + SYNC_W) / p.step_s)
    # colocated: each of the 4 devices decodes 8, the step still waits for the longest of all 32
    q = cm.predict(RATES, COLOCATED, WORK)
    assert q.timings["gen"] == pytest.approx(0.01 * longest(32) + 0.001 * 8 * 40)


def test_one_step_overlaps_generation_with_training():
    gen = 0.01 * longest(32) + 0.001 * 32 * 40  # 2.28 s, longer than the 0.52 s of training
    p = cm.predict(RATES, ROLLOUT1, WORK, "one_step")
    assert p.step_s == pytest.approx(gen + SYNC_W)  # max(gen, train) + the weight swap
    assert p.trainer_wait_s == pytest.approx(gen - TRAIN)
    assert p.samples_per_s == pytest.approx(32 / (gen + SYNC_W))
    assert p.idle_s["rollout_pool"] == pytest.approx(0.0)
    assert p.idle_s["train_pool"] == pytest.approx(gen - TRAIN + 0.02)  # + the controller's own time
    sync = cm.predict(RATES, ROLLOUT1, WORK)
    assert sync.step_s - p.step_s == pytest.approx(TRAIN)  # the whole training time is hidden


def test_one_step_bound_by_training():
    slow = cm.StageRates(**{**RATES.__dict__, "train_tokens_per_s": 200})  # update_actor 3.73 s
    train = 2240 / 30_000 + 2240 / 600 + 0.05 + 0.02
    gen = 0.01 * longest(32) + 0.001 * 32 * 40
    p = cm.predict(slow, ROLLOUT1, WORK, "one_step")
    assert p.step_s == pytest.approx(train + SYNC_W) and p.trainer_wait_s == 0.0
    assert p.as_dict()["rollout_idle_frac"] == pytest.approx((train + SYNC_W - gen) / p.step_s)


def test_full_streams_calls_that_wait_for_their_own_longest():
    # one rollout device, calls of 4 samples: 8 calls of 74.69 decode steps with 4 * 40 sequence-steps each
    p = cm.predict(RATES, ROLLOUT1, WORK, "full", call_sequences=4)
    gen = 8 * (0.01 * 74.6875 + 0.001 * 4 * 40)
    assert p.timings["gen"] == pytest.approx(gen)  # 7.26 s: small calls pay t0 for every call's own tail
    assert p.step_s == pytest.approx(gen + SYNC_W) and p.trainer_wait_s == pytest.approx(gen - TRAIN)
    # two rollout devices, each streaming calls of 16: no barrier across the devices, so each call waits for the
    # longest of its own 16, where one_step waits for the longest of all 32
    full = cm.predict(RATES, ROLLOUT2, WORK, "full", call_sequences=16)
    one = cm.predict(RATES, ROLLOUT2, WORK, "one_step")
    assert full.timings["gen"] == pytest.approx(0.01 * longest(16) + 0.001 * 16 * 40)
    assert one.timings["gen"] == pytest.approx(0.01 * longest(32) + 0.001 * 16 * 40)
    assert one.step_s - full.step_s == pytest.approx(0.01 * (longest(32) - longest(16)))
    # without a tail, the same calls cost the same: the stream gains nothing on equal lengths
    assert cm.predict(RATES, ROLLOUT2, FLAT, "full", call_sequences=16).step_s == pytest.approx(
        cm.predict(RATES, ROLLOUT2, FLAT, "one_step").step_s
    )


def test_fit_on_sync_runs_with_a_tail_recovers_the_rates():
    obs = []
    for plan in (COLOCATED, ROLLOUT1, ROLLOUT2):
        p = cm.predict(RATES, plan, WORK)
        obs.append(cm.Observation(plan, WORK, {k: v for k, v in p.timings.items() if k != cm.CONTROLLER}))
    fit = cm.fit_rates(obs)
    assert fit.decode_t0 == pytest.approx(0.01) and fit.decode_t1 == pytest.approx(0.001)
    assert fit.train_tokens_per_s == pytest.approx(2_000) and fit.forward_tokens_per_s == pytest.approx(
        10_000
    )
    # so the async schedules are predicted from sync measurements alone
    assert cm.predict(fit, ROLLOUT1, WORK, "one_step").step_s == pytest.approx(
        0.01 * longest(32) + 0.001 * 32 * 40 + SYNC_W
    )


def test_schedule_errors_are_named():
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        cm.predict(RATES, ROLLOUT1, WORK, "fast")
    with pytest.raises(ValueError, match=r"needs the rollout on a pool of its own, not colocated\(4\)"):
        cm.predict(RATES, COLOCATED, WORK, "one_step")
    with pytest.raises(ValueError, match="call_sequences is the generate-call size of schedule 'full'"):
        cm.predict(RATES, ROLLOUT1, WORK, "full")
    with pytest.raises(ValueError, match="call_sequences is the generate-call size of schedule 'full'"):
        cm.predict(RATES, ROLLOUT1, WORK, "sync", call_sequences=8)
