"""benchmarks/bench_recipe_defaults.py briefly: ``python -m recipes.grpo`` as a user's subprocess with its own Ray,
three steps from the untrained tiny model (no warm start), so every group's rewards are equal: the row reports the
steps, the held-out accuracy and rewards from the run's own metrics.jsonl, and that the run printed the
learning-signal warning -- the benchmark's check that a documented command is not silently learning nothing."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_recipe_defaults as bench

pytestmark = pytest.mark.e2e

BRIEF = [
    "sft.enable=false",  # the random tiny model: no sample earns a reward
    "model.tiny_size=nano",
    "task.n_train=32",
    "task.n_val=4",
    "data.val_max_samples=4",
    "data.train_batch_size=2",
    "data.max_prompt_length=32",
    "data.max_response_length=8",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "trainer.total_training_steps=3",
    "trainer.test_freq=3",
    "trainer.save_freq=-1",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
    "trainer.plot=false",
]


def test_a_recipe_that_learns_nothing_is_reported_so(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "write_json", lambda name, report: str(tmp_path / f"{name}.json"))
    report = bench.main(["--recipes", "grpo", "--out", str(tmp_path), *(f"--override={o}" for o in BRIEF)])
    [row] = report["results"]
    assert row["recipe"] == "grpo" and row["command"] == " ".join(["python -m recipes.grpo", *BRIEF])
    assert row["steps"] == 3 and row["wall_s"] > 0
    assert row["reward_first5"] == row["reward_last5"] == 0.0 and 0.0 <= row["val_after"] <= 1.0
    assert row["no_signal_warning"] is True
    logged = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [m["val/accuracy"] for m in logged if "val/accuracy" in m] == [row["val_before"], row["val_after"]]
    assert bench.NO_SIGNAL in (tmp_path / "grpo.log").read_text()
