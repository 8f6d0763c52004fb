"""benchmarks/bench_vs_trl.py without TRL (CI has no TRL virtualenv): hyflow's half through the benchmark's own
functions (the task, the SFT warm start, two real GRPO steps of recipes.grpo) with the nano model, the prompt
ids both sides generate from, and the TRL script's spec and reward (it imports TRL only inside ``train``)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from benchmarks import bench_vs_trl as bench
from benchmarks import trl_grpo_baseline as trl_side
from recipes.tasks.scoring import score_arithmetic
from workers.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_vs_trl")
    return out, bench.write_task(out / "data", n_train=24, n_val=8, n_sft=24)


@pytest.fixture(scope="module")
def warm_model(task, ray_session):
    out, files = task
    return bench.warm_started_model(out, files, sft_steps=2, n_sft=24, tiny_size="nano")


def test_task_is_two_digit_additions_with_boxed_demonstrations(task):
    _, files = task
    spec = bench.trl_spec("unused", files, steps=3)
    assert len(spec["prompts"]) == 24 and spec["steps"] == 3 and spec["n_samples"] == 8
    for p in spec["prompts"]:
        a, b = bench.operands(p["question"])
        assert 10 <= a <= 99 and 10 <= b <= 99 and int(p["answer"]) == a + b
    sft = pd.read_parquet(files["sft"])
    train_questions = {p["question"] for p in spec["prompts"]}
    assert not train_questions & {r["question"] for r in sft["extra_info"]}  # RL prompts are not the SFT ones
    assert all(
        r["solution"] == f"\\boxed{{{g['ground_truth']}}}"
        for r, g in zip(sft["extra_info"], sft["reward_model"])
    )


def test_both_sides_render_the_same_prompt_ids(task, warm_model):
    _, files = task
    questions = [p["question"] for p in bench.trl_spec(warm_model, files, 1)["prompts"][:4]]
    ours = bench.hyflow_prompt_ids(warm_model, files["train"], 4)
    assert ours == trl_side.render_ids(load_tokenizer(warm_model), questions)
    assert all(len(ids) == len(ours[0]) and ids[-3:] == ours[0][-3:] for ids in ours)  # assistant header last


def test_hyflow_round_reports_real_steps(task, warm_model, tmp_path):
    _, files = task
    r = bench.hyflow_round(warm_model, files, steps=2, run_dir=tmp_path / "hyflow")
    assert len(r["step_s"]) == len(r["completion_tokens"]) == len(r["reward"]) == 2
    assert all(t > 0 for t in r["step_s"])
    assert all(0 < n <= 32 * 16 for n in r["completion_tokens"])  # 4 prompts x 8 samples, <= 16 new tokens
    assert all(0.0 <= x <= 1.0 for x in r["reward"]) and 0.0 <= r["val_accuracy_before"] <= 1.0
    s = bench.summarize([r], warmup=1)
    assert s["steps_counted"] == 1 and s["median_step_s"] == s["p90_step_s"] == r["step_s"][1]
    # the stage breakdown: a strictly on-policy step has no old-log-prob pass (algorithm.old_log_prob=auto)
    stages = bench.stage_medians([r], warmup=1)
    assert stages["gen"] > 0 and stages["update_actor"] > 0 and stages["update_weights"] > 0
    assert stages["old_log_prob"] == 0.0
    assert sum(stages.values()) <= 1e3 * r["step_s"][1]


def test_hyflow_race_stops_on_time_and_validates_after(task, warm_model, tmp_path):
    _, files = task
    r = bench.hyflow_round(warm_model, files, steps=1000, run_dir=tmp_path / "race", race_s=0.001)
    assert len(r["step_s"]) == 1  # out of time after the first step
    assert 0.0 <= r["val_accuracy_after"] <= 1.0 and 0.0 <= r["val_accuracy_before"] <= 1.0


def test_summary_leaves_out_each_rounds_warmup():
    rounds: list[dict] = [
        {
            "step_s": [9.0, 1.0, 2.0, 3.0],
            "completion_tokens": [240.0, 250.0, 244.0, 246.0],
            "reward": [0, 1, 0, 1],
        },
        {"step_s": [8.0, 4.0, 5.0, 6.0], "completion_tokens": [240.0] * 4, "reward": [0.5] * 4},
    ]
    s = bench.summarize(rounds, warmup=1)
    assert s["steps_counted"] == 6 and s["median_step_s"] == 3.5 and s["p90_step_s"] == 6.0
    assert s["completion_tokens_per_step"] == pytest.approx(242.5) and s["mean_reward"] == 0.5


def test_trl_spec_round_trips_and_is_checked(task, tmp_path):
    _, files = task
    path = tmp_path / "spec.json"
    spec = bench.trl_spec("/some/model", files, steps=5)
    path.write_text(json.dumps({**spec, "lr": 1}))  # an int where a float goes is accepted
    loaded = trl_side.load_spec(str(path))
    assert (
        loaded["lr"] == 1.0 and loaded["prompts"] == spec["prompts"] and loaded["model_dir"] == "/some/model"
    )
    path.write_text(json.dumps({k: v for k, v in spec.items() if k != "max_new_tokens"}))
    with pytest.raises(ValueError, match="lacks 'max_new_tokens'"):
        trl_side.load_spec(str(path))
    path.write_text(json.dumps({**spec, "steps": True}))
    with pytest.raises(ValueError, match="steps must be int"):
        trl_side.load_spec(str(path))
    path.write_text(json.dumps({**spec, "prompts": [{"question": "Compute 1+2."}]}))
    with pytest.raises(ValueError, match="prompts"):
        trl_side.load_spec(str(path))


def test_race_spec_carries_the_held_out_prompts_and_seconds(task, tmp_path):
    _, files = task
    spec = bench.trl_spec("/some/model", files, steps=10, race_s=30.0)
    path = tmp_path / "race.json"
    path.write_text(json.dumps(spec))
    loaded = trl_side.load_spec(str(path))
    assert loaded["train_seconds"] == 30.0 and len(loaded["held_out"]) == 8  # the val split
    assert {p["question"] for p in loaded["held_out"]}.isdisjoint(p["question"] for p in loaded["prompts"])
    path.write_text(json.dumps({k: v for k, v in spec.items() if k != "held_out"}))
    with pytest.raises(ValueError, match="lacks 'held_out'"):
        trl_side.load_spec(str(path))
    assert "train_seconds" not in bench.trl_spec("/some/model", files, steps=10)  # no race: no time limit


@pytest.mark.parametrize(
    "text", ["\\boxed{46}", " \\boxed{ 46 }", "\\boxed{45}", "\\boxed{4}\\boxed{46}", "46", "\\boxed{+46}",
             "\\boxed{46.0}", "\\boxed{46", ""],
)  # fmt: skip
def test_trl_reward_is_hyflows_rule(text):
    assert trl_side.exact_match(text, "46") == score_arithmetic(text, "46")
    as_message = [[{"role": "assistant", "content": text}]]
    assert trl_side.exact_match_reward(as_message, answer=["46"]) == [score_arithmetic(text, "46")]
