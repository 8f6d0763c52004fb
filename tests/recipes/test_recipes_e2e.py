"""End to end on CPU: the GRPO and PPO recipes in both placements, a reward that rises under GRPO, and the
quickstart's SFT -> GRPO -> export flow, all on the nano model and a small generated task."""

import importlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from recipes import grpo, ppo, quickstart
from recipes.config import load_config
from recipes.trainer.run import start_run

pytestmark = pytest.mark.e2e

TINY = [
    "model.tiny_size=nano",
    "task.name=arithmetic",
    "task.n_train=64",
    "task.n_val=8",
    "data.val_max_samples=8",
    "data.train_batch_size=4",
    "data.max_prompt_length=32",
    "data.max_response_length=16",
    "rollout.n=2",
    "trainer.total_training_steps=2",
    "trainer.test_freq=2",
    "trainer.save_freq=2",
    "trainer.resume_mode=disable",
    "trainer.progress_bar=false",
    "trainer.logger=[console,tensorboard]",
]
PLACEMENT = {
    "colocated": ["trainer.placement=colocated", "trainer.n_gpus_per_node=1"],
    # training pool of 2 (FSDP2 over gloo, data-parallel 2) + a rollout pool of 1
    "disaggregated": [
        "trainer.placement=disaggregated",
        "trainer.n_gpus_per_node=3",
        "trainer.rollout_gpus_per_node=1",
    ],
}
RECIPES = {
    # the token budget from the memory model (recipes/trainer/sizing.py): on the CPU a fixed one
    "grpo": (
        grpo,
        ["actor.ppo_mini_batch_size=4", "actor.use_kl_loss=true", "actor.ppo_max_token_len_per_gpu=auto"],
    ),
    "ppo": (
        ppo,
        ["actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=4", "algorithm.use_kl_in_reward=true"],
    ),
}
STEP_METRICS = [
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "prompt_length/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/ref",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "perf/throughput",
    "perf/weight_sync_bytes",
    "training/rollout_logprob_diff_mean",  # engine vs trainer log-probs: old_log_probs exist either way
]


