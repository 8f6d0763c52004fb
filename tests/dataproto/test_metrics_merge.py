"""`merge_meta_info`: the per-rank ``meta_info`` of a group call's chunks merged into one, each metric by the
rule its name decides (dataproto/metrics_merge.py), checked against values worked out by hand."""

import math

import pytest

from dataproto import merge_meta_info, merge_rule

# chunk 0 has 3 rows, chunk 1 has 1 row
ROWS = [3, 1]
RANK0 = {
    "eos_token_id": 2,
    "temperature": 1.0,
    "timing_s/gen": 1.5,
    "rollout/generated_tokens": 30,
    "rollout/tokens_per_s": 20.0,
    "reward_error_messages": ["row 1: boom"],
    "metrics": {
        "env/turns/mean": 2.0,
        "env/turns/max": 3.0,
        "env/latency/min": 0.2,
        "env/errors": 1.0,
        "env/status/finished": 3.0,
        "env/finished_frac": 1.0,
    },
}
RANK1 = {
    "eos_token_id": 2,
    "temperature": 0.7,  # ranks disagree on a non-metric key: the first chunk's, as DataProto.concat
    "timing_s/gen": 2.5,
    "rollout/generated_tokens": 12,
    "rollout/tokens_per_s": 4.8,
    "reward_error_messages": [],
    "metrics": {
        "env/turns/mean": 6.0,
        "env/turns/max": 6.0,
        "env/latency/min": 0.1,
        "env/errors": 0.0,
        "env/finished_frac": 0.0,
        "env/depth_1/num_trajectories": 2.0,  # only this rank's trees were that deep
    },
}


def test_two_chunks_of_different_sizes():
    out = merge_meta_info([RANK0, RANK1], ROWS)
    assert out["eos_token_id"] == 2 and out["temperature"] == 1.0
    assert out["reward_error_messages"] == ["row 1: boom"]
    assert out["timing_s/gen"] == 2.5  # the slowest rank
    assert out["rollout/generated_tokens"] == 42 and isinstance(out["rollout/generated_tokens"], int)
    assert out["rollout/tokens_per_s"] == pytest.approx((3 * 20.0 + 1 * 4.8) / 4)  # 16.2
    m = out["metrics"]
    assert m["env/turns/mean"] == pytest.approx((3 * 2.0 + 1 * 6.0) / 4)  # 3.0, not the plain mean 4.0
    assert m["env/finished_frac"] == pytest.approx(0.75)  # 3 of the 4 rows' trajectories
    assert m["env/turns/max"] == 6.0 and m["env/latency/min"] == 0.1
    assert m["env/errors"] == 1.0 and m["env/status/finished"] == 3.0  # the second only on rank 0
    assert m["env/depth_1/num_trajectories"] == 2.0
    assert list(out) == list(RANK0) and list(m) == [*RANK0["metrics"], "env/depth_1/num_trajectories"]
    assert RANK0["metrics"]["env/turns/mean"] == 2.0  # the inputs are left as they were


def test_a_chunk_without_rows_does_not_weigh_in():
    # a split call's placeholder rank: its averages over nothing are 0
    out = merge_meta_info(
        [{"metrics": {"env/turns/mean": 2.5}}, {"metrics": {"env/turns/mean": 0.0}}], [4, 0]
    )
    assert out["metrics"]["env/turns/mean"] == 2.5


def test_metrics_only_chunks_take_the_plain_mean():
    # a training call returns no rows, only metrics
    metas = [
        {"metrics": {"actor/pg_loss": 0.5, "actor/lr": 1e-6}},
        {"metrics": {"actor/pg_loss": 0.3, "actor/lr": 1e-6}},
    ]
    out = merge_meta_info(metas, [0, 0])
    assert out["metrics"]["actor/pg_loss"] == pytest.approx(0.4) and out["metrics"]["actor/lr"] == 1e-6


def test_non_numeric_values_keep_the_first_chunk():
    metas = [
        {"group/flag": True, "group/names": ["a"], "metrics": {"env/errors": 1.0, "env/note": "x"}},
        {"group/flag": False, "group/names": ["b"], "metrics": {"env/errors": 2.0, "env/note": 3.0}},
    ]
    out = merge_meta_info(metas, [1, 1])
    assert out == {"group/flag": True, "group/names": ["a"], "metrics": {"env/errors": 3.0, "env/note": "x"}}


def test_a_nan_propagates_and_one_chunk_is_a_copy():
    out = merge_meta_info(
        [{"metrics": {"actor/grad_norm": float("nan")}}, {"metrics": {"actor/grad_norm": 1.0}}], [2, 2]
    )
    assert math.isnan(out["metrics"]["actor/grad_norm"])
    one = {"metrics": {"env/errors": 1.0}, "n": 2}
    assert merge_meta_info([one], [5]) == one and merge_meta_info([one], [5]) is not one
    with pytest.raises(ValueError, match="2 meta_info dicts but 1 row counts"):
        merge_meta_info([one, one], [1])


@pytest.mark.parametrize(
    "name, rule",
    [
        ("timing_s/gen", "max"),
        ("timing_s/weight_sync_receive_max", "max"),
        ("perf/max_memory_allocated_gib/gen", "max"),
        ("env/depth/max", "max"),
        ("async/staleness_min", "min"),
        ("env/turns/mean", "mean"),
        ("teacher/hint_tokens/mean", "mean"),  # an average of a count
        ("env/finished_frac", "mean"),
        ("actor/pg_clipfrac", "mean"),
        ("response_length/clip_ratio", "mean"),
        ("rollout/tokens_per_s", "mean"),
        ("env/gen_s_per_turn", "mean"),
        ("rollout/generated_tokens", "sum"),  # "generated" holds "rate", but not as a word
        ("rollout/num_sequences", "sum"),
        ("env/depth_0/num_trajectories", "sum"),
        ("env/status/finished", "sum"),
        ("env/depth_1/status/error", "sum"),
        ("reward/errors", "sum"),
        ("tool/timeouts", "sum"),
        ("env/rows", "sum"),
        ("env/dropped_turns", "sum"),
        ("teacher/rows_with_hint", "sum"),
        ("actor/pg_loss", "mean"),
        ("actor/skipped_steps", "mean"),  # the same on every training rank: not summed
    ],
)
def test_rule_by_name(name, rule):
    assert merge_rule(name) == rule


def test_a_value_every_rank_shares_comes_back_exactly():
    # all-reduced training metrics: 3 * 0.1 / 3 would not give back 0.1 bit for bit
    metas = [{"metrics": {"actor/lr": 0.1, "actor/skipped_steps": 2}}] * 3
    assert merge_meta_info(metas, [1, 1, 1])["metrics"] == {"actor/lr": 0.1, "actor/skipped_steps": 2}
