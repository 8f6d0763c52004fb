"""The LoRA-against-full race (benchmarks/bench_lora_race.py): its scoring at equal training time, worked by hand,
and the benchmark briefly on the nano model, through the quickstart's config as its full run uses it."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_lora_race


def _points(*triples):
    return [{"step": step, "train_s": s, "val": val} for step, s, val in triples]


def test_equal_time_scores_each_arm_by_its_last_validation_inside_the_shorter_arms_time():
    seeds = [
        {  # LoRA is slower per step: at full's 20 s it has validated only at step 5
            "seed": 0,
            "arms": {
                "full": _points((0, 0.0, 0.3), (5, 10.0, 0.5), (10, 20.0, 0.7)),
                "lora": _points((0, 0.0, 0.3), (5, 16.0, 0.45), (10, 32.0, 0.75)),
            },
        },
        {
            "seed": 1,
            "arms": {
                "full": _points((0, 0.0, 0.3), (5, 12.0, 0.4), (10, 24.0, 0.6)),
                "lora": _points((0, 0.0, 0.3), (5, 15.0, 0.5), (10, 30.0, 0.6)),
            },
        },
    ]
    rows = bench_lora_race.summarize(seeds)
    first, second, mean, se = rows
    assert (first["budget_s"], first["full@time"], first["lora@time"]) == (20.0, 0.7, 0.45)
    assert first["lora_step@time"] == 5
    assert first["diff@time"] == pytest.approx(-0.25) and first["diff@steps"] == pytest.approx(0.05)
    assert (second["budget_s"], second["full@time"], second["lora@time"]) == (24.0, 0.6, 0.5)
    assert first["lora_s/step"] == 3.2 and second["full_s/step"] == 2.4
    assert mean["diff@time"] == pytest.approx(-0.175)
    assert se["diff@time"] == pytest.approx(0.075)  # stdev(-0.25, -0.1) / sqrt(2)
    assert mean["diff@steps"] == pytest.approx(0.025)


@pytest.mark.e2e
def test_the_race_runs_both_arms_from_one_warm_start(ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs/<name>.json
    out = bench_lora_race.main(
        [
            *("--seeds", "1", "--steps", "2", "--test-freq", "1", "--dir", str(tmp_path), "--name", "race"),
            "model.tiny_size=nano",
            "sft.total_steps=2",
            "task.n_train=32",
            "task.n_val=4",
            "data.val_max_samples=4",
            "data.train_batch_size=2",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=2",
        ]
    )
    arms = out["curves"][0]["arms"]
    for points in arms.values():
        assert [p["step"] for p in points] == [0, 1, 2]
        assert points[0]["train_s"] == 0 < points[1]["train_s"] < points[2]["train_s"]
    assert arms["full"][0]["val"] == arms["lora"][0]["val"]  # one warm start, validated alike
    # the LoRA run reused the full run's warm start
    assert not (tmp_path / "seed0-lora" / "sft_model").exists()
    record = json.loads((tmp_path / "outputs" / "race.json").read_text())
    assert record["lora"] == bench_lora_race.LORA and [r["seed"] for r in record["rows"]] == [0, "mean", "se"]
