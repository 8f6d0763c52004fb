"""Issue 14: bad values fail in the config pass, capacity is checked honestly, reward and call faults are loud."""

import subprocess
import sys
from pathlib import Path

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
def test_bad_values_fail_in_the_config_pass_naming_the_key(capsys, monkeypatch, recipe, override, message):
    import ray

    # The suite's shared Ray session may already be up: what matters is that the config pass never starts one.
    def no_ray(*args, **kwargs):
        raise AssertionError("the config pass called ray.init")

    monkeypatch.setattr(ray, "init", no_ray)
    extra = ["data.val_files=[/nonexistent/val.parquet]"] if override.startswith("data.train_files") else []
    with pytest.raises(SystemExit) as exc:
        parse_args(recipe, [override, *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    if extra:
        assert "data.val_files: no such file(s) ['/nonexistent/val.parquet']" in err


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
    from recipes.trainer.run import start_run

    cfg = _cfg(tmp_path, *overrides, reward=reward)
    return grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))


def _cfg(tmp_path, *overrides, reward: str | None = None):
    from recipes.config import load_config

    extra = []
    if reward is not None:
        (tmp_path / "reward.py").write_text(reward)
        extra = [f"custom_reward_function.path={tmp_path / 'reward.py'}"]
    return load_config("grpo", [*TINY, *extra, *overrides, f"trainer.default_local_dir={tmp_path / 'run'}"])


def test_nnodes_beyond_the_alive_nodes_fails_before_any_actor(ray_session, tmp_path):
    from ray.util import placement_group_table

    from resource_pools import InsufficientResourcesError

    before = len(placement_group_table())
    with pytest.raises(
        InsufficientResourcesError, match=r"trainer.nnodes=2 asks for 2 nodes, but the Ray cluster has 1"
    ):
        _grpo(tmp_path, "trainer.nnodes=2")
    assert len(placement_group_table()) == before  # refused before any placement group (or actor) was made


# -- data sources no scorer covers: refused (or skipped) at load time, naming file and file row -------------------


