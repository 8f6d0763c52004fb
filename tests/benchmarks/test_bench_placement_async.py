"""The placement x schedule benchmark (``benchmarks/bench_placement_async.py``): its override lists, the numbers
it takes from a recorded history (hand-made), the cost model's predictions from hand-made stage times, and the
whole benchmark run briefly on CPU (the untrained tiny model as the warm start, 2 s of training per
configuration; the warm start itself is the quickstart's ``warm_start``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import bench_placement_async as bench
from recipes.config import load_config
from recipes.trainer.run import resolve_model

PLANS = {n: bench.config_plan(n, 2, None) for n in bench.CONFIGS}


def test_config_overrides():
    assert bench.config_overrides("sync_colocated", PLANS["sync_colocated"], 90, "/m") == [
        "trainer.placement=colocated",
        "trainer.n_gpus_per_node=2",
        "async_rl.mode=sync",
        "trainer.max_train_time_s=90",
        "model.path=/m",
    ]
    full = bench.config_overrides("full", PLANS["full"], 30.0, None)
    assert full == [
        "trainer.placement=disaggregated",
        "trainer.n_gpus_per_node=2",
        "trainer.rollout_gpus_per_node=1",
        "async_rl.mode=full",
        "trainer.max_train_time_s=30.0",
    ]
    assert bench.config_overrides("one_step", PLANS["one_step"], 1, None)[3] == "async_rl.mode=one_step"


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "sync_colocated,fast"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--time", "0"])


def _row(step: int, step_s: float, **extra) -> dict:
    return {"step": step, "timing_s/step": step_s, **extra}


def test_measure_a_recorded_sync_history():
    def idle(trainer: float, rollout: float) -> dict:
        return {"async/trainer_idle_frac": trainer, "async/rollout_idle_frac": rollout}

    history = [
        {"step": 0, "val/accuracy": 0.3},
        _row(1, 3.0, **idle(0.5, 0.9), **{"timing_s/wait_rollout": 1.5}),  # warm-up: left out
        _row(2, 2.0, **idle(0.25, 0.8), **{"timing_s/wait_rollout": 0.5, "response_length/max": 90}),
        _row(3, 4.0, **idle(0.75, 0.4), **{"timing_s/wait_rollout": 3.0, "response_length/max": 70}),
    ]
    m = bench.measure(history, [(0, {"val/accuracy": 0.3}), (3, {"val/accuracy": 0.6})], rows_per_step=128)
    assert m["steps"] == 3 and m["steps_averaged"] == 2
    assert m["step_s"] == pytest.approx(3.0) and m["samples_per_s"] == pytest.approx(128 / 3.0)
    assert m["trainer_idle_frac"] == pytest.approx(0.5)
    assert m["rollout_idle_frac"] == pytest.approx(0.6)
    assert m["timing_s"]["wait_rollout"] == pytest.approx(1.75)
    assert (m["val_before"], m["val_after"], m["val_after_step"]) == (0.3, 0.6, 3)
    assert m["response_length_max"] == 90 and m["staleness_mean"] is None
    with pytest.raises(RuntimeError, match="no training step"):
        bench.measure([{"step": 0}], [], 8)


def test_measure_a_stream_history():
    history = [_row(1, 1.0), _row(2, 1.0, **{"async/dropped_stale_groups": 3.0, "async/staleness_mean": 0.5})]
    m = bench.measure(history, [], rows_per_step=16)
    assert m["dropped_stale_groups"] == 3.0 and m["staleness_mean"] == 0.5 and m["trainer_idle_frac"] is None
    assert m["val_before"] is None and m["val_after"] is None


def _sync_measured(train_devices: int, sync_s: float, wait_s: float) -> dict:
    """Stage times of 128 rows x 60 tokens at 24,000 forward and 6,000 training tokens/s per device."""
    stages = {
        "reward": 0.01,
        "old_log_prob": 7680 / 24_000 / train_devices,
        "update_actor": 7680 / 6_000 / train_devices,
        "update_weights": sync_s,
        "adv": 0.005,
    }
    return {
        "step_s": wait_s + sum(stages.values()),
        "timing_s": stages | {"wait_rollout": wait_s},
        "response_length_mean": 40.0,
        "total_tokens": 7680.0,
        "weight_bytes": 4.5e6,
    }


def test_predictions_from_hand_made_stages():
    # every response 40 tokens; decode step 1 ms + 0.1 ms per running sequence: calls of 128 and of 16
    lengths = [40] * 64
    calls = {128: [40 * (0.001 + 0.0001 * 128)], 16: [40 * (0.001 + 0.0001 * 16)] * 3}
    runs = {
        "sync_colocated": {"mode": "sync", "measured": _sync_measured(2, 0.07, 0.6)},
        "sync_disaggregated": {"mode": "sync", "measured": _sync_measured(1, 0.02, 0.6)},
        "one_step": {"mode": "one_step", "measured": {}},
        "full": {"mode": "full", "measured": {}},
    }
    for n, r in runs.items():
        r |= {"plan": PLANS[n], "rows": 128, "call_sequences": 16}
    rates, pred = bench.predictions(runs, lengths, calls, parallel_limit=2.0)
    assert rates["decode_t0"] == pytest.approx(0.001) and rates["decode_t1"] == pytest.approx(0.0001)
    assert rates["train_tokens_per_s"] == pytest.approx(6_000) and rates["controller_s"] == pytest.approx(
        0.005
    )
    train = 0.01 + 7680 / 24_000 + 7680 / 6_000 + 0.005  # one training device: 1.615 s
    assert pred["sync_disaggregated"]["step_s"] == pytest.approx(0.552 + train + 0.02)
    assert pred["sync_colocated"]["timing_s"]["gen"] == pytest.approx(40 * (0.001 + 0.0001 * 64))
    assert pred["one_step"]["step_s"] == pytest.approx(train + 0.02)  # generation (0.55 s) hidden
    assert pred["one_step"]["samples_per_s"] == pytest.approx(128 / (train + 0.02))
    assert pred["full"]["timing_s"]["gen"] == pytest.approx(8 * 0.104)  # 8 calls of 16
    assert pred["full"]["rollout_idle_frac"] == pytest.approx(1 - 0.832 / (train + 0.02))
    no_sync = {n: runs[n] for n in ("one_step", "full")}
    assert bench.predictions(no_sync, lengths, calls, 2.0) == (None, {"one_step": None, "full": None})


TINY = [  # a few small steps: 4 prompts x 2 samples, 24-token responses, 8 held-out problems
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=2",
    "data.max_response_length=24",
    "data.val_max_samples=8",
    "task.n_train=64",
    "task.n_val=8",
]


@pytest.mark.e2e
def test_bench_runs_every_configuration(ray_session, tmp_path):
    tiny = resolve_model(load_config(bench.RECIPE, []))  # built and cached locally
    report = bench.main(["--time", "2", "--warm-model", tiny, "--out", str(tmp_path), *TINY])
    saved = json.loads(Path(report["json"]).read_text())
    assert list(saved["configs"]) == list(bench.CONFIGS) and saved["functional_run"] is True
    assert saved["warm_model"] == tiny
    stats = saved["workload"]["response_length"]
    assert 1 <= stats["p50"] <= stats["p90"] <= stats["max"] <= 24
    for name, e in saved["configs"].items():
        m, p = e["measured"], e["predicted"]
        assert m["steps"] >= 1, name
        for key in ("samples_per_s", "trainer_idle_frac", "rollout_idle_frac", "staleness_mean", "val_after"):
            assert math.isfinite(m[key]), (name, key)
        assert 0 <= m["trainer_idle_frac"] <= 1 and 0 <= m["rollout_idle_frac"] <= 1
        assert math.isfinite(p["samples_per_s"]) and p["samples_per_s"] > 0 and p["schedule"] == e["mode"]
    assert saved["configs"]["sync_colocated"]["measured"]["staleness_mean"] == 0.0
    assert [row["config"] for row in saved["table"]] == list(bench.CONFIGS)
    assert Path(saved["png"]).is_file()
