"""Resuming: a GRPO (and a PPO) run interrupted between steps and restarted with trainer.resume_mode=auto reaches the same
metrics as an uninterrupted run (same data, same seeded samples, same updates); a Ctrl-C during a checkpoint
save leaves no half-written checkpoint behind the ``latest_step`` marker; a damaged latest checkpoint is named
(and passed over for an intact one only when asked); a full disk during a save is one error that leaves
nothing behind, with the run's config untouched."""

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
from recipe_testlib import kill_during_generation
from torch.distributed.checkpoint import FileSystemReader

from recipes import grpo, ppo
from recipes.config import load_config
from recipes.trainer import checkpoint as ckpt
from recipes.trainer.run import start_run, write_run_config
from recipes.trainer.tracking import Tracker
from workers.engine.checkpoint import CheckpointError, verify_checkpoint

pytestmark = pytest.mark.e2e

SETTINGS = [
    "model.tiny_size=nano",
    "task.name=arithmetic",
    "task.n_train=64",
    "task.n_val=8",
    "data.val_max_samples=8",
    "data.train_batch_size=4",
    "data.max_prompt_length=32",
    "data.max_response_length=16",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",  # two optimizer steps per RL step: Adam state matters on resume
    "actor.optim.lr=1e-2",
    "trainer.total_training_steps=4",
    "trainer.test_freq=-1",
    "trainer.save_freq=2",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
]
RECIPES = {
    "grpo": (grpo, ["actor.use_kl_loss=true"]),
    "ppo": (ppo, ["critic.ppo_mini_batch_size=2", "critic.optim.lr=1e-2", "algorithm.use_kl_in_reward=true"]),
}
COMPARED = [
    "critic/score/mean",
    "critic/advantages/max",
    "response_length/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/ppo_kl",
]
COMPARED_BY_RECIPE = {
    "grpo": ["actor/kl_loss"],
    "ppo": ["critic/vf_loss", "critic/values/mean", "critic/returns/mean", "actor/reward_kl_penalty"],
}


DIGIT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


def _cfg(recipe, run_dir, *extra):
    # a dense custom reward (share of digits) so that scores and advantages differ from step to step
    reward = run_dir.parent / "digits.py"
    reward.write_text(DIGIT_REWARD)
    overrides = [*SETTINGS, *RECIPES[recipe][1], f"custom_reward_function.path={reward}"]
    return load_config(recipe, [*overrides, f"trainer.default_local_dir={run_dir}", *extra])


_FULL: dict[str, dict[int, dict]] = {}


def _full_run(recipe, tmp_path_factory) -> dict[int, dict]:
    """The reference: the recipe's 4 uninterrupted steps (run once per test session), by step."""
    if recipe not in _FULL:
        cfg = _cfg(recipe, tmp_path_factory.mktemp(f"full_{recipe}") / "run", "trainer.resume_mode=disable")
        result = RECIPES[recipe][0].train(cfg, start_run(cfg, recipe, start_ray=False))
        _FULL[recipe] = {r["step"]: r for r in result["history"]}
    return _FULL[recipe]