def _run(module, recipe, run_dir, overrides):
    cfg = load_config(recipe, [*TINY, *overrides, f"trainer.default_local_dir={run_dir}"])
    return module.train(cfg, start_run(cfg, recipe, start_ray=False))


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_recipe_runs_and_writes_everything(ray_session, tmp_path, recipe, placement):
    module, extra = RECIPES[recipe]
    result = _run(module, recipe, tmp_path / "run", [*extra, *PLACEMENT[placement]])
    run_dir = Path(result["run_dir"])
    hist = result["history"]
    assert [r["step"] for r in hist] == [0, 1, 2] and result["step"] == 2
    # validation before training and at the last step (test_freq=2): greedy accuracy on the 8 held-out prompts
    for row in (hist[0], hist[2]):
        assert 0.0 <= row["val/accuracy"] <= 1.0 and row["val/num_samples"] == 8
        assert "val-core/hyflow/arithmetic/acc" in row
    for row in hist[1:]:
        missing = [k for k in STEP_METRICS if k not in row]
        assert not missing, f"missing metrics {missing}"
        bad = {k: v for k, v in row.items() if not math.isfinite(v)}
        assert not bad, f"non-finite metrics {bad}"
        assert row["response_length/mean"] > 0 and row["prompt_length/mean"] > 0
        assert row["perf/weight_sync_bytes"] > 0 and row["actor/lr"] > 0
        # 4 prompts x 2 samples: throughput = tokens / step time / devices
        devices = 1 if placement == "colocated" else 3
        expect = row["perf/total_num_tokens"] / row["perf/time_per_step"] / devices
        assert row["perf/throughput"] == pytest.approx(expect)
        # algorithm.old_log_prob=auto: GRPO's one mini-batch per step takes the old log-probs from its update's
        # forward pass; PPO's two mini-batches need the pass before the update
        assert ("timing_s/old_log_prob" in row) == (recipe == "ppo")
        assert row["training/rollout_logprob_diff_mean"] < 1e-3  # the engine holds the trainer's weights
        if recipe == "ppo":
            assert {"critic/vf_loss", "critic/values/mean", "critic/returns/mean", "timing_s/values"} <= set(
                row
            )
            assert "actor/reward_kl_penalty" in row and "timing_s/update_critic" in row
        else:
            assert "actor/kl_loss" in row
        if placement == "disaggregated":
            assert row["weight_sync/receivers"] == 1  # the rollout pool's one rank got the weights
    # checkpoint of every trained role at save_freq, written atomically with the trainer state
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest_step").read_text().strip() == "2"
    roles = ["actor", "critic"] if recipe == "ppo" else ["actor"]
    for role in roles:
        assert (ckpt / role / "step_2" / "manifest.json").is_file()
        assert not list((ckpt / role).glob("*.tmp"))
    # the run directory: resolved config, per-step metrics, TensorBoard events, the curves
    assert (run_dir / "config.yaml").is_file()
    if recipe == "grpo":  # auto is saved as auto: a resumed run sizes itself on its own device
        saved = load_config(recipe, config_path=run_dir / "config.yaml", check=False)
        assert saved.actor.ppo_max_token_len_per_gpu == "auto"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert Path(result["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


DIGIT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's characters that are digits."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


def test_grpo_raises_an_easy_reward(ray_session, tmp_path):
    """A custom reward (share of digits in the response) that a random policy rarely earns: GRPO raises it."""
    reward_file = tmp_path / "digits.py"
    reward_file.write_text(DIGIT_REWARD)
    steps = 10
    result = _run(
        grpo,
        "grpo",
        tmp_path / "run",
        [
            *PLACEMENT["colocated"],
            f"custom_reward_function.path={reward_file}",
            f"trainer.total_training_steps={steps}",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.val_before_train=false",
            "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=8",
            "rollout.n=4",
            "actor.optim.lr=3e-2",
            "actor.use_kl_loss=false",
        ],
    )
    scores = [r["critic/score/mean"] for r in result["history"]]
    assert len(scores) == steps
    first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert first < 0.05 and last > 0.3 and last > 10 * first, f"reward did not rise: {scores}"
    entropy = [r["actor/entropy"] for r in result["history"]]
    assert entropy[-1] < entropy[0]  # the policy sharpened towards digit tokens


def test_quickstart_flow_then_a_second_run_never_overwrites_its_results(
    ray_session, tmp_path, capsys, monkeypatch
):
    """The quickstart's SFT -> GRPO -> export flow and what it prints and writes. Then the LoRA quickstart into
    the same folder, which would have replaced its metrics, curves and result.json without a word (issue 56): it
    is refused before anything is written, naming what the folder holds, the keys that differ and the ways out.
    The same command again starts over in place when there is nothing to resume; trainer.overwrite=true replaces
    another run's results. (The warm start prints a line every PROGRESS_S seconds whatever sft.log_every says:
    here 0 s, so every step.)"""
    from recipes.config import ConfigError

    # the module (recipes.trainer exports its function under the same name)
    monkeypatch.setattr(importlib.import_module("recipes.trainer.warm_start"), "PROGRESS_S", 0.0)
    run_dir = tmp_path / "qs"
    first = [
        *TINY,
        f"trainer.default_local_dir={run_dir}",
        "sft.total_steps=4",
        "sft.batch_size=8",
        "sft.log_every=2",
        "sft.optim.total_steps=4",
        "actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=1",
        "trainer.test_freq=1",
    ]
    out = quickstart.main(first)
    text = capsys.readouterr().out
    assert "[sft] step 1/4 | loss" in text  # by time, not by log_every
    assert "[sft] step 4/4 | loss" in text
    assert f"validation accuracy {out['val_before']:.2f} -> {out['val_after']:.2f}" in text
    # the printed result as data: what benchmarks/results/quickstart.json copies from a full run
    recorded = json.loads((run_dir / "result.json").read_text())
    assert recorded == {
        "val_before": out["val_before"],
        "val_after": out["val_after"],
        "wall_s": round(out["wall_s"], 1),
        "steps": 1,
    }
    assert f"wall time:       {out['wall_s']:.0f}s" in text
    # GRPO started from the exported SFT model, and the final policy was exported again
    assert out["sft_model"] == str(run_dir / "sft_model")
    for d in (out["sft_model"], out["hf_model"]):
        assert (Path(d) / "config.json").is_file() and (Path(d) / "model.safetensors").is_file()
        assert (Path(d) / "tokenizer.json").is_file()
    assert Path(out["plot"]).is_file() and str(run_dir / "tensorboard") in text
    assert list((run_dir / "tensorboard" / "sft").glob("events.out.tfevents.*"))

    lora = [*first, "actor.lora.rank=16", "actor.lora.alpha=32", "actor.optim.lr=1e-3"]
    kept = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "result.json", "config.yaml")}

    def refused(overrides) -> str:
        with pytest.raises(ConfigError) as err:
            quickstart.main(overrides)
        assert {name: (run_dir / name).read_bytes() for name in kept} == kept  # nothing written
        return str(err.value)

    message = refused(lora)  # resume_mode=disable over a checkpoint, whatever the config
    assert f"{run_dir} holds metrics.jsonl with steps 0-1 and checkpoints up to step 1" in message
    assert "trainer.resume_mode=auto" in message and "trainer.overwrite=true" in message
    assert "trainer.experiment_name=<name>" in message
    assert "holds metrics.jsonl" in refused(first)  # the same config does not start over a checkpoint either
    # resume_mode=auto continues the run: saying what changed, never with another model's checkpoint, and not
    # a finished run with a changed config (it would train nothing)
    message = refused([*lora, "trainer.resume_mode=auto"])
    assert f"would resume {run_dir}, which finished at step 1, with a changed config (" in message
    capsys.readouterr()
    longer = [*lora, "trainer.resume_mode=auto", "trainer.total_training_steps=2"]
    start_run(load_config("quickstart", longer), "quickstart", start_ray=False)
    said = capsys.readouterr().out
    assert f"[run] resuming {run_dir} at step 1 with a config that differs from the run's: " in said
    assert "actor.lora.rank (0 -> 16)" in said and "trainer.total_training_steps (1 -> 2)" in said
    (run_dir / "config.yaml").write_bytes(
        kept["config.yaml"]
    )  # the first run's again (the resume wrote its own)
    message = refused([*first, "trainer.resume_mode=auto", "model.tiny_size=tiny"])
    assert f"trainer.resume_mode=auto would resume {run_dir} at step 1, a run of another model " in message
    assert "model.tiny_size ('nano' -> 'tiny')" in message
    shutil.rmtree(run_dir / "checkpoints")  # no checkpoint: the config tells the same run from another one
    message = refused(lora)
    assert "holds the results of another run (metrics.jsonl with steps 0-1;" in message
    assert "actor.lora.alpha (16.0 -> 32.0)" in message and "actor.lora.rank (0 -> 16)" in message
    assert "actor.optim.lr (" in message
    capsys.readouterr()
    start_run(load_config("quickstart", first), "quickstart", start_ray=False)  # the same command again
    assert "no checkpoint to resume from: the run starts again and replaces them" in capsys.readouterr().out
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "result.json").exists()
    assert not (run_dir / "tensorboard").exists() and (run_dir / "sft_model" / "config.json").is_file()
    (run_dir / "metrics.jsonl").write_bytes(kept["metrics.jsonl"])  # as the rerun would log it
    start_run(load_config("quickstart", [*lora, "trainer.overwrite=true"]), "quickstart", start_ray=False)
    assert "trainer.overwrite=true: " in capsys.readouterr().out
    assert not (run_dir / "metrics.jsonl").exists()
    assert (
        load_config("quickstart", config_path=str(run_dir / "config.yaml"), check=False).actor.lora.rank == 16
    )


