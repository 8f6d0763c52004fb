"""Issue 14: bad values fail in the config pass, capacity is checked honestly, reward and call faults are loud."""

import pytest

from recipes.trainer.run import parse_args

# -- config pass: each bad value is refused before Ray starts, the error naming its key ---------------------------


@pytest.mark.parametrize(
    "recipe, override, message",
    [
        ("grpo", "actor.optim.lr=-1e-4", "actor.optim.lr must be a finite number >= 0, got -0.0001"),
        ("grpo", "actor.optim.lr=nan", "actor.optim.lr must be a finite number >= 0, got nan"),
        ("ppo", "critic.optim.lr=-1", "critic.optim.lr must be a finite number >= 0, got -1.0"),
        ("quickstart", "sft.optim.lr=nan", "sft.optim.lr must be a finite number >= 0, got nan"),
        ("grpo", "rollout.temperature=-0.5", "rollout.temperature must be a finite number >= 0, got -0.5"),
        ("grpo", "actor.clip_ratio=-0.2", "actor.clip_ratio must be a finite number >= 0, got -0.2"),
        ("grpo", "actor.clip_ratio_high=-0.1", "actor.clip_ratio_high must be a finite number >= 0"),
        ("ppo", "critic.cliprange_value=-0.5", "critic.cliprange_value must be a finite number >= 0"),
        ("grpo", "data.train_files=[/nonexistent/train.parquet]", "data.train_files: no such file(s)"),
        ("grpo", "model.path=/nonexistent/model", "model.path='/nonexistent/model' does not exist"),
        ("grpo", "reward.max_error_frac=0", "reward.max_error_frac must be in (0, 1]"),
    ],
)
def test_bad_values_fail_in_the_config_pass_naming_the_key(capsys, recipe, override, message):
    import ray

    extra = ["data.val_files=[/nonexistent/val.parquet]"] if override.startswith("data.train_files") else []
    with pytest.raises(SystemExit) as exc:
        parse_args(recipe, [override, *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    if extra:
        assert "data.val_files: no such file(s) ['/nonexistent/val.parquet']" in err
    assert not ray.is_initialized()


# -- capacity: more nodes or CPU devices than exist is an error before any actor starts ----------------------------


def _recipe_cli(*overrides, cwd=None):
    """``python -m recipes.grpo`` as a user runs it (starting its own Ray)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "recipes.grpo", *overrides],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


def test_recipe_refuses_more_nodes_or_cpu_devices_than_this_machine_has(tmp_path):
    import os

    run_dir, cores = tmp_path / "run", os.cpu_count()
    proc = _recipe_cli(
        "trainer.nnodes=2",
        f"trainer.n_gpus_per_node={cores}",
        f"data.train_batch_size={2 * cores}",
        f"actor.ppo_mini_batch_size={2 * cores}",
        f"trainer.default_local_dir={run_dir}",
    )
    assert proc.returncode == 1, proc.stderr
    assert "config error: this machine cannot hold the run:" in proc.stderr
    assert (
        "trainer.nnodes=2 asks for 2 nodes, but a Ray started by the recipe has 1 (this machine)"
        in proc.stderr
    )
    assert (
        f"trainer.n_gpus_per_node * trainer.nnodes = {cores} * 2 = {2 * cores} CPU devices asked (one worker "
        f"process each), but this machine has {cores} CPU cores; set trainer.cpu_oversubscribe=true"
    ) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()  # refused before anything was written or started


def test_cpu_oversubscription_is_an_announced_opt_in(caplog):
    from recipes.config import ConfigError, load_config
    from recipes.trainer.run import check_local_capacity

    cfg = load_config("grpo", ["trainer.n_gpus_per_node=4"])
    with pytest.raises(ConfigError, match="= 4 CPU devices asked .* but this machine has 2 CPU cores"):
        check_local_capacity(cfg, use_gpu=False, cores=2)
    check_local_capacity(cfg, use_gpu=True, cores=2)  # GPUs: Ray counts them itself
    cfg.trainer.cpu_oversubscribe = True
    with caplog.at_level("WARNING", logger="recipes"):
        check_local_capacity(cfg, use_gpu=False, cores=2)
    assert "= 4 CPU devices asked (one worker process each) on 2 CPU cores: oversubscribed" in caplog.text


# -- recipe runs on the shared test Ray session (nano model, 4 prompts x 2 samples per step) ----------------------

TINY = [
    "model.tiny_size=nano",
    "task.name=arithmetic",
    "task.n_train=32",
    "task.n_val=4",
    "data.val_max_samples=4",
    "data.train_batch_size=4",
    "data.max_prompt_length=32",
    "data.max_response_length=8",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "actor.use_kl_loss=false",
    "trainer.total_training_steps=3",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
    "trainer.progress_bar=false",
    "trainer.plot=false",
    "trainer.logger=[console]",
]


def _grpo(tmp_path, *overrides, reward: str | None = None):
    """Run recipes.grpo's train on the test Ray session; ``reward``: the source of a custom reward function."""
    from recipes import grpo
    from recipes.config import load_config
    from recipes.trainer.run import start_run

    extra = []
    if reward is not None:
        (tmp_path / "reward.py").write_text(reward)
        extra = [f"custom_reward_function.path={tmp_path / 'reward.py'}"]
    cfg = load_config("grpo", [*TINY, *extra, *overrides, f"trainer.default_local_dir={tmp_path / 'run'}"])
    return grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))


def test_nnodes_beyond_the_alive_nodes_fails_before_any_actor(ray_session, tmp_path):
    from ray.util import placement_group_table

    from resource_pools import InsufficientResourcesError

    before = len(placement_group_table())
    with pytest.raises(
        InsufficientResourcesError, match=r"trainer.nnodes=2 asks for 2 nodes, but the Ray cluster has 1"
    ):
        _grpo(tmp_path, "trainer.nnodes=2")
    assert len(placement_group_table()) == before  # refused before any placement group (or actor) was made
