"""A user's own files, given on the command line as the docs say: ``custom_reward_function.path=reward.py`` and
``env.loop=path/to/my_env.py:Class`` (a file outside the package, no ``PYTHONPATH``). The recipe's config check
imports them before Ray starts (an error in one names the file and the line), a relative path reaches the
workers absolute, and an ``env.loop`` that replaces the YAML's environment says which of the YAML's settings
change (``issues show 56``)."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from recipes import grpo, rlm
from workers.agents.examples import word_count
from workers.agents.examples.word_count import write_dataset

YAML = Path(__file__).resolve().parents[2] / "recipes" / "rlm_word_count.yaml"


@pytest.fixture
def no_run(monkeypatch):
    """The recipes' ``start_run`` (run folder, data, Ray) replaced: it records the validated config instead."""
    started: list = []

    def record(cfg, recipe):
        started.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(grpo, "start_run", record)
    monkeypatch.setattr(rlm, "start_run", record)
    return started


def _main(recipe, argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        recipe.main(argv)
    return exc.value.code


@pytest.fixture
def my_env(tmp_path, monkeypatch) -> str:
    """A user's copy of the word-count example under another name, in a folder of its own (not on
    ``sys.path``); the current directory is ``tmp_path``, so ``envs/my_count.py`` is a relative path."""
    (tmp_path / "envs").mkdir()
    source = Path(word_count.__file__).read_text().replace("WordCount", "MyCount")
    assert "from __future__ import annotations" in source and "@dataclass" in source
    (tmp_path / "envs" / "my_count.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    return "envs/my_count.py"


@pytest.fixture
def data(tmp_path) -> list[str]:
    paths = write_dataset(str(tmp_path / "data"), n_train=4, n_val=2)
    return [f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]"]


@pytest.mark.parametrize(
    "body, line, error",
    [
        (
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return (1 +\n",
            2,
            "SyntaxError",
        ),
        (
            "import os\n\nTHRESHOLD = float(os.environ['NO_SUCH_VARIABLE_56'])\n",
            3,
            "KeyError: 'NO_SUCH_VARIABLE_56'",
        ),
    ],
    ids=["syntax_error", "raises_on_import"],
)
def test_an_error_in_the_reward_file_stops_the_command_line_before_ray_naming_file_and_line(
    tmp_path, no_run, capsys, body, line, error
):
    reward = tmp_path / "my_reward.py"
    reward.write_text(body)
    assert _main(grpo, [f"custom_reward_function.path={reward}"]) == 2
    err = capsys.readouterr().err
    assert f"custom_reward_function.path='{reward}': {reward}, line {line}: {error}" in err
    assert no_run == []


def test_a_reward_file_with_postponed_annotations_and_a_dataclass_is_checked_and_made_absolute(
    tmp_path, monkeypatch, no_run
):
    """The file of the issue: ``from __future__ import annotations`` and a ``@dataclass`` (dataclasses look the
    class's module up in ``sys.modules``); it is imported by the config check, and the config holds it absolute,
    the path the reward workers import."""
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "my_reward.py").write_text(
        textwrap.dedent(
            """\
            from __future__ import annotations

            from dataclasses import dataclass


            @dataclass
            class Rule:
                bonus: float = 0.25


            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                return 1.0 + Rule().bonus if solution_str.strip() == str(ground_truth) else 0.0
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    assert _main(grpo, ["custom_reward_function.path=rewards/my_reward.py"]) == 0
    assert no_run[0].custom_reward_function.path == str(tmp_path / "rewards" / "my_reward.py")
    # a function the file does not define is refused before Ray too
    with pytest.raises(SystemExit):
        grpo.main(["custom_reward_function.path=rewards/my_reward.py", "custom_reward_function.name=score"])
    assert len(no_run) == 1


def test_env_loop_takes_a_file_outside_the_package(my_env, tmp_path, data, no_run):
    argv = ["--config", str(YAML), *data, f"env.loop={my_env}:MyCountLoop", "env.agent.max_new_tokens=20"]
    assert _main(rlm, argv) == 0
    env = no_run[0].env
    assert type(env).__name__ == "MyCountEnvConfig" and type(env).__module__.startswith(
        "hyflow_user_my_count_"
    )
    assert env.loop == f"{tmp_path / 'envs' / 'my_count.py'}:MyCountLoop"  # absolute: what the workers import
    assert env.agent.max_new_tokens == 20 and env.agent.max_turns == 3
    assert env.env_names() == ("", env.loop)


def test_an_error_in_the_env_file_stops_the_command_line_before_ray_naming_file_and_line(
    tmp_path, monkeypatch, no_run, capsys
):
    (tmp_path / "broken_env.py").write_text("from workers.agents.loop import AgentLoop\n\nundefined_name\n")
    monkeypatch.chdir(tmp_path)
    assert _main(rlm, ["env.loop=broken_env.py:Loop"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'broken_env.py'}, line 3: NameError: name 'undefined_name' is not defined" in err
    assert "config key 'env.loop' (command-line override)" in err and no_run == []


def test_switching_env_loop_on_the_command_line_says_which_yaml_settings_change(my_env, data, no_run, caplog):
    """rlm_word_count.yaml sets env.agent.max_turns: 3 (the default too), max_new_tokens: 24 (default 64) and
    temperature: 0.7 (default 1.0);
    another loop's config drops the YAML's env section, and the warning names what changes and to what."""
    argv = ["--config", str(YAML), *data, f"env.loop={my_env}:MyCountLoop", "env.agent.max_turns=2"]
    with caplog.at_level(logging.WARNING, logger="recipes"):
        assert _main(rlm, argv) == 0
    assert no_run[0].env.agent.max_new_tokens == 64 and no_run[0].env.agent.max_turns == 2
    [warning] = [r.getMessage() for r in caplog.records if r.name == "recipes"]
    assert (
        f"env.loop='{my_env}:MyCountLoop' (command line) reads MyCountEnvConfig, not the WordCountEnvConfig"
        in (warning)
    )
    assert warning.splitlines()[1:] == [  # max_turns: set again
        "  env.agent.max_new_tokens: 24 -> 64",
        "  env.agent.temperature: 0.7 -> 1.0",
    ]
    caplog.clear()
    # the YAML's own loop named again keeps its section, and says nothing
    with caplog.at_level(logging.WARNING, logger="recipes"):
        assert (
            _main(rlm, ["--config", str(YAML), *data, f"env.loop={word_count.__name__}:WordCountLoop"]) == 0
        )
    assert no_run[1].env.agent.max_new_tokens == 24 and caplog.records == []


def test_switching_rlm_yaml_to_a_package_env_names_the_rlm_settings_it_drops(no_run, caplog):
    """rlm.yaml's env section is the RLM env's: keys the word-count env has not, and values it sets otherwise."""
    with caplog.at_level(logging.WARNING, logger="recipes"):
        assert _main(rlm, [f"env.loop={word_count.__name__}:WordCountLoop"]) == 0
    assert no_run[0].env.sandbox.timeout_s == 30.0 and no_run[0].env.agent.max_new_tokens == 64
    [warning] = [r.getMessage() for r in caplog.records if r.name == "recipes"]
    assert "reads WordCountEnvConfig, not the RLMEnvConfig of" in warning and "rlm.yaml" in warning
    assert warning.splitlines()[1:] == [
        "  env.agent.max_depth: 0 -> not a key of WordCountEnvConfig",
        "  env.agent.max_iterations: 3 -> not a key of WordCountEnvConfig",
        "  env.agent.max_new_tokens: 160 -> 64",
        "  env.agent.max_subcalls: 8 -> not a key of WordCountEnvConfig",
        "  env.agent.max_observation_chars: 1000 -> not a key of WordCountEnvConfig",
        "  env.agent.prompt.style: 'compact' -> not a key of WordCountEnvConfig",
        "  env.sandbox.timeout_s: 10.0 -> 30.0",
    ]