def _assert_same_metrics(recipe, got: dict[int, dict], full: dict[int, dict]) -> None:
    for step in (1, 2, 3, 4):
        for key in COMPARED + COMPARED_BY_RECIPE[recipe]:
            assert got[step][key] == pytest.approx(full[step][key], rel=1e-4, abs=1e-6), (step, key)
    # the comparison is between distinct, non-trivial steps (rewards earned, policy moving)
    assert len({round(full[s]["critic/score/mean"], 6) for s in (1, 2, 3, 4)}) == 4
    assert all(full[s]["critic/advantages/max"] > 0 for s in (1, 2, 3, 4))


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_interrupted_run_resumes_to_the_same_metrics(
    ray_session, tmp_path, tmp_path_factory, monkeypatch, capsys, recipe
):
    module = RECIPES[recipe][0]
    full = _full_run(recipe, tmp_path_factory)

    # the same run, killed (Ctrl-C) right after step 2 was checkpointed and logged
    original_log = Tracker.log

    def log_then_interrupt(self, metrics, step):
        original_log(self, metrics, step)
        if step == 2:
            raise KeyboardInterrupt

    run_dir = tmp_path / "interrupted"
    cfg = _cfg(recipe, run_dir, "trainer.resume_mode=auto")
    monkeypatch.setattr(Tracker, "log", log_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        module.train(cfg, start_run(cfg, recipe, start_ray=False))
    monkeypatch.setattr(Tracker, "log", original_log)
    assert ckpt.latest_step(run_dir / "checkpoints") == 2

    # restarted with resume_mode=auto: continues at step 3 from the checkpoint (model, optimizer, data position)
    capsys.readouterr()
    result = module.train(cfg, start_run(cfg, recipe, start_ray=False))
    actor_ckpt = run_dir / "checkpoints" / "actor" / "step_2"
    assert f"[{recipe}] resumed at step 2 from {actor_ckpt}" in capsys.readouterr().out
    resumed = {r["step"]: r for r in result["history"]}
    assert result["step"] == 4 and sorted(resumed) == [0, 1, 2, 3, 4]  # steps 0-2 kept from the first attempt
    assert (run_dir / "config.prev.yaml").is_file()
    _assert_same_metrics(recipe, resumed, full)
    assert ckpt.latest_step(run_dir / "checkpoints") == 4


def test_a_trainer_rank_killed_mid_step_is_recovered_to_the_metrics_of_a_hand_resume(
    ray_session, tmp_path, monkeypatch, capsys
):
    """Issue 31: rank 1 of two trainer ranks (colocated: trainer + rollout in one process) is SIGKILLed during
    step 3; the run rebuilds its workers, goes on from the checkpoint of step 2 and ends with the metrics of
    the uninterrupted run (the same as a hand resume, test above), with the fault counted and said once."""
    two_ranks = ["trainer.n_gpus_per_node=2"]
    ref = _cfg("grpo", tmp_path / "full", "trainer.resume_mode=disable", *two_ranks)
    full = {r["step"]: r for r in grpo.train(ref, start_run(ref, "grpo", start_ray=False))["history"]}
    killed = kill_during_generation(monkeypatch, step=3, rank=1, group="actor")
    run_dir = tmp_path / "run"
    cfg = _cfg("grpo", run_dir, "trainer.resume_mode=disable", *two_ranks)
    result = grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))
    out = capsys.readouterr().out
    assert len(killed) == 1 and result["step"] == 4
    got = {r["step"]: r for r in result["history"]}
    assert sorted(got) == [0, 1, 2, 3, 4]  # the failed step 3 is logged once, from its second run
    _assert_same_metrics("grpo", got, full)
    assert "fault/restarts" not in got[2] and got[3]["fault/restarts"] == got[4]["fault/restarts"] == 1
    assert got[3]["fault/steps_lost"] == 1 and got[3]["fault/seconds_lost"] > 0
    # whichever of the process's roles (actor, ref, rollout, reward) is called first after the kill names it: a
    # kill that lands after the rank's generation returned is first seen by the reward call (a fresh-check saw it)
    assert (
        len(re.findall(r"FAULT at step 3: worker group '(?:actor|ref|rollout|reward)' rank 1 failed in", out))
        == 1
    ), out
    # and the line names the process that was lost, with every role it held, not only the one that saw it
    named = re.search(
        r"FAULT at step 3: .*; its process \(pid \d+, pool '\w+'\) held the roles ([^\n]+)", out
    )
    assert named and all(f"'{role}'" in named[1] for role in ("actor", "ref", "rollout", "reward")), out
    assert (
        "fault 1 of 2, a restart: every worker group is rebuilt and training goes on from the checkpoint of step 2"
        in out
    )
    assert "recovered in" in out and "at step 2: step 3 computed again" in out
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3, 4]


