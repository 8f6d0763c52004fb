"""Issue 31: a worker that dies or hangs does not end the run. Real processes are SIGKILLed mid-step (a rollout
rank of a disaggregated run, the env worker of the RLM recipe, a rollout rank of an asynchronous run while its
groups are buffered), a call hangs past its timeout, a worker dies again during its own recovery; the run
rebuilds its workers from the latest checkpoint and goes on, or stops with one error naming every fault in order.
That the recovered run's metrics equal a hand resume is tested with the resume tests (test_resume.py)."""

import os
import re
import signal

import pytest
from recipe_testlib import BRIEF_GRPO, BRIEF_RLM, kill_during_generation

from recipes import grpo, grpo_async, rlm
from recipes.config import load_config
from recipes.trainer import session as session_module
from recipes.trainer.recovery import RestartsExhausted
from recipes.trainer.run import start_run

pytestmark = pytest.mark.e2e

# the shared brief GRPO run, checkpointed every step (a restart's point to go on from), 3 steps, 32 tokens
BRIEF = [
    *BRIEF_GRPO,
    "data.max_response_length=32",
    "trainer.total_training_steps=3",
    "trainer.save_freq=1",
    "trainer.resume_mode=disable",
]
DISAGGREGATED = [
    "trainer.placement=disaggregated",
    "trainer.n_gpus_per_node=2",
    "trainer.rollout_gpus_per_node=1",
]


def _train(module, recipe, tmp_path, *overrides):
    cfg = load_config(recipe, [*BRIEF, *overrides, f"trainer.default_local_dir={tmp_path / 'run'}"])
    return module.train(cfg, start_run(cfg, recipe, start_ray=False))


def _steps(result) -> list[int]:
    return [r["step"] for r in result["history"]]


DIGIT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""
COMPARED = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm"]


def test_a_rollout_rank_killed_mid_generation_is_replaced_and_the_step_goes_on(
    ray_session, tmp_path, monkeypatch, capsys
):
    """Disaggregated GRPO: the rollout rank dies during step 2's generation. Its pool is replaced in place (no
    restart, nothing computed again but the generation), the new rank gets the weights of the current version,
    and the batch is generated again with the same seeds: every step's metrics equal the undisturbed run's."""
    reward = tmp_path / "digits.py"  # a dense reward the random policy earns a little of: metrics that move
    reward.write_text(DIGIT_REWARD)
    settings = [*DISAGGREGATED, "trainer.save_freq=-1", f"custom_reward_function.path={reward}"]
    calm = _train(grpo, "grpo", tmp_path / "calm", *settings)
    killed = kill_during_generation(monkeypatch, step=2, rank=0, group="rollout", delay_s=0.0)
    result = _train(grpo, "grpo", tmp_path, *settings)
    out = capsys.readouterr().out
    assert len(killed) == 1 and result["step"] == 3 and _steps(result) == [1, 2, 3]
    assert "FAULT at step 2: worker group 'rollout' rank 0 failed in 'generate_sequences'" in out, out
    assert "the rollout pool's workers are replaced" in out and "every worker group is rebuilt" not in out
    assert "replaced rollout in" in out and "with the trainer's current weights; step 2 goes on" in out
    assert "step 2 goes on at policy version 1" in out  # the version step 1's update synced
    history = {r["step"]: r for r in result["history"]}
    assert "fault/replacements" not in history[1]
    assert history[2]["fault/replacements"] == history[3]["fault/replacements"] == 1
    assert history[3]["fault/restarts"] == 0 and history[3]["fault/steps_lost"] == 0
    assert history[2]["fault/seconds_lost"] > 0
    for row in calm["history"]:
        for key in COMPARED:
            assert history[row["step"]][key] == pytest.approx(row[key], rel=1e-5, abs=1e-7), (
                row["step"],
                key,
            )
    assert len({round(r["critic/score/mean"], 6) for r in calm["history"]}) > 1  # rewards earned and moving


