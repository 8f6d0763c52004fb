"""LoRA through the recipes (``actor.lora.*``): GRPO in both placements syncs the adapter alone and scores the
reference on the actor's own frozen base (no reference model is built), and bad LoRA settings are config
errors naming the key before Ray starts."""

from types import SimpleNamespace

import pytest
from test_recipes_e2e import DIGIT_REWARD, PLACEMENT, _run
from transformers import AutoConfig

from recipes import grpo
from recipes.config import ConfigError, load_config
from recipes.trainer.roles import plan_of, pool_roles
from workers.models.tiny import ensure_tiny_model

pytestmark = pytest.mark.e2e

RANK = 4


def adapter_bytes(model_path: str, rank: int) -> int:
    """fp32 bytes of an all-linear adapter, from the model's config: rank * (in + out) per wrapped linear."""
    c = AutoConfig.from_pretrained(model_path)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, i, q, kv = c.hidden_size, c.intermediate_size, c.num_attention_heads * hd, c.num_key_value_heads * hd
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)  # q k v o gate up down
    return 4 * rank * per_layer * c.num_hidden_layers


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_grpo_with_lora_syncs_the_adapter_alone_and_its_reference_is_the_base(
    ray_session, tmp_path, placement
):
    reward = tmp_path / "digits.py"
    reward.write_text(DIGIT_REWARD)  # a reward the policy earns a little of, so the adapter moves
    result = _run(
        grpo,
        "grpo",
        tmp_path / "run",
        [
            *PLACEMENT[placement],
            f"custom_reward_function.path={reward}",
            "trainer.total_training_steps=3",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "actor.ppo_mini_batch_size=4",
            "actor.use_kl_loss=true",
            f"actor.lora.rank={RANK}",
            "actor.lora.alpha=8",
            "actor.optim.lr=1e-1",
        ],
    )
    history = result["history"]
    nano = ensure_tiny_model("nano")
    expected = adapter_bytes(nano, RANK)
    assert [h["perf/weight_sync_bytes"] for h in history] == [expected] * 3
    full = sum(p * 4 for p in _param_counts(nano))
    assert expected < full / 10  # 6% at the nano size (1.8% at 0.5B: BENCHMARKS.md)
    # the reference is the frozen base: the KL to it is 0 before the first update and grows as the adapter trains
    kl = [h["actor/kl_loss"] for h in history]
    assert kl[0] == 0 and kl[-1] > 1e-4, kl


def _param_counts(model_path: str):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return [p.numel() for p in model.parameters()]


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_with_lora_no_reference_model_is_built(placement):
    run = SimpleNamespace(model_path="unused")  # only the classes and their arguments are built here
    kl = [*PLACEMENT[placement], "actor.use_kl_loss=true"]

    def roles(overrides):
        cfg = load_config("grpo", overrides)
        return {role for pool in pool_roles(cfg, run, plan_of(cfg)).values() for role in pool}

    assert "ref" in roles(kl)
    with_lora = roles([*kl, f"actor.lora.rank={RANK}"])
    assert "ref" not in with_lora and "actor" in with_lora


def test_bad_lora_settings_are_config_errors_naming_the_key():
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank must be an int >= 0"):
        load_config("grpo", ["actor.lora.rank=-2"])
    with pytest.raises(ConfigError, match=r"actor\.lora\.dropout must be in \[0, 1\)"):
        load_config("grpo", ["actor.lora.rank=4", "actor.lora.dropout=1.0"])
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank=4 needs actor\.strategy=fsdp"):
        load_config("grpo", ["actor.lora.rank=4", "actor.strategy=megatron"])
    model = ensure_tiny_model("nano")
    with pytest.raises(ConfigError, match=r"actor\.lora\.target_modules: \['qkv'\] name no module"):
        load_config(
            "grpo", [f"model.path={model}", "actor.lora.rank=4", "actor.lora.target_modules=[q_proj,qkv]"]
        )