def _with_unknown_source(tmp_path, row: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recipes.tasks import make_dataset

    paths = make_dataset("arithmetic", tmp_path / "data", n_train=32, n_val=4, seed=0)
    table = pq.read_table(paths["train"])
    sources = table.column("data_source").to_pylist()
    sources[row] = "nobody/scores/this"
    table = table.set_column(table.column_names.index("data_source"), "data_source", pa.array(sources))
    pq.write_table(table, paths["train"])
    return paths


def test_unknown_data_source_is_refused_at_load_time_naming_file_and_row(ray_session, tmp_path):
    from recipes.config import ConfigError

    paths = _with_unknown_source(tmp_path, row=11)
    files = [f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]"]
    with pytest.raises(ConfigError) as err:
        _grpo(tmp_path, *files)
    assert f"row 11 of {paths['train']}: data_source 'nobody/scores/this' has no reward scorer" in str(
        err.value
    )
    assert "data.unknown_data_source=skip" in str(err.value)


def test_unknown_data_source_rows_skipped_with_a_count(tmp_path, caplog):
    from recipes.config import load_config
    from recipes.trainer.data import train_loader
    from recipes.trainer.run import start_run

    paths = _with_unknown_source(tmp_path, row=11)
    files = [f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]"]
    cfg = load_config(
        "grpo", [*TINY, *files, "data.unknown_data_source=skip", f"trainer.default_local_dir={tmp_path}"]
    )
    with caplog.at_level("WARNING", logger="recipes.data"):
        loader = train_loader(cfg, start_run(cfg, "grpo", start_ray=False))
    assert loader.dataset.num_unknown_data_source == 1 and len(loader.dataset) == 31
    assert (
        f"skipped 1 rows whose data_source has no reward scorer (first: row 11 of {paths['train']}"
        in caplog.text
    )


# -- faults in the reward path: seen on the console, counted, and fatal when every sample fails -------------------

FLAKY_REWARD = """
CALLS = [0]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # step 1 (calls 1-8): 2 rows raise, 2 score NaN, 4 score 1; from step 2 on every row raises
    CALLS[0] += 1
    if CALLS[0] > 8:
        raise ValueError(f"scorer broke on call {CALLS[0]}")
    if CALLS[0] % 4 == 1:
        raise ValueError("bad row")
    return float("nan") if CALLS[0] % 4 == 2 else 1.0
"""


def test_reward_errors_warned_each_step_and_a_run_where_every_sample_fails_aborts(
    ray_session, tmp_path, capsys
):
    import json

    from recipes.trainer.data import prompt_batches, train_loader
    from recipes.trainer.run import RunAborted, start_run

    with pytest.raises(RunAborted) as err:
        _grpo(tmp_path, reward=FLAKY_REWARD)
    # read before the same config is started again below (which starts the run over in its folder)
    step1 = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # errors name the prompt's row in its parquet file: the first sample of each step is its first prompt's
    cfg = _cfg(tmp_path, reward=FLAKY_REWARD)
    batches = prompt_batches(train_loader(cfg, start_run(cfg, "grpo", start_ray=False)))
    first_rows = [next(batches).non_tensor_batch["data_row"][0] for _ in range(2)]
    train_file = tmp_path / "run" / "data" / "train.parquet"
    assert all(r.startswith("row ") and r.endswith(f" of {train_file}") for r in first_rows)
    assert str(err.value) == (
        f"step 2: 8 of 8 samples failed to score (reward 0); first: {first_rows[1]} (hyflow/arithmetic): "
        "ValueError: scorer broke on call 9 -- aborting (reward.max_error_frac=1)"
    )
    out = capsys.readouterr().out
    # step 1: the raising rows and the NaN rows are errors (reward 0), seen on the console with the first one
    assert (
        f"WARNING step 1: 4 of 8 samples failed to score (reward 0); first: {first_rows[0]} (hyflow/arithmetic): "
        "ValueError: bad row"
    ) in out
    assert step1["step"] == 1 and step1["reward/errors"] == 4 and step1["critic/score/mean"] == 0.5


HANGING_REWARD = """
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(600)
"""


def test_a_hanging_reward_call_times_out_naming_role_rank_method_and_time(ray_session, tmp_path):
    from controller import WorkerGroupTimeoutError

    with pytest.raises(WorkerGroupTimeoutError) as err:
        _grpo(
            tmp_path,
            # long enough for every other call of a loaded CI machine (model loads included), no longer: the
            # hang itself proves the timeout
            "trainer.call_timeout_s=6",
            "trainer.call_timeout_per_row_s=0.25",
            "trainer.max_restarts=0",  # restarts on: test_fault_tolerance.py
            reward=HANGING_REWARD,
        )
    e = err.value
    assert (e.role, e.rank, e.method, e.timeout_s) == (
        "reward",
        0,
        "compute_rm_score",
        8.0,
    )  # 6 s + 8 rows x 0.25 s
    assert e.elapsed_s >= 8.0
    assert (
        "worker group 'reward' rank 0 failed in 'compute_rm_score': no result after 8s from rank(s) [0]"
        in str(e)
    )
    assert "after the call started" in str(e)


def test_default_call_timeout_is_finite():
    from recipes.config import load_config

    t = load_config("grpo").trainer
    assert t.call_timeout_s == 1800 and t.call_timeout_per_row_s == 1.0


# -- non-finite updates: skipped and counted, and a run whose updates are all skipped aborts ----------------------

HUGE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 3e38 if len(solution_str) % 2 else -3e38  # finite, but its policy gradient overflows
"""


def test_consecutive_skipped_updates_abort_naming_step_and_metric(ray_session, tmp_path, capsys):
    from recipes.trainer.run import RunAborted

    with pytest.raises(RunAborted) as err:
        _grpo(
            tmp_path,
            "rollout.n=4",
            "algorithm.norm_adv_by_std_in_grpo=false",
            "trainer.max_consecutive_skipped_updates=2",
            reward=HUGE_REWARD,
        )
    msg = str(err.value)
    assert msg.startswith(
        "step 2: the actor update was skipped in 2 steps in a row (trainer.max_consecutive_skipped_updates=2)"
    )
    assert "'actor/grad_norm'" in msg
    assert "WARNING step 1: actor update skipped" in capsys.readouterr().out


ZERO_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0  # what a randomly initialised model earns on every sample
"""


def test_a_run_without_learning_signal_says_so_once_with_cause_and_fix(ray_session, tmp_path, capsys):
    """Every group's samples scoring the same for 3 steps in a row (a random model, a constant reward) is said on
    the console once, with the likely cause and the fix, instead of training on zero advantages in silence."""
    result = _grpo(tmp_path, "trainer.total_training_steps=4", reward=ZERO_REWARD)
    out = capsys.readouterr().out
    assert out.count("the policy is not learning") == 1
    assert (
        "WARNING steps 1-3: every prompt group's samples got the same score (mean 0), so the reward tells no "
        "sample from another" in out
    )
    assert (
        "the model cannot earn the reward yet (entropy " in out
        and "keep the tiny model's warm start on (sft.enable" in out
    )
    assert [row["reward/zero_variance_groups"] for row in result["history"]] == [1.0, 1.0, 1.0, 1.0]


def test_a_command_line_run_that_aborts_exits_1_with_the_message(capsys):
    from recipes.config import ConfigError
    from recipes.trainer.run import RunAborted, cli

    for err, prefix in (
        (RunAborted("step 2: 8 of 8 samples failed"), "run aborted"),
        (ConfigError("x"), "config error"),
    ):

        def main(err=err):
            raise err

        with pytest.raises(SystemExit) as exc:
            cli(main)
        assert exc.value.code == f"{prefix}: {err}"  # sys.exit(message): status 1, the message on stderr
    # the real command line: a bad key is refused while parsing, before Ray starts: status 2 (a usage error, as
    # argparse's), the message on stderr
    done = subprocess.run(
        [sys.executable, "-m", "recipes.grpo", "no_such_section.key=1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("config error: "), done.stderr[-2000:]
    assert "no_such_section" in done.stderr
