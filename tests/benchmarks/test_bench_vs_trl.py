"""benchmarks/bench_vs_trl.py without TRL (CI has no TRL virtualenv): hyflow's half through the benchmark's own
functions (the task, the SFT warm start, two real GRPO steps of recipes.grpo) with the nano model, the prompt
ids both sides generate from, and the TRL script's spec and reward (it imports TRL only inside ``train``)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from benchmarks import bench_vs_trl as bench
from benchmarks import trl_grpo_baseline as trl_side
from benchmarks import trl_one_update as one_update
from workers.models.loading import load_tokenizer
from workers.reward.arithmetic import score_arithmetic


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
    # the step as the user sees it: console line to console line, the timed step inside it
    assert len(r["line_s"]) == 1 and r["line_s"][0] > r["step_s"][1]
    s = bench.summarize([r], warmup=1)
    assert s["steps_counted"] == 1 and s["median_step_s"] == s["p90_step_s"] == r["step_s"][1]
    assert s["median_line_s"] == r["line_s"][0] and s["outside_step_s"] == r["line_s"][0] - r["step_s"][1]
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


def test_race_runs_each_seed_and_averages_them(task, warm_model, tmp_path):
    _, files = task
    # hyflow's side only; --hyflow-override reaches each run's recipe config
    out = bench.race(
        None, warm_model, files, seconds=0.001, work_dir=tmp_path, seeds=2, extra=["actor.optim.lr=3e-5"]
    )
    assert [(r["side"], r["seed"], r["steps"]) for r in out["runs"]] == [("hyflow", 0, 1), ("hyflow", 1, 1)]
    assert (tmp_path / "race_hyflow_s1" / "metrics.jsonl").is_file()  # each seed its own run
    for seed in (0, 1):
        cfg = yaml.safe_load((tmp_path / f"race_hyflow_s{seed}" / "config.yaml").read_text())
        assert cfg["actor"]["optim"]["lr"] == 3e-5
    after = [r["held_out_after"] for r in out["runs"]]
    assert out["mean"]["hyflow"]["held_out_after"] == pytest.approx(sum(after) / 2)
    assert set(out["load_average"]) == {"before", "after"}


def test_summary_leaves_out_each_rounds_warmup():
    rounds: list[dict] = [
        {
            "step_s": [9.0, 1.0, 2.0, 3.0],
            "line_s": [
                1.5,
                2.5,
                3.5,
            ],  # console line to line: each ends with steps 2, 3, 4, 0.5 s around the step
            "completion_tokens": [240.0, 250.0, 244.0, 246.0],
            "reward": [0, 1, 0, 1],
        },
        {
            "step_s": [8.0, 4.0, 5.0, 6.0],
            "line_s": [4.25, 5.25, 6.25],
            "completion_tokens": [240.0] * 4,
            "reward": [0.5] * 4,
        },
    ]
    s = bench.summarize(rounds, warmup=1)
    assert s["steps_counted"] == 6 and s["median_step_s"] == 3.5 and s["p90_step_s"] == 6.0
    assert s["first_step_extra_s"] == 8.5 - 3.5  # the rounds' first steps (9, 8) beyond a counted one
    assert s["completion_tokens_per_step"] == pytest.approx(242.5) and s["mean_reward"] == 0.5
    assert s["median_line_s"] == (3.5 + 4.25) / 2 and s["outside_step_s"] == (0.5 + 0.25) / 2
    # warmup 2 leaves out the line that ends with step 2 too
    s = bench.summarize(rounds, warmup=2)
    assert s["median_line_s"] == (3.5 + 5.25) / 2 and s["p90_line_s"] == 6.25


def test_trls_step_splits_into_generation_and_the_rest():
    rounds = [
        {"step_s": [9.0, 1.0, 2.0], "generate_s": [5.0, 0.25, 0.5]},
        {"step_s": [1.0, 3.0], "generate_s": [1.0, 1.0]},
    ]
    split = bench.trl_stage_medians(rounds, warmup=1)
    assert split == {
        "generate_and_score": 500.0,
        "rest": 1500.0,
    }  # medians of (0.25, 0.5, 1.0), (0.75, 1.5, 2.0)
    with pytest.raises(
        ValueError
    ):  # a step without its generation time is a broken result, not a shorter list
        bench.trl_stage_medians([{"step_s": [1.0, 2.0], "generate_s": [0.5]}], warmup=0)


def test_trl_generation_timer_wraps_the_trainers_call_and_keeps_its_result():
    class Trainer:  # stands in for GRPOTrainer: only the one method the timer wraps
        def _generate_and_score_completions(self, inputs):
            return [x * 2 for x in inputs]

    trainer = Trainer()
    seconds = trl_side.time_generation(trainer)
    assert trainer._generate_and_score_completions([1, 2]) == [2, 4]
    assert trainer._generate_and_score_completions([3]) == [6]
    assert len(seconds) == 2 and all(t >= 0.0 for t in seconds)


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


# ------------------------------------------------ one update on the same batch (benchmarks/trl_one_update.py)


def same_batch(model_dir: str, train_file: str, rows: int = 32) -> dict:
    """TRL's batch format: 4 rendered prompts x 8 completions of 1..16 random tokens, +-1 advantages."""
    g = torch.Generator().manual_seed(5)
    vocab = len(load_tokenizer(model_dir))
    prompts = bench.hyflow_prompt_ids(model_dir, train_file, 4)
    lengths = torch.randint(1, 17, (rows,), generator=g).tolist()
    return {
        "prompt_ids": [prompts[i // 8] for i in range(rows)],
        "completion_ids": [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths],
        "advantages": [1.0 if i % 3 else -1.5 for i in range(rows)],
    }


def test_batch_to_dataproto_puts_trls_rows_in_hyflows_layout():
    batch = {"prompt_ids": [[5, 6, 7], [8]], "completion_ids": [[9], [10, 11, 12]], "advantages": [0.5, -2.0]}
    b = one_update.batch_to_dataproto(batch, pad_id=0).batch
    assert b["prompts"].tolist() == [[5, 6, 7], [0, 0, 8]]  # left-padded
    assert b["responses"].tolist() == [[9, 0, 0], [10, 11, 12]]  # right-padded
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert b["position_ids"][1].tolist()[2:] == [0, 1, 2, 3]
    assert b["advantages"].tolist() == [[0.5, 0, 0], [-2.0, -2.0, -2.0]]
    with pytest.raises(ValueError, match="one row each"):
        one_update.batch_to_dataproto({**batch, "advantages": [1.0]}, pad_id=0)


def plain_grpo_step(model_dir: str, data, out_dir) -> float:
    """The on-policy GRPO step written out in plain torch on the HF model: token-mean of -A * log p (the ratio
    is 1, so its gradient is that of log p), clip to 1.0, one AdamW step; saves the model, returns the norm."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    b = data.batch
    width = b["prompts"].shape[1]
    logits = model(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
    ).logits
    log_probs = torch.log_softmax(logits[:, width - 1 : -1], dim=-1)
    token_log_probs = log_probs.gather(-1, b["responses"][..., None]).squeeze(-1)
    loss = -(b["advantages"] * token_log_probs * b["response_mask"]).sum() / b["response_mask"].sum()
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), bench.WORK["grad_clip"]))
    torch.optim.AdamW(model.parameters(), lr=bench.WORK["lr"], weight_decay=0.0).step()
    model.save_pretrained(out_dir)
    return norm


def test_hyflows_update_of_a_trl_batch_equals_the_plain_torch_grpo_step(task, warm_model, tmp_path):
    """The hyflow half of the one-update check (TRL's own half needs .venv-trl): ActorWorker.update_actor with
    the race's config on a batch in TRL's format equals the GRPO step written out in plain torch."""
    _, files = task
    batch = same_batch(warm_model, files["train"])
    ours = one_update.hyflow_update(warm_model, files, batch, tmp_path / "hyflow")
    data = one_update.batch_to_dataproto(batch, load_tokenizer(warm_model).pad_token_id)
    norm = plain_grpo_step(warm_model, data, tmp_path / "plain")
    assert ours["grad_norm"] == pytest.approx(norm, rel=1e-5)
    difference = one_update.update_difference(warm_model, ours["model_dir"], str(tmp_path / "plain"))
    assert difference["update_norm_trl"] > 1e-4  # the step moved the weights
    assert difference["relative_distance"] < 1e-3 and difference["cosine"] > 0.9999
    # a flipped advantage is a different update: the comparison can tell them apart
    flipped = {**batch, "advantages": [-a for a in batch["advantages"]]}
    plain_grpo_step(warm_model, one_update.batch_to_dataproto(flipped, 0), tmp_path / "flipped")
    assert (
        one_update.update_difference(warm_model, ours["model_dir"], str(tmp_path / "flipped"))["cosine"] < 0
    )
