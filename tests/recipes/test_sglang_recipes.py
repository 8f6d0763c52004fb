"""The recipes with ``rollout.name=sglang``: GRPO colocated (FSDP2 actor + SGLang engine in one worker) and
disaggregated (SGLang on its own pool, weights broadcast then loaded into it), and the RLM recipe with SGLang
generating the policy's turns; each through the recipe's entry point, on the nano model.

Without a GPU the engine is SGLang's CPU engine (``make sglang-cpu``); without SGLang these tests skip with
that hint, except in CI (``CI=true``), which installs it and must run them.

Witness that the synced weights reach SGLang's output: ``training/rollout_logprob_diff_max`` compares the
log-probs SGLang reported for its sampled tokens with the trainer's ``old_log_probs`` of the same tokens.
At step 2 SGLang samples after the sync that followed step 1's update, so a stale engine would show the
update's size there; the test checks that the update is large (initial vs exported model) and the diff tiny.
"""

import importlib.util
import time

import psutil
import pytest
import torch
from recipe_testlib import BRIEF_RLM

from recipes import grpo, grpo_async, rlm
from recipes.config import load_config
from recipes.trainer.run import start_run

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.timeout(600)]

LOGPROB_TOL = 1e-3  # float32 engines on both sides: observed differences are ~1e-5
DIGIT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's characters that are digits (varied rewards: GRPO updates at once)."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''
GRPO = [
    "rollout.name=sglang",
    "model.tiny_size=nano",
    "task.name=arithmetic",
    "task.n_train=64",
    "task.n_val=8",
    "data.val_max_samples=8",
    "data.train_batch_size=4",
    "data.max_prompt_length=32",
    "data.max_response_length=16",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=4",
    "actor.optim.lr=3e-2",  # a large first step, so a stale engine could not hide
    "trainer.total_training_steps=2",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
    "trainer.export_hf=true",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
    "trainer.plot=false",
]


@pytest.fixture(scope="module", autouse=True)
def sglang_installed(needs):
    if importlib.util.find_spec("sglang") is None:
        needs("needs SGLang: run `make sglang-cpu` (CPU engine) or pip install -e '.[sglang]' (CUDA)")


def _sglang_processes() -> set[int]:
    """pids of SGLang engine processes (scheduler, detokenizer: their titles start with ``sglang::``)."""
    pids = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith("sglang::"):
            pids.add(p.pid)
    return pids


