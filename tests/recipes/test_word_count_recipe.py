"""An environment chosen in the config: ``recipes/rlm_word_count.yaml`` names the one-file example environment
(``workers/agents/examples/word_count.py``) in ``env.loop``; the ``env`` section is read into the loop's own
dataclass (``WordCountLoop.config_class``) and checked before Ray starts, and ``python -m recipes.rlm --config``
trains on it (a brief run on the nano model)."""

import json
import math
from pathlib import Path

import pytest

from recipes import rlm
from recipes.config import ConfigError, load_config
from workers.agents.examples.word_count import WordCountEnvConfig, write_dataset
from workers.math_env.env_loop import MathToolEnvConfig
from workers.rlm.env_loop import RLMEnvConfig

YAML = Path(__file__).resolve().parents[2] / "recipes" / "rlm_word_count.yaml"
WORD_COUNT = "workers.agents.examples.word_count:WordCountLoop"

# one GRPO step after a two-step warm start: two prompts x two samples, console logging only
BRIEF = [
    "model.tiny_size=nano",
    "data.train_batch_size=2",
    "data.val_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "sft.total_steps=2",
    "sft.batch_size=4",
    "sft.log_every=1",
    "env.agent.max_new_tokens=16",
    "trainer.total_training_steps=1",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
    "trainer.plot=false",
]


@pytest.fixture
def data(tmp_path) -> list[str]:
    """The example's data, written where the test puts it: the overrides that point the YAML at it."""
    paths = write_dataset(str(tmp_path / "data"), n_train=8, n_val=2)
    return [f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]"]


def _refused(monkeypatch, capsys, *overrides: str) -> str:
    """``python -m recipes.rlm --config rlm_word_count.yaml <overrides>`` exits with status 2 before the run
    starts (``start_run`` starts Ray); its message."""

    def no_run(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(rlm, "start_run", no_run)
    with pytest.raises(SystemExit) as exc:
        rlm.main(["--config", str(YAML), *overrides])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_env_loop_picks_the_env_sections_dataclass(data):
    cfg = load_config("rlm", data, config_path=YAML)
    assert type(cfg.env) is WordCountEnvConfig and cfg.env.loop == WORD_COUNT
    assert cfg.env.agent.max_turns == 3 and cfg.env.agent.max_new_tokens == 24  # the YAML's env.agent
    # the built-in recipes keep their environments
    assert (
        type(load_config("rlm").env) is RLMEnvConfig
        and type(load_config("hybrid_rl").env) is MathToolEnvConfig
    )
    # another env.loop on the command line drops the file's env section (rlm.yaml's keys are the RLM env's)
    switched = load_config(
        "rlm", [f"env.loop={WORD_COUNT}", "env.agent.max_turns=2", "env.sandbox.timeout_s=3"]
    )
    assert type(switched.env) is WordCountEnvConfig and switched.env.agent.max_turns == 2
    assert switched.env.sandbox.timeout_s == 3.0


def test_unknown_or_mistyped_env_key_is_refused_before_ray(monkeypatch, capsys):
    err = _refused(monkeypatch, capsys, "env.agent.max_turn=2")
    assert "unknown config key 'env.agent.max_turn'" in err and "WordCountAgentConfig" in err
    assert "did you mean ['max_turns']" in err
    err = _refused(monkeypatch, capsys, "env.agent.max_turns=many")
    assert "config key 'env.agent.max_turns'" in err and "many" in err


def test_unknown_env_loop_is_refused_before_ray_listing_the_known_ones(monkeypatch, capsys):
    err = _refused(monkeypatch, capsys, "env.loop=word_cnt")
    assert "config key 'env.loop'" in err and "unknown agent loop 'word_cnt'" in err
    assert "'math_tool' or 'mixed' or 'openai_agent' or 'rlm'" in err and "'package.module:Class'" in err


def test_a_recipe_that_reads_its_envs_fields_refuses_another_env():
    with pytest.raises(ConfigError) as err:
        load_config("hybrid_rl", [f"env.loop={WORD_COUNT}"])
    assert "WordCountEnvConfig" in str(err.value) and "deriving from MathToolEnvConfig" in str(err.value)


@pytest.mark.e2e
def test_word_count_trains_from_the_command_line(ray_session, tmp_path, data, capsys):
    run_dir = tmp_path / "run"
    result = rlm.main(["--config", str(YAML), *BRIEF, *data, f"trainer.default_local_dir={run_dir}"])
    assert "reference trajectories replayed in the sandbox" in capsys.readouterr().out  # the warm start
    assert result["step"] == 1 and [s for s, _ in result["val_history"]] == [0, 1]
    for _, val in result["val_history"]:  # the env's own metrics of the validation rollouts
        assert "val-wc/finished_frac" in val and "val-wc/calls/mean" in val
    final = result["final"]
    for key in ("wc/finished_frac", "wc/calls/mean", "critic/score/mean", "actor/pg_loss"):
        assert key in final and math.isfinite(final[key]), key
    batch = result["last_batch"]
    assert len(batch) == 4  # 2 prompts x rollout.n=2 trajectories
    for traj in map(json.loads, batch.non_tensor_batch["trajectory"]):
        assert traj["query"].startswith("How many words: ")
        assert isinstance(traj["metadata"]["count_calls"], int)  # set by WordCountLoop.run
    # reward.default_scorer=exact_match scored each trajectory's final answer
    nt = batch.non_tensor_batch
    want = [
        float(a is not None and str(a) == rm["ground_truth"])
        for a, rm in zip(nt["answer"], nt["reward_model"])
    ]
    assert batch.batch["token_level_scores"].sum(-1).tolist() == want
    # the rows are what the engine was fed and sampled: the trainer, reading them with the weights that sampled
    # them, gets the engine's log-probs back (a shifted, re-tokenized or re-rendered row would not)
    mask = batch.batch["response_mask"].bool()
    diff = (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs()[mask]
    assert diff.numel() > 0 and float(diff.max()) < 1e-3, float(diff.max())
    # the run's saved config reads back into the same environment
    assert type(load_config("rlm", config_path=run_dir / "config.yaml").env) is WordCountEnvConfig
