"""The hybrid engine: FSDP2 actor + a native rollout replica sharing its process (`workers.roles.hybrid_groups`:
the actor and rollout roles on the same actors), 2 gloo ranks on CPU.

Checks with numbers: the rollout's log-probs of its sampled tokens equal the trainer's ``compute_log_prob``
on the same tokens (fp32, ATOL) before any update; after a PPO ``update_actor`` the replica is stale (the
two differ by far more than ATOL) until ``sync_weights``, after which they agree again and every replica's
weights equal the trainer's exported weights bit for bit; greedy validation generation after the sync
equals Hugging Face ``generate`` with the exported weights; uneven batches with ``n`` samples per prompt
come back complete and in order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dataproto import DataProto
from resource_pools import ResourcePool
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.engine import OptimConfig
from workers.roles import hybrid_groups

P, R = 10, 12  # prompt / response length
ATOL = 1e-4  # rollout vs trainer log-probs, fp32
STALE = 1e-2  # a real update moves some log-prob by more than this

ROLLOUT = RolloutConfig(
    n=1,
    temperature=1.0,
    prompt_length=P,
    response_length=R,
    max_num_seqs=16,
    free_cache_engine=True,
    val_temperature=0.0,
    val_n=1,
)


def tiny_model_dir(path) -> str:
    """A random tiny Qwen2 + the project's byte-level BPE tokenizer (trained with a 256 budget it has 260
    entries: 256 byte symbols + 4 specials), saved as a Hugging Face directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from workers.models.tiny import build_tokenizer

    tok = build_tokenizer(seed=0, vocab_size=256)
    cfg = Qwen2Config(
        vocab_size=len(tok),  # the model covers every tokenizer id
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def make_prompts(n: int, vocab: int, pad: int, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((n, P), pad, dtype=torch.long)
    mask = torch.zeros(n, P, dtype=torch.long)
    for i in range(n):
        k = int(torch.randint(3, P + 1, (1,), generator=g))
        ids[i, P - k :] = torch.randint(4, vocab, (k,), generator=g)
        mask[i, P - k :] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    uid = np.array([f"p{i}" for i in range(n)], dtype=object)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, {"uid": uid})


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


@pytest.fixture(scope="module")
def setup(ray_session, tmp_path_factory):
    from workers.models import load_tokenizer

    path = tiny_model_dir(tmp_path_factory.mktemp("actor_rollout") / "tiny")
    tok = load_tokenizer(path)
    actor = ActorConfig(
        ppo_mini_batch_size=4,
        ppo_epochs=1,
        clip_ratio=10.0,  # no clipping: the update must move the policy
        optim=OptimConfig(lr=1e-2, grad_clip=None),
    )
    pool = ResourcePool([2], name="test_actor_rollout_pool")
    wgs = hybrid_groups(pool, ModelConfig(path=path), actor, ROLLOUT, name_prefix="actor_rollout")
    wgs["actor"].init_model()
    wgs["rollout"].init_model()
    yield {**wgs, "path": path, "vocab": len(tok), "pad": tok.pad_token_id, "eos": tok.eos_token_id}
    wgs["actor"].shutdown()
    pool.remove()


def test_sync_after_update_makes_rollout_match_trainer(setup, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    actor, rollout = setup["actor"], setup["rollout"]
    prompts = make_prompts(4, setup["vocab"], setup["pad"], seed=1)
    prompts.meta_info["seed"] = 123

    gen0 = rollout.generate_sequences(prompts)
    assert len(gen0) == 4 and gen0.batch["responses"].shape == (4, R)
    assert gen0.meta_info["temperature"] == 1.0 and gen0.meta_info["n"] == 1
    assert gen0.meta_info["timing_s/gen"] > 0
    mask0 = gen0.batch["response_mask"]
    # token counts are summed over both ranks' chunks
    assert gen0.meta_info["rollout/generated_tokens"] == int(mask0.sum())

    # same weights on both sides: the rollout's sampled-token log-probs are the trainer's
    old = actor.compute_log_prob(gen0).batch["old_log_probs"]
    assert masked_max_diff(old, gen0.batch["rollout_log_probs"], mask0) < ATOL

    # one PPO step with random advantages
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(mask0.shape, generator=g) * mask0
    train = gen0.union(DataProto.from_dict({"old_log_probs": old, "advantages": adv}))
    metrics = actor.update_actor(train).meta_info["metrics"]
    assert np.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0

    new = actor.compute_log_prob(gen0).batch["old_log_probs"]
    assert masked_max_diff(new, old, mask0) > STALE  # the trainer moved ...
    gen_stale = rollout.generate_sequences(prompts)  # ... the rollout did not: same seed, same tokens
    assert torch.equal(gen_stale.batch["responses"], gen0.batch["responses"])
    assert (
        masked_max_diff(gen_stale.batch["rollout_log_probs"], gen0.batch["rollout_log_probs"], mask0) < 1e-6
    )

    m = rollout.sync_weights()
    hf = AutoModelForCausalLM.from_pretrained(setup["path"])
    expected_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied embedding once
    assert m["perf/weight_sync_bytes"] == expected_bytes
    assert m["weight_sync/tensors"] == len(list(hf.parameters()))
    assert m["timing_s/update_weights"] > 0 and m["weight_sync/count"] == 1

    # the next rollout uses the new weights: its log-probs moved, and equal the trainer's again
    gen1 = rollout.generate_sequences(prompts)
    mask1 = gen1.batch["response_mask"]
    first = gen1.batch["rollout_log_probs"][:, 0] - gen0.batch["rollout_log_probs"][:, 0]
    if torch.equal(gen1.batch["responses"][:, 0], gen0.batch["responses"][:, 0]):
        assert float(first.abs().max()) > STALE
    new1 = actor.compute_log_prob(gen1).batch["old_log_probs"]
    assert masked_max_diff(new1, gen1.batch["rollout_log_probs"], mask1) < ATOL
    # tokens sampled before the sync, scored by the updated trainer, disagree with the stale rollout
    assert masked_max_diff(new, gen_stale.batch["rollout_log_probs"], mask0) > STALE

    # every rank's replica holds exactly the trainer's weights
    out_dir = actor.export_hf(str(tmp_path / "export"))[0]
    exported = load_file(f"{out_dir}/model.safetensors")
    for replica in rollout.rollout_named_weights():
        for name, t in exported.items():
            assert torch.equal(replica[name], t), name


def test_greedy_validation_after_sync_equals_hf_generate(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    actor, rollout = setup["actor"], setup["rollout"]
    # move the weights away from the initial checkpoint, then sync
    batch = rollout.generate_sequences(make_prompts(4, setup["vocab"], setup["pad"], seed=2))
    actor.sft_step(batch)
    rollout.sync_weights()

    prompts = make_prompts(5, setup["vocab"], setup["pad"], seed=3)
    prompts.meta_info["validate"] = True  # val_temperature=0: greedy, val_n=1
    out = rollout.generate_sequences(prompts)
    assert len(out) == 5 and out.meta_info["n"] == 1 and out.meta_info["temperature"] == 1.0

    out_dir = actor.export_hf(str(tmp_path / "export"))[0]
    hf = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(
            input_ids=prompts.batch["input_ids"],
            attention_mask=prompts.batch["attention_mask"],
            max_new_tokens=R,
            do_sample=False,
            eos_token_id=setup["eos"],
            pad_token_id=setup["pad"],
        )[:, P:]
    ref = torch.nn.functional.pad(ref, (0, R - ref.shape[1]), value=setup["pad"])
    assert torch.equal(out.batch["responses"], ref)
    # greedy log-probs (temperature 1) equal the trainer's too
    lp = actor.compute_log_prob(out).batch["old_log_probs"]
    assert masked_max_diff(lp, out.batch["rollout_log_probs"], out.batch["response_mask"]) < ATOL


@pytest.mark.parametrize("num_prompts", [3, 1])
def test_uneven_batch_with_n_samples(setup, num_prompts):
    actor, rollout = setup["actor"], setup["rollout"]
    prompts = make_prompts(num_prompts, setup["vocab"], setup["pad"], seed=4)
    prompts.meta_info.update(n=2, temperature=0.7)
    out = rollout.generate_sequences(prompts)
    assert len(out) == 2 * num_prompts
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(2, dim=0))
    assert list(out.non_tensor_batch["uid"]) == [f"p{i}" for i in range(num_prompts) for _ in range(2)]
    assert out.meta_info["n"] == 2 and out.meta_info["temperature"] == 0.7
    assert "_hyflow_pad_rows" not in out.meta_info
    mask = out.batch["response_mask"]
    assert torch.equal(out.batch["attention_mask"][:, P:].float(), mask)
    assert float((out.batch["rollout_log_probs"] * (1 - mask)).abs().sum()) == 0.0
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], out.batch["responses"]], 1))
    # scored at the sampling temperature, the trainer agrees
    lp = actor.compute_log_prob(out).batch["old_log_probs"]
    assert masked_max_diff(lp, out.batch["rollout_log_probs"], mask) < ATOL