@pytest.fixture
def no_leftover_engines():
    """Fails the test if an SGLang process started during it is still alive after it (10 s grace)."""
    before = _sglang_processes()
    yield
    deadline = time.monotonic() + 10
    while (left := _sglang_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"SGLang processes left behind: {sorted(left)}"


def _max_logprob_change(path_a: str, path_b: str) -> float:
    """Largest change of a next-token log-prob between two HF checkpoints on fixed random token sequences."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 200, (4, 24), generator=torch.Generator().manual_seed(0))
    logps = []
    for path in (path_a, path_b):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
        logps.append(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]))
    return float((logps[0] - logps[1]).abs().max())


def _run_grpo(tmp_path, overrides):
    reward_file = tmp_path / "digits.py"
    reward_file.write_text(DIGIT_REWARD)
    cfg = load_config(
        "grpo",
        [
            *GRPO,
            *overrides,
            f"custom_reward_function.path={reward_file}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    run = start_run(cfg, "grpo", start_ray=False)
    return run.model_path, grpo.train(cfg, run)


def _check_grpo(initial_model: str, result: dict) -> None:
    history = result["history"]
    assert [r["step"] for r in history] == [1, 2]
    for row in history:
        for key in ("timing_s/gen", "timing_s/update_weights", "rollout/tokens_per_s", "actor/pg_loss"):
            assert key in row, key
        assert row["perf/weight_sync_bytes"] > 0
        assert row["rollout/generated_tokens"] > 0
        assert row["training/rollout_logprob_diff_max"] < LOGPROB_TOL, row[
            "training/rollout_logprob_diff_max"
        ]
    # the updates moved the policy far more than the tolerance: a stale engine would fail the step-2 check
    assert history[0]["critic/score/mean"] != history[0]["critic/score/max"]  # varied rewards: a real update
    assert _max_logprob_change(initial_model, result["hf_model"]) > 50 * LOGPROB_TOL


def test_grpo_colocated_on_sglang_with_lora(ray_session, tmp_path, no_leftover_engines):
    """FSDP2 actor training LoRA adapters + SGLang engine in one worker. SGLang's LoRA layers cannot start on the
    CPU (they pin memory), so it is not an adapter-loading engine: every sync streams the full weights with the
    adapter merged in, and the engine's log-probs still match the trainer's (peft's, unmerged)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    lora = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=1e-1"]
    initial, result = _run_grpo(tmp_path, ["trainer.placement=colocated", "trainer.n_gpus_per_node=1", *lora])
    _check_grpo(initial, result)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(initial))
    full_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert {r["perf/weight_sync_bytes"] for r in result["history"]} == {full_bytes}


def test_grpo_disaggregated_on_sglang(ray_session, tmp_path, no_leftover_engines):
    """SGLang in a RolloutWorker on its own pool; the trainer's rank 0 broadcasts, SGLang loads."""
    initial, result = _run_grpo(
        tmp_path,
        ["trainer.placement=disaggregated", "trainer.n_gpus_per_node=2", "trainer.rollout_gpus_per_node=1"],
    )
    _check_grpo(initial, result)
    assert all(r["weight_sync/receivers"] == 1 for r in result["history"])


def test_rlm_on_sglang(ray_session, tmp_path, no_leftover_engines):
    """RLM trajectories whose model turns SGLang generates (its llm_query sub-calls would go to the same engine:
    env.sub_model_path is unset); log-probs agree with the trainer's, env metrics are reported."""
    result = rlm.main(
        [
            "rollout.name=sglang",
            *BRIEF_RLM,
            "trainer.val_before_train=false",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    assert result["step"] == 1 and [s for s, _ in result["val_history"]] == [1]
    final = result["final"]
    for key in ("env/turns/mean", "env/finished_frac", "critic/score/mean", "timing_s/gen", "val/accuracy"):
        assert key in final, key
    assert final["env/turns/mean"] >= 1
    assert final["training/rollout_logprob_diff_max"] < LOGPROB_TOL


def test_grpo_async_one_step_on_sglang(ray_session, tmp_path, no_leftover_engines):
    """One-step off-policy (``recipes/grpo_async.py``) with SGLang on the rollout pool. SGLang's weights change
    between calls only: the concurrent rollout worker's receive waits for the running generation, so every
    sample comes from one weight version, at most one behind the trainer's, and the off-policy metrics
    measure the gap that the trainer's log-probs see."""
    reward_file = tmp_path / "digits.py"
    reward_file.write_text(DIGIT_REWARD)
    cfg = load_config(
        "grpo_async",
        [
            *GRPO,
            "async_rl.mode=one_step",
            "trainer.total_training_steps=3",
            "trainer.export_hf=false",
            f"custom_reward_function.path={reward_file}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    result = grpo_async.train(cfg, start_run(cfg, "grpo_async", start_ray=False))
    rows = [r for r in result["history"] if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["async/partial_samples"] == 0 and r["async/staleness_max"] <= 1
        assert r["weight_sync/receivers"] == 1 and r["rollout/generated_tokens"] > 0
    assert max(r["off_policy/log_ratio_abs_max"] for r in rows) > LOGPROB_TOL  # stale samples were trained on
    last = result["last_batch"]
    mask = last.batch["response_mask"] > 0
    versions = last.batch["rollout_versions"]
    for row in range(len(last)):
        assert len(set(versions[row][mask[row]].tolist())) <= 1  # one version per sample
    assert set(versions[mask].tolist()) <= {1, 2}