def test_a_restart_before_the_first_checkpoint_trains_the_run_again_from_its_first_batch(
    ray_session, tmp_path, tmp_path_factory, monkeypatch, capsys
):
    """A worker killed before any checkpoint exists: the run is rebuilt and trained again from the start -- the
    first batch, a fresh model and optimizer -- so every step's metrics equal the undisturbed run's. (The only
    test of this path ended in RestartsExhausted and compared no metrics: a restart that rewound the model but
    not the data loader, or the other way round, would have passed it.)"""
    full = _full_run("grpo", tmp_path_factory)
    killed = kill_during_generation(monkeypatch, step=3, rank=0, group="actor")
    cfg = _cfg("grpo", tmp_path / "run", "trainer.resume_mode=disable", "trainer.save_freq=-1")
    result = grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))
    out = capsys.readouterr().out
    assert len(killed) == 1 and "FAULT at step 3: " in out
    assert "training goes on from the start (no checkpoint yet)" in out, out
    got = {r["step"]: r for r in result["history"]}
    assert sorted(got) == [0, 1, 2, 3, 4] and got[4]["fault/restarts"] == 1
    assert got[3]["fault/steps_lost"] == 3  # steps 1 and 2 computed again, and the failed step 3
    _assert_same_metrics("grpo", got, full)


def test_without_restarts_a_killed_worker_ends_the_run_naming_it(ray_session, tmp_path, monkeypatch):
    """``trainer.max_restarts=0``: the first fault ends the run with the error naming role, rank and method."""
    from controller import WorkerGroupError

    kill_during_generation(monkeypatch, step=1, rank=0, group="actor")
    cfg = _cfg("grpo", tmp_path / "run", "trainer.resume_mode=disable", "trainer.max_restarts=0")
    with pytest.raises(WorkerGroupError, match="worker group '(actor|ref|rollout)' rank 0 failed in") as err:
        grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))
    assert err.value.kind == "died" and err.value.is_fault
    assert re.search(r"; its process \(pid \d+, pool '\w+'\) held the roles '", err.value.summary())


class _SlowSaver:
    """A worker-group stand-in whose save is interrupted by a SIGINT halfway through writing."""

    def __init__(self):
        self.saved = []

    def save_checkpoint(self, root, step, extra):
        path = Path(root) / f"step_{step}"
        path.mkdir(parents=True)
        (path / "part1").write_text("x")
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the save
        (path / "part2").write_text("y")
        self.saved.append(step)
        return str(path)


def test_a_resumed_run_reuses_its_warm_start_instead_of_training_it_again(ray_session, tmp_path, capsys):
    """``python -m recipes.grpo`` on the tiny model warm-starts it (sft); run again with more steps and
    ``trainer.resume_mode=auto``, it resumes from its checkpoint on the exported warm start as it is."""
    run_dir = tmp_path / "run"
    args = [
        *SETTINGS,
        "sft.total_steps=2",
        "sft.batch_size=4",
        "sft.log_every=1",
        f"trainer.default_local_dir={run_dir}",
    ]
    first = grpo.main([*args, "trainer.total_training_steps=2"])
    assert "[sft] step 2/2" in capsys.readouterr().out and first["step"] == 2
    weights = run_dir / "sft_model" / "model.safetensors"
    written = weights.stat().st_mtime_ns
    resumed = grpo.main([*args, "trainer.total_training_steps=4", "trainer.resume_mode=auto"])
    out = capsys.readouterr().out
    assert "[sft] step" not in out and f"its warm start {run_dir / 'sft_model'} is reused" in out
    assert weights.stat().st_mtime_ns == written
    assert resumed["step"] == 4 and "[grpo] step 3/4" in out and "[grpo] step 2/4" not in out  # resumed at 2


def test_ctrl_c_during_a_save_completes_it_first(tmp_path):
    group = _SlowSaver()
    before = signal.getsignal(signal.SIGINT)  # a background or xdist process may start with SIGINT ignored
    with pytest.raises(KeyboardInterrupt, match="the save completed"):
        ckpt.save(tmp_path, 3, {"actor": group}, extra={"step": 3})
    assert group.saved == [3]
    assert (tmp_path / "actor" / "step_3" / "part2").is_file()  # the save ran to the end
    assert ckpt.latest_step(tmp_path) == 3  # and the marker names it only after it completed
    assert signal.getsignal(signal.SIGINT) is before  # the save's own handler is gone again


