"""The chaos benchmark briefly, on the nano model: a real rollout process SIGKILLed during the chaos arm's steps,
the run replaced it in place and trained the same prompts to the same metrics as the undisturbed arm."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from benchmarks import bench_chaos

BRIEF = [
    "model.tiny_size=nano",
    "task.n_train=64",
    "task.n_val=8",
    "data.val_max_samples=8",
    "data.train_batch_size=4",
    "data.max_response_length=16",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_monkey_kills_a_process_once_even_while_the_run_still_lists_it():
    """A SIGKILLed process stays in its group's pids until the run notices the death (unreaped, it is a zombie that
    os.kill still reaches): the monkey must not kill it again and count one fault twice (a CI run counted 5 kills
    for 4 faults this way); the replacement's new process is a fair target."""
    first, second = _sleeper(), _sleeper()
    try:
        rollout = SimpleNamespace(pids=[first.pid])
        session = SimpleNamespace(
            roles=SimpleNamespace(rollout=rollout, actor=SimpleNamespace(pids=[])),
            faults=SimpleNamespace(faults=[]),  # the run has not noticed the death yet
            state=SimpleNamespace(step=9),
        )
        monkey = bench_chaos.ChaosMonkey(every_s=0.1, targets=["rollout"])
        monkey.session = session
        monkey.in_step.set()
        with monkey:
            time.sleep(1.0)
            assert [k["pid"] for k in monkey.kills] == [first.pid]
            rollout.pids = [second.pid]  # replaced in place
            time.sleep(1.0)
        assert [k["pid"] for k in monkey.kills] == [first.pid, second.pid]
        assert first.wait(5) == second.wait(5) == -9
    finally:
        for p in (first, second):
            p.kill()
            p.wait()


@pytest.mark.e2e
def test_chaos_arm_survives_its_kills_and_matches_the_calm_arm(ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs/<name>.json
    out = bench_chaos.main(
        [
            "--steps",
            "10",
            "--sft-steps",
            "2",
            "--every",
            "0.3",
            "--dir",
            str(tmp_path),
            "--name",
            "chaos",
            *BRIEF,
        ]
    )
    calm, chaos = out["rows"]
    assert calm["steps"] == chaos["steps"] == 10 and calm["faults_injected"] == 0
    assert chaos["faults_injected"] >= 1
    # a rollout-pool rank is replaced in place: no restart, nothing computed again
    assert chaos["replacements"] == chaos["faults_injected"] and chaos["restarts"] == 0 == chaos["steps_lost"]
    assert chaos["seconds_lost"] > 0 and chaos["wall_s"] > calm["wall_s"]
    assert chaos["prompts"] == calm["prompts"] == 10 * 4 and chaos["prompts_twice"] == 0
    assert chaos["same_prompts"] is True and chaos["same_metrics"] is True
    assert json.loads((tmp_path / "outputs" / "chaos.json").read_text())["rows"][1]["replacements"] >= 1
