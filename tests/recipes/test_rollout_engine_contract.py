"""The rollout-engine contract through the recipe: an engine written only against `RolloutEngine`
(`workers/rollout/examples/hf_generate.py`, Hugging Face ``generate``) chosen by ``rollout.name="module:Class"``
trains ``recipes.grpo`` in both placements, weight sync included; a bad name is refused before Ray starts."""

import pytest

from recipes import grpo
from recipes.config import ConfigError, load_config
from recipes.trainer.run import start_run

pytestmark = pytest.mark.e2e

ENGINE = "workers.rollout.examples.hf_generate:HFGenerateEngine"
DIGIT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's characters that are digits: a dense reward the random policy can earn."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''
PLACEMENT = {
    "colocated": ["trainer.placement=colocated", "trainer.n_gpus_per_node=1"],
    "disaggregated": [
        "trainer.placement=disaggregated",
        "trainer.n_gpus_per_node=2",
        "trainer.rollout_gpus_per_node=1",
    ],
}


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_grpo_trains_on_an_engine_named_by_module_path(ray_session, tmp_path, placement):
    reward = tmp_path / "digits.py"
    reward.write_text(DIGIT_REWARD)
    cfg = load_config(
        "grpo",
        [
            "model.tiny_size=nano",
            "task.name=arithmetic",
            "task.n_train=32",
            "data.train_batch_size=4",
            "data.max_prompt_length=32",
            "data.max_response_length=16",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=4",
            "actor.optim.lr=3e-2",  # large steps: an engine left on old weights would show it in the log-probs
            "actor.use_kl_loss=false",
            f"custom_reward_function.path={reward}",
            f"rollout.name={ENGINE}",
            "trainer.total_training_steps=3",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.resume_mode=disable",
            "trainer.progress_bar=false",
            "trainer.logger=[console]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            *PLACEMENT[placement],
        ],
    )
    result = grpo.train(cfg, start_run(cfg, "grpo", start_ray=False))
    history = result["history"]
    assert [r["step"] for r in history] == [1, 2, 3]
    # every token records the policy version that sampled it (dataproto/BATCH_LAYOUT.md): step 3 samples from
    # the weights of step 2's update, version 2, synced after it through update_weights(version=)
    last = result["last_batch"]
    assert set(last.batch["rollout_versions"][last.batch["response_mask"] > 0].tolist()) == {2}
    for row in history:
        assert "rollout/decode_steps" not in row  # the native engine's counter: it did not generate
        assert row["response_length/mean"] > 0 and row["perf/weight_sync_bytes"] > 0
        assert row["critic/advantages/max"] > 0 and row["actor/grad_norm"] > 0  # the digit reward is earned
        # the engine samples from the trainer's current weights: after each large update it received them
        assert row["training/rollout_logprob_diff_mean"] < 1e-3, row["step"]
    assert history[0]["actor/entropy"] != history[-1]["actor/entropy"]  # the policy moved


def test_an_unknown_engine_is_refused_before_ray_with_the_known_names():
    with pytest.raises(ConfigError) as e:
        load_config("grpo", ["rollout.name=vllm"])
    assert "rollout.name must be 'native' or 'sglang', got 'vllm'" in str(e.value)
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg.engines'"):
        load_config("grpo", ["rollout.name=no_such_pkg.engines:Fast"])
    with pytest.raises(ConfigError, match="not a RolloutEngine subclass"):
        load_config("grpo", ["rollout.name=workers.rollout.sampling:SamplingParams"])