def test_a_save_cut_short_by_a_fault_is_removed_and_complete_ones_kept(tmp_path):
    """Before a restart (``Session.recover``): a ``step_N.tmp`` a dying worker left is deleted, ``step_N`` kept."""
    for role in ("actor", "critic"):
        (tmp_path / role / "step_2").mkdir(parents=True)
        (tmp_path / role / "step_2" / "engine_state.pt").write_text("x")
    (tmp_path / "actor" / "step_4.tmp").mkdir()
    (tmp_path / "actor" / "step_4.tmp" / "part").write_text("half")
    ckpt.write_atomic(tmp_path / ckpt.LATEST, b"2\n")
    assert ckpt.remove_partial(tmp_path) == [str(tmp_path / "actor" / "step_4.tmp")]
    assert sorted(p.name for p in (tmp_path / "actor").iterdir()) == ["step_2"]
    assert (tmp_path / "critic" / "step_2" / "engine_state.pt").is_file() and ckpt.latest_step(tmp_path) == 2
    assert ckpt.remove_partial(tmp_path / "missing") == []


def test_resume_paths(tmp_path):
    for role in ("actor", "critic"):
        (tmp_path / "ckpt" / role / "step_4").mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_step").write_text("4\n")
    auto = ckpt.resolve_resume("auto", tmp_path / "ckpt", ["actor", "critic"])
    assert auto == {r: str(tmp_path / "ckpt" / r / "step_4") for r in ("actor", "critic")}
    explicit = ckpt.resolve_resume(str(tmp_path / "ckpt" / "actor" / "step_4"), tmp_path / "other", ["actor"])
    assert explicit == {"actor": str(tmp_path / "ckpt" / "actor" / "step_4")}
    assert ckpt.resolve_resume("disable", tmp_path / "ckpt", ["actor"]) is None
    assert ckpt.resolve_resume("auto", tmp_path / "empty", ["actor"]) is None
    (tmp_path / "ckpt" / "latest_step").write_text("6\n")
    with pytest.raises(FileNotFoundError, match="resuming step 6: the actor checkpoint"):
        ckpt.resolve_resume("auto", tmp_path / "ckpt", ["actor"])


class _Recorder:
    def __init__(self):
        self.lines = []

    def write(self, line):
        self.lines.append(line)


def test_skipped_updates_are_surfaced_with_a_counter():
    from recipes.trainer.steps import TrainerState

    state, tracker = TrainerState(step=1), _Recorder()
    metrics = {"actor/skipped_steps": 0.0, "actor/pg_loss": 0.1}
    state.check_skipped(metrics, tracker)
    assert not tracker.lines and metrics["training/actor_skipped_updates"] == 0
    state.step = 2  # the engine dropped this step's update (non-finite gradient norm): its counter went up
    metrics = {"actor/skipped_steps": 1.0, "actor/pg_loss": float("nan")}
    state.check_skipped(metrics, tracker)
    assert metrics["training/actor_skipped_updates"] == 1
    assert "step 2: actor update skipped" in tracker.lines[0] and "1 skipped so far" in tracker.lines[0]
    assert "non-finite metrics ['actor/pg_loss']" in tracker.lines[1]
    assert state.skipped == {"actor": 1.0}  # kept in the checkpoint's trainer state


def test_old_checkpoints_pruned_beyond_max_to_keep(tmp_path):
    class Saver:
        def save_checkpoint(self, root, step, extra):
            (Path(root) / f"step_{step}").mkdir(parents=True)

    groups = {"actor": Saver(), "critic": Saver()}
    for step in (2, 4, 6):
        ckpt.save(tmp_path, step, groups, extra={}, keep=2)
    for role in groups:
        assert ckpt.step_dirs(tmp_path / role) == [4, 6]
    assert ckpt.latest_step(tmp_path) == 6


def test_garbage_in_latest_step_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "latest_step").write_text("step_4\x00\n")
    with pytest.raises(
        CheckpointError, match=rf"{tmp_path}/latest_step should hold the number .* 'step_4\\x00'"
    ):
        ckpt.resolve_resume("auto", tmp_path, ["actor"])