def test_the_env_worker_killed_mid_trajectory_in_the_rlm_recipe(ray_session, tmp_path, monkeypatch, capsys):
    """The RLM recipe's env worker (colocated: in the process of the rollout engine and trainer rank 0) is
    killed while it runs step 2's trajectories; the run goes on from step 1's checkpoint."""
    killed = kill_during_generation(monkeypatch, step=2, rank=0, group="generator", delay_s=0.02)
    result = rlm.main(
        [
            *BRIEF_RLM,
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    )
    out = capsys.readouterr().out
    assert len(killed) == 1 and result["step"] == 2, out
    assert "FAULT at step 2: worker group 'env' rank 0 failed in 'generate_sequences'" in out, out
    assert result["history"][-1]["fault/restarts"] == 1
    assert "env/rewritten_frac" in result["history"][-1]  # step 2's trajectories ran again, to the end


def test_an_async_run_loses_a_rollout_rank_while_groups_are_buffered(ray_session, tmp_path, monkeypatch):
    """``async_rl.mode=full``: the rollout rank dies while the stream has groups in flight and buffered; the run
    goes on from the last checkpoint, whose untrained prompts are generated again: in the steps the run kept,
    no prompt is trained twice or skipped."""
    trained: dict[int, list[str]] = {}  # step -> one uid per group, the last attempt of the step
    killed = []
    original = grpo_async.async_step

    def step(s, source, metrics, timings):
        if s.state.step == 3 and not killed:
            killed.append(s.roles.rollout.pids[0])
            os.kill(killed[0], signal.SIGKILL)
        batch = original(s, source, metrics, timings)
        trained[s.state.step] = [str(u) for u in batch.non_tensor_batch["uid"][::2]]
        return batch

    monkeypatch.setattr(grpo_async, "async_step", step)
    result = _train(
        grpo_async,
        "grpo_async",
        tmp_path,
        *DISAGGREGATED,
        "async_rl.mode=full",
        "async_rl.buffer_batches=2",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
    )
    assert killed and result["step"] == 4 and _steps(result) == [1, 2, 3, 4]
    assert result["history"][-1]["fault/restarts"] == 1
    uids = [u for s in sorted(trained) for u in trained[s]]
    assert sorted(trained) == [1, 2, 3, 4] and len(uids) == len(set(uids)) == 8


FLAKY_REWARD = """
import os
import time

MARKERS = {markers!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    for marker in MARKERS:  # hang once per marker: the first call of each attempt that finds it missing
        if not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(600)
    return 0.0
"""


def test_a_hang_is_a_fault_recovered_and_the_next_past_max_restarts_ends_the_run(
    ray_session, tmp_path, capsys
):
    """The reward call hangs past its timeout: the workers are rebuilt and the step runs again; the second hang
    is one more than ``trainer.max_restarts=1``, and the run stops naming both, in order."""
    reward = tmp_path / "flaky.py"
    reward.write_text(FLAKY_REWARD.format(markers=[str(tmp_path / "hang1"), str(tmp_path / "hang2")]))
    with pytest.raises(RestartsExhausted) as err:
        _train(
            grpo,
            "grpo",
            tmp_path,
            f"custom_reward_function.path={reward}",
            "trainer.max_restarts=1",
            "trainer.call_timeout_s=5",  # the other calls' margin on a loaded machine; the hang proves the rest
            "trainer.call_timeout_per_row_s=0.1",
        )
    out = capsys.readouterr().out
    assert (
        "FAULT at step 1: worker group 'reward' rank 0 failed in 'compute_rm_score': no result after" in out
    )
    assert "fault 1 of 1, a restart" in out and "from the start (no checkpoint yet)" in out
    msg = str(err.value)
    assert msg.startswith("more than trainer.max_restarts=1 worker faults; the faults in order:")
    lines = msg.splitlines()[1:]
    assert len(lines) == 2 and all(
        "'reward' rank 0 failed in 'compute_rm_score': no result after 5.4s" in x for x in lines
    )
    assert lines[0].startswith("  1. step 1:") and lines[1].startswith("  2. step 1:")


def test_a_worker_that_dies_during_its_own_recovery_ends_the_run(ray_session, tmp_path, monkeypatch):
    """A trainer rank dies in step 2; in the restart, the rebuilt rollout rank dies too before the recovery is
    done: one error, both faults in order, and the checkpoint directory holds only complete checkpoints."""
    kill_during_generation(monkeypatch, step=2, rank=0, group="actor")
    original, builds = session_module.build_roles, []

    def build_roles(*args, **kwargs):
        roles = original(*args, **kwargs)
        builds.append(roles)
        if len(builds) == 2:  # the recovery's build: its rollout rank dies before the weights reach it
            os.kill(roles.rollout.pids[0], signal.SIGKILL)
        return roles

    monkeypatch.setattr(session_module, "build_roles", build_roles)
    with pytest.raises(RestartsExhausted) as err:
        _train(grpo, "grpo", tmp_path, *DISAGGREGATED)
    lines = str(err.value).splitlines()
    assert lines[0] == "a worker failed again during the recovery; the faults in order:"
    assert re.match(r"  1\. step 2: worker group '(actor|ref|reward)' rank 0 failed in", lines[1]), lines
    assert lines[2].startswith("  2. step 2: while recovering: worker group 'rollout' rank 0 failed in")
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in (ckpts / "actor").iterdir()) == ["step_1"]
    assert (ckpts / "latest_step").read_text().strip() == "1"