def test_the_ppo_command_warm_starts_the_tiny_model_and_rl_starts_from_it(ray_session, tmp_path, capsys):
    """``python -m recipes.ppo`` as README shows it: no model.path, so the random tiny model is warm-started first
    (sft.enable null: on for the tiny model) and policy, reference and critic start from that export. With the
    critic warming up for the one step, the policy is not updated: the exported final model is the warm start,
    weight for weight, and the warm start moved every weight matrix away from the random model."""
    from safetensors.torch import load_file

    from workers.models.tiny import ensure_tiny_model

    run_dir = tmp_path / "ppo"
    out = ppo.main(
        [
            *TINY,
            *RECIPES["ppo"][1],
            *PLACEMENT["colocated"],
            f"trainer.default_local_dir={run_dir}",
            "sft.total_steps=2",
            "sft.batch_size=8",
            "sft.log_every=1",
            "sft.optim.total_steps=2",
            "trainer.total_training_steps=1",
            "trainer.critic_warmup=1",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.export_hf=true",
        ]
    )
    assert "[sft] step 2/2 | loss" in capsys.readouterr().out
    assert out["step"] == 1 and "critic/vf_loss" in out["final"]
    random = load_file(str(Path(ensure_tiny_model("nano")) / "model.safetensors"))
    warm = load_file(str(run_dir / "sft_model" / "model.safetensors"))
    final = load_file(str(Path(out["hf_model"]) / "model.safetensors"))
    assert warm.keys() == final.keys() == random.keys()
    assert all(torch.equal(final[k], warm[k]) for k in warm)
    assert all(not torch.equal(warm[k], random[k]) for k in warm if k.endswith("proj.weight"))