def test_run_config_on_a_full_disk_is_left_as_it_was(small_disk):
    run_dir = small_disk("64k")
    cfg = load_config("grpo", ["trainer.resume_mode=auto"])
    write_run_config(cfg, run_dir)
    before = (run_dir / "config.yaml").read_bytes()
    (run_dir / "filler").write_bytes(bytes(shutil.disk_usage(run_dir).free))  # the disk is full
    with pytest.raises(OSError, match=rf"cannot write the run's config .*No space left on device.*{run_dir}"):
        write_run_config(cfg, run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "filler"]
    assert (run_dir / "config.yaml").read_bytes() == before
    (run_dir / "filler").unlink()
    write_run_config(cfg, run_dir)  # with room again, the resumed run keeps the previous config
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.prev.yaml", "config.yaml"]


def _damage(path: Path) -> None:
    """Overwrite 4 KiB inside the largest tensor of DCP shard ``path`` without changing its size (bit rot, a
    bad copy): without content hashes this loads silently and trains on NaN."""
    size = path.stat().st_size
    item = max(
        FileSystemReader(str(path.parent)).read_metadata().storage_data.values(), key=lambda i: i.length
    )
    with open(path, "r+b") as f:
        f.seek(item.offset + item.length // 2 - 2048)
        f.write(b"\xff" * 4096)
    assert path.stat().st_size == size


def test_damaged_latest_checkpoint_is_named_and_resumed_past_only_when_asked(ray_session, tmp_path, capsys):
    """``resume_mode=auto`` on a checkpoint altered after it was saved: an error naming the file, the step and
    the newest intact earlier checkpoint; with trainer.resume_fallback=true the run resumes from that one and
    repeats the uninterrupted run's steps."""
    run_dir = tmp_path / "run"
    short = ["trainer.total_training_steps=2", "trainer.save_freq=1"]
    cfg = _cfg("grpo", run_dir, "trainer.resume_mode=auto", *short)
    full = {r["step"]: r for r in grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))["history"]}
    shard = run_dir / "checkpoints" / "actor" / "step_2" / "model_optim" / "__0_0.distcp"
    _damage(shard)

    with pytest.raises(CheckpointError) as err:
        grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))
    msg = str(err.value)
    assert msg.startswith(
        f"actor rank 0: checkpoint step_2 (step 2) is damaged: {shard} changed after it was saved"
    )
    intact = run_dir / "checkpoints" / "actor" / "step_1"
    assert f"the newest intact earlier checkpoint is {intact}: set trainer.resume_fallback=true" in msg

    capsys.readouterr()
    cfg = _cfg("grpo", run_dir, "trainer.resume_mode=auto", "trainer.resume_fallback=true", *short)
    result = grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))
    assert f"[grpo] resumed at step 1 from {intact}" in capsys.readouterr().out
    resumed = {r["step"]: r for r in result["history"]}
    for step in (1, 2):
        for key in COMPARED + COMPARED_BY_RECIPE["grpo"]:
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-4, abs=1e-6), (step, key)
    verify_checkpoint(shard.parent.parent)  # step 2 saved again, intact


def test_full_disk_during_a_run_save_is_one_error_and_leaves_nothing_behind(
    ray_session, small_disk, tmp_path
):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    disk = small_disk("1m")  # the checkpoints on a disk too small for one (the nano model's needs ~2.4 MiB)
    (run_dir / "checkpoints").rmdir()
    (run_dir / "checkpoints").symlink_to(disk)
    cfg = _cfg(
        "grpo", run_dir, "trainer.resume_mode=auto", "trainer.total_training_steps=1", "trainer.save_freq=1"
    )
    with pytest.raises(CheckpointError) as err:
        grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))
    msg = str(err.value)
    assert (
        f"actor rank 0: no space left on device for checkpoint {run_dir}/checkpoints/actor/step_1.tmp: it needs "
        in msg
    )
    assert "\n" not in msg and "Traceback" not in msg
    assert [p.name for p in disk.iterdir()] == ["actor"] and not any((disk / "actor").iterdir())
