"""Three environments from one parquet (``recipes/rlm_mixed.yaml``, ``recipes/tasks/mixed.py``): each row's
``env_name`` picks the RLM REPL, the math tool or the word-count example (``env.loop: mixed``); the ``env.envs``
sections are read into each loop's own dataclass and checked before Ray starts, an unknown ``env_name`` in the
data is refused before Ray starts naming file and row, and ``python -m recipes.rlm --config`` trains on the mix
(a brief run on the nano model) with metrics per environment."""

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipes import rlm
from recipes.config import load_config
from recipes.tasks.mixed import ENV_NAMES, write_dataset
from workers.agents.examples.word_count import WordCountEnvConfig
from workers.agents.mixed import MixedEnvConfig
from workers.math_env.env_loop import MathToolEnvConfig
from workers.reward import score_batch
from workers.rlm.env_loop import RLMEnvConfig

YAML = Path(__file__).resolve().parents[2] / "recipes" / "rlm_mixed.yaml"

# one GRPO step after a two-step warm start: the first three rows (one per environment, unshuffled) x two
# samples, short turns, console logging only
BRIEF = [
    "model.tiny_size=nano",
    "data.shuffle=false",
    "data.train_batch_size=3",
    "data.val_batch_size=3",
    "data.max_response_length=128",
    "actor.ppo_mini_batch_size=3",
    "rollout.n=2",
    "sft.total_steps=2",
    "sft.batch_size=4",
    "sft.log_every=1",
    "env.envs.rlm.agent.max_iterations=2",
    "env.envs.rlm.agent.max_new_tokens=24",
    "env.envs.tool_math.agent.max_new_tokens=16",
    "env.envs.word_count.agent.max_new_tokens=16",
    "trainer.total_training_steps=1",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
    "trainer.plot=false",
]


@pytest.fixture
def data(tmp_path) -> tuple[dict, list[str]]:
    """The mixed data (two training rows and one held-out row per environment) where the test puts it: its paths
    and the overrides that point the YAML at it."""
    paths = write_dataset(tmp_path / "data", n_train=2, n_val=1, lengths="2000")
    return paths, [f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]"]


