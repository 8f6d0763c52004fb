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