def test_grpo_without_the_old_log_prob_pass_trains_the_same(ray_session, tmp_path):
    """algorithm.old_log_prob=auto (no compute_log_prob pass: the update's forward gives the old log-probs) and
    recompute (the pass first) sample, score and update alike: the same losses and gradients step by step, and
    the same updated policy (its step-2 samples and held-out answers); rollout takes the rollout engine's
    log-probs instead. On the digit reward, which the random policy earns a little of: the advantages are not
    all zero, so the updates change the policy and a wrong ratio or old log-prob would change the losses."""
    reward = tmp_path / "digits.py"
    reward.write_text(DIGIT_REWARD)
    common = [
        *PLACEMENT["colocated"],
        *RECIPES["grpo"][1],
        "trainer.save_freq=-1",
        "actor.optim.lr=1e-2",
        f"custom_reward_function.path={reward}",
    ]
    runs = {
        mode: _run(grpo, "grpo", tmp_path / mode, [*common, f"algorithm.old_log_prob={mode}"])["history"]
        for mode in ("auto", "recompute", "rollout")
    }
    auto, recompute, rollout = runs["auto"], runs["recompute"], runs["rollout"]
    assert "timing_s/old_log_prob" in recompute[1] and "timing_s/old_log_prob" not in auto[1]
    for row in auto[1:]:  # something to learn from, and an update that uses it
        assert row["critic/advantages/max"] > 0 and row["actor/grad_norm"] > 0
    # the updates changed the policy: its greedy held-out answers went from no digits to some
    assert auto[0]["val/accuracy"] == 0 and auto[2]["val/accuracy"] > 0
    # auto and recompute run the same forward on the same weights (in the update, or in a pass before it): the
    # old log-probs agree to float32 rounding, the ratio is 1 in both. rel=1e-5 leaves room for a different
    # summation order only; a wrong old log-prob or ratio moves these by 1e-2 and more
    keys = ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"]
    keys += ["critic/score/mean", "critic/advantages/max", "response_length/mean"]  # step 2: the new policy
    for a, r in zip(auto[1:], recompute[1:]):
        for key in keys:
            assert a[key] == pytest.approx(r[key], rel=1e-5, abs=1e-7), key
    assert auto[2]["val/accuracy"] == recompute[2]["val/accuracy"]
    assert auto[1]["actor/grad_norm"] != auto[2]["actor/grad_norm"]  # two different updates
    # rollout: the engine's log-probs are the old ones (no pass); its first step sampled what the others did,
    # and the engine's and the trainer's log-probs differ by numerics only (training/rollout_logprob_diff_max
    # of auto, ~1e-6): the ratio is within 1e-5 of 1, so the loss and gradient agree to rel 1e-4
    assert (
        "timing_s/old_log_prob" not in rollout[1] and rollout[1]["training/rollout_logprob_diff_max"] == 0.0
    )
    assert auto[1]["training/rollout_logprob_diff_max"] < 1e-5
    assert rollout[1]["critic/score/mean"] == auto[1]["critic/score/mean"]
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert rollout[1][key] == pytest.approx(auto[1][key], rel=1e-4), key
    assert rollout[1]["actor/ppo_kl"] != 0.0 and abs(rollout[1]["actor/ppo_kl"]) < 1e-3  # trainer vs engine


def test_grpo_with_model_compile_trains_as_eager(ray_session, tmp_path):
    """``model.compile=true rollout.compile=true`` through the recipe: the trainer's decoder layers and the native
    engine's layer blocks compiled, in one colocated process. The same steps as eager: same samples (rewards, lengths), losses
    and gradients to float rounding, and the compiled engine's log-probs equal the compiled trainer's."""
    reward = tmp_path / "digits.py"
    reward.write_text(DIGIT_REWARD)  # advantages that are not all zero: the updates change the policy
    common = [
        *PLACEMENT["colocated"],
        *RECIPES["grpo"][1],
        "trainer.save_freq=-1",
        "actor.optim.lr=1e-2",
        f"custom_reward_function.path={reward}",
        "trainer.val_before_train=false",  # step 1's generation is the native engine's first: its compile
    ]
    eager, compiled = (
        _run(grpo, "grpo", tmp_path / name, [*common, f"model.compile={flag}", f"rollout.compile={flag}"])[
            "history"
        ]
        for name, flag in (("eager", "false"), ("compiled", "true"))
    )
    keys = ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"]
    keys += ["critic/score/mean", "critic/advantages/max", "response_length/mean"]
    assert [r["step"] for r in eager] == [1, 2]  # no validation before training: step 1 comes first
    assert eager[0]["actor/grad_norm"] > 0 and eager[1]["critic/score/mean"] > 0
    # both engines compiled on their first call (seconds, even from inductor's disk cache; eager: ~20 ms)
    for stage in ("timing_s/gen", "timing_s/update_actor"):
        assert compiled[0][stage] > eager[0][stage] + 0.5, stage
    for e, c in zip(eager, compiled, strict=True):
        for key in keys:
            assert c[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key
        assert c["training/rollout_logprob_diff_max"] < 1e-5
    assert compiled[1]["val/accuracy"] == eager[1]["val/accuracy"]