def _refused(monkeypatch, capsys, *overrides: str) -> str:
    """``python -m recipes.rlm --config rlm_mixed.yaml <overrides>`` exits with status 2 before the run starts
    (``start_run`` starts Ray); its message."""

    def no_run(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(rlm, "start_run", no_run)
    with pytest.raises(SystemExit) as exc:
        rlm.main(["--config", str(YAML), *overrides])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_the_data_interleaves_three_environments_in_one_parquet(data):
    paths, _ = data
    rows = pq.read_table(paths["train"]).to_pylist()
    assert [r["env_name"] for r in rows] == list(ENV_NAMES) * 2
    assert [r["data_source"] for r in rows[:3]] == ["hyflow/sniah", "hyflow/arithmetic", "word_count"]
    for r in rows:  # verl's columns, and each task's reference turns for the warm start
        assert r["prompt"][0]["role"] == "user" and r["reward_model"]["ground_truth"]
        assert (
            r["extra_info"]["question"] == r["prompt"][-1]["content"] and r["extra_info"]["reference_turns"]
        )
    assert len(rows[0]["extra_info"]["context"]) >= 1900  # the RLM row's context travels in extra_info


def test_env_envs_are_read_into_each_loops_dataclass(data):
    _, files = data
    cfg = load_config("rlm", files, config_path=YAML)
    env = cfg.env
    assert type(env) is MixedEnvConfig and env.default == "" and env.env_names() == ENV_NAMES
    assert [type(e) for e in env.envs.values()] == [RLMEnvConfig, MathToolEnvConfig, WordCountEnvConfig]
    assert env.envs["rlm"].agent.prompt.style == "compact" and env.envs["tool_math"].agent.max_turns == 3
    assert env.envs["tool_math"].sandbox.echo_last_expr and env.envs["word_count"].agent.max_new_tokens == 24
    # overrides reach an entry; another loop for an entry drops the file's keys of that entry
    cfg = load_config("rlm", [*files, "env.envs.word_count.loop=math_tool", "env.envs.rlm.agent.max_depth=1"],
                      config_path=YAML)  # fmt: skip
    assert type(cfg.env.envs["word_count"]) is MathToolEnvConfig and cfg.env.envs["rlm"].agent.max_depth == 1


def test_a_wrong_env_entry_is_refused_before_ray_naming_its_key(monkeypatch, capsys, data):
    _, files = data
    err = _refused(monkeypatch, capsys, *files, "env.envs.tool_math.agent.max_turn=2")
    assert "unknown config key 'env.envs.tool_math.agent.max_turn'" in err and "(ToolAgentConfig)" in err
    assert "did you mean ['max_turns']" in err
    err = _refused(monkeypatch, capsys, *files, "env.envs.word_count.agent.max_turns=many")
    assert "config key 'env.envs.word_count.agent.max_turns'" in err and "many" in err
    err = _refused(monkeypatch, capsys, *files, "env.envs.chess.agent.depth=3")
    assert "config key 'env.envs.chess.loop' is missing" in err
    err = _refused(monkeypatch, capsys, *files, "env.envs.chess.loop=chess_env")
    assert "config key 'env.envs.chess.loop'" in err and "unknown agent loop 'chess_env'" in err
    err = _refused(monkeypatch, capsys, *files, "env.envs.rlm.step_wise=true")
    assert "env.envs.rlm.step_wise=True: the rows of a mixed batch take env.step_wise" in err
    err = _refused(monkeypatch, capsys, *files, "env.default=chess")
    assert "env.default='chess' is not one of the envs ['rlm', 'tool_math', 'word_count']" in err


def test_unknown_env_name_in_the_data_is_refused_before_ray_naming_file_and_row(monkeypatch, capsys, data):
    paths, files = data
    table = pq.read_table(paths["train"])
    names = table.column("env_name").to_pylist()
    names[4] = "chess"
    pq.write_table(
        table.set_column(table.column_names.index("env_name"), "env_name", pa.array(names)), paths["train"]
    )
    err = _refused(monkeypatch, capsys, *files)
    assert (
        f"row 4 of {paths['train']}: env_name 'chess' is not one of the config's environments "
        "['rlm', 'tool_math', 'word_count'] (1 such row(s) in all" in err
    )
    # one environment (env.loop=rlm) takes rows named "" or "rlm" only: the mixed data's others are refused
    err = _refused(monkeypatch, capsys, *files, "env.loop=rlm")
    assert (
        f"row 1 of {paths['train']}: env_name 'tool_math' is not one of the config's environments ['rlm']"
        in err
    )


@pytest.mark.e2e
def test_three_environments_train_from_one_parquet(ray_session, tmp_path, data, capsys):
    paths, files = data
    run_dir = tmp_path / "run"
    result = rlm.main(["--config", str(YAML), *BRIEF, *files, f"trainer.default_local_dir={run_dir}"])
    # the warm start replayed every training row through its own environment (all six kept)
    assert "[sft] 6 reference trajectories replayed in the sandbox" in capsys.readouterr().out
    assert result["step"] == 1 and [s for s, _ in result["val_history"]] == [0, 1]

    final = result["final"]  # the training step's metrics: each environment's own, on its own rows
    for name in ENV_NAMES:
        assert final[f"env/{name}/rows"] == 2.0 and final[f"env/{name}/num_trajectories"] == 2.0, name
    for key in ("env/rlm/env/finished_frac", "env/rlm/env/turns/mean", "env/tool_math/tool/calls/mean",
                "env/tool_math/tool/finished_frac", "env/word_count/wc/calls/mean", "env/word_count/wc/finished_frac",
                "critic/score/mean", "actor/pg_loss"):  # fmt: skip
        assert key in final and math.isfinite(final[key]), key
    assert final["env/rlm/env/num_roots"] == 2.0 and final["env/tool_math/tool/status/finished"] <= 2.0

    for _, val in result["val_history"]:  # validation per environment: one held-out row each, greedy
        assert val["val/num_samples"] == 3
        for name, source in zip(ENV_NAMES, ("hyflow/sniah", "hyflow/arithmetic", "word_count")):
            assert val[f"val-env/{name}/rows"] == 1.0
            assert val[f"val-env/{name}/accuracy"] == val[f"val-core/{source}/acc"]
        assert "val-env/rlm/env/turns/mean" in val and "val-env/word_count/wc/calls/mean" in val
        assert "val-env/tool_math/tool/calls/mean" in val
        mean = sum(val[f"val-env/{n}/accuracy"] for n in ENV_NAMES) / 3
        assert val["val/accuracy"] == pytest.approx(mean)

    batch = result["last_batch"]  # the first three rows, one per environment, two samples each, in order
    nt = batch.non_tensor_batch
    assert list(nt["env_name"]) == ["rlm", "rlm", "tool_math", "tool_math", "word_count", "word_count"]
    trajs = [json.loads(t) for t in nt["trajectory"]]
    assert all(t["metadata"]["env_name"] == n for t, n in zip(trajs, nt["env_name"]))
    assert isinstance(trajs[4]["metadata"]["count_calls"], int)  # set by WordCountLoop.run
    assert all(s == "" for s in nt["steps"][[0, 1, 4, 5]])  # the math tool's column, "" on the others' rows
    # every row scored by its own data source's scorer (word_count: reward.default_scorer exact_match)
    want = score_batch(
        ["" if a is None else str(a) for a in nt["answer"]],
        list(nt["data_source"]),
        [rm["ground_truth"] for rm in nt["reward_model"]],
        list(nt["extra_info"]),
        "exact_match",
    ).scores
    assert batch.batch["token_level_scores"].sum(-1).tolist() == want
    # the run's saved config reads back into the same environments
    saved = load_config("rlm", config_path=run_dir / "config.yaml").env
    assert type(saved) is MixedEnvConfig and type(saved.envs["word_count"]) is WordCountEnvConfig