def test_async_grpo_with_lora_swaps_adapters_into_running_generations(ray_session, tmp_path, monkeypatch):
    """``async_rl.mode=full``: the adapter reaches the concurrent rollout worker while it generates (the staged
    swap between two decode steps), each sync the adapter's bytes, and later tokens record newer versions."""
    from test_grpo_async import digit_reward, steps_of, token_versions
    from test_grpo_async import run as run_async

    batches: list = []
    result = run_async(
        tmp_path,
        "async_rl.mode=full",
        digit_reward(tmp_path),
        f"actor.lora.rank={RANK}",
        "actor.lora.alpha=8",
        record=batches,
        monkeypatch=monkeypatch,
    )
    steps = steps_of(result)
    assert len(steps) == 4
    assert {s["perf/weight_sync_bytes"] for s in steps} == {adapter_bytes(ensure_tiny_model("nano"), RANK)}
    last = batches[-1]
    assert max(max(token_versions(last, r)) for r in range(len(last))) >= 2


SEVENS_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's characters that are the digit 7."""
    return solution_str.count("7") / max(len(solution_str), 1)
'''


def test_the_quickstart_with_lora_learns_and_exports_the_merged_model_and_the_adapter(ray_session, tmp_path):
    """The user's command with ``actor.lora.*``, brief: it warm-starts in full, then RL trains the adapters alone
    and raises a reward, and the run exports both forms (the full run's figure, 0.285 -> 0.71 held-out accuracy:
    benchmarks/results/quickstart_lora.json).

    The reward is one the warm start rarely earns but can learn in a few steps (the share of 7s it writes). A
    warm start is what makes LoRA learn at all here: on a random model the frozen, tiny output head keeps every
    logit within about +-0.6 whatever the adapters do; 100 SFT steps give the head a spread to use."""
    from peft import PeftConfig
    from test_recipes_e2e import TINY

    from recipes import quickstart

    reward = tmp_path / "sevens.py"
    reward.write_text(SEVENS_REWARD)
    run_dir = tmp_path / "qs"
    steps = 14  # 10 was enough on an AVX-512 EPYC; on an AVX2 one the last two steps' mean was 0.19 at 10
    out = quickstart.main(
        [
            *TINY,
            f"trainer.default_local_dir={run_dir}",
            f"custom_reward_function.path={reward}",
            "trainer.logger=[console]",
            "sft.total_steps=100",
            "sft.batch_size=16",
            "sft.optim.lr=1e-2",
            "sft.optim.warmup_steps=5",
            "sft.optim.total_steps=100",
            "data.train_batch_size=8",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=8",
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={steps}",
            "trainer.save_freq=-1",
            f"actor.lora.rank={RANK}",
            "actor.lora.alpha=8",
            "actor.optim.lr=3e-2",
        ]
    )
    scores = [r["critic/score/mean"] for r in out["history"] if "critic/score/mean" in r]
    assert len(scores) == steps
    first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert first < 0.1 and last > 0.25 and last > 3 * first, (
        f"the adapters did not raise the reward: {scores}"
    )
    adapter = PeftConfig.from_pretrained(f"{out['hf_model']}/adapter")
    assert adapter.r == RANK and adapter.base_model_name_or_path == out["sft_model"]
    assert (run_dir / "hf_model" / "model.safetensors").is_file()


@pytest.mark.parametrize("recipe", ["grpo", "grpo_async", "ppo", "quickstart", "rlm", "hybrid_rl"])
def test_every_recipe_takes_actor_lora_and_then_builds_no_reference_model(recipe):
    """The key is the actor's (one section for every recipe); with a KL term or the hybrid teacher the reference
    is the actor's base, so no ``ref`` role is placed."""
    from recipes.sections import needs_reference, reference_is_actor

    cfg = load_config(recipe, ["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,v_proj]"])
    assert (cfg.actor.lora.rank, cfg.actor.lora.target_modules) == (8, ["q_proj", "v_proj"])
    assert reference_is_actor(cfg) == needs_reference(cfg)
    roles = {
        r
        for pool in pool_roles(cfg, SimpleNamespace(model_path="unused"), plan_of(cfg)).values()
        for r in pool
    }
    assert "ref" not in roles
