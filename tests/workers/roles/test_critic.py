"""CriticWorker through a 2-rank gloo worker group (FSDP2): values against a single-process forward of the same
value-head model, value-loss updates toward the returns, metrics and a checkpoint round trip."""

from __future__ import annotations

import math

import pytest
import torch

from controller import RayClassWithInitArgs, RayWorkerGroup, WorkerGroupError
from dataproto import DataProto
from resource_pools import ResourcePool
from workers.config import CriticConfig, ModelConfig, RolloutConfig
from workers.engine import OptimConfig
from workers.roles import CriticWorker

P, R = 6, 5
CRITIC_METRICS = {
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/grad_norm",
    "critic/lr",
    "critic/skipped_steps",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("roles_critic") / "nano", size="nano", seed=0)


@pytest.fixture(scope="module")
def critic(ray_session, model_dir):
    pool = ResourcePool([2], name="roles_critic2")
    config = CriticConfig(
        ppo_mini_batch_size=4,  # x n=2: 8 rows per optimizer step, one step per 8-row batch
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=25,
        cliprange_value=0.5,
        optim=OptimConfig(lr=1e-2, grad_clip=1.0),
        seed=3,
    )
    wg = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(CriticWorker, ModelConfig(path=model_dir), config, RolloutConfig(n=2)),
        name_prefix="critic",
    )
    wg.init_model()
    yield wg
    wg.shutdown()
    pool.remove()


def make_batch(n: int = 8, seed: int = 0, vocab: int = 1024, pad: int = 3) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.full((n, P), pad, dtype=torch.long)
    responses = torch.full((n, R), pad, dtype=torch.long)
    attention_mask = torch.zeros(n, P + R, dtype=torch.long)
    for i in range(n):
        pl = int(torch.randint(2, P + 1, (1,), generator=g))
        rl = int(torch.randint(2, R + 1, (1,), generator=g))
        prompts[i, P - pl :] = torch.randint(4, vocab, (pl,), generator=g)
        responses[i, :rl] = torch.randint(4, vocab, (rl,), generator=g)
        attention_mask[i, P - pl : P + rl] = 1
    response_mask = attention_mask[:, P:].float()
    response_mask[0, 1] = 0.0  # an observation token inside a response
    return DataProto.from_dict(
        {
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": response_mask,
        }
    )


def with_tensors(data: DataProto, **tensors) -> DataProto:
    return DataProto.from_dict({**data.batch, **tensors})


def value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    return float(0.5 * (((values - returns) ** 2) * mask).sum() / mask.sum())


def test_values_match_single_process_forward_and_are_zero_off_mask(critic, model_dir):
    from workers.models import load_model

    data = make_batch(seed=1)
    values = critic.compute_values(data).batch["values"]
    assert values.shape == (8, R) and values.dtype == torch.float32
    mask = data.batch["response_mask"]
    assert (values[mask == 0] == 0).all() and (values[mask != 0] != 0).all()

    torch.manual_seed(3)  # the engine initialises the value head from critic.seed
    model = load_model(model_dir, value_head=True, attn_implementation="eager")
    b = data.batch
    with torch.no_grad():
        out = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        )
    expected = out.logits[:, P - 1 : P + R - 1, 0] * mask  # value of token j: head output at position P+j-1
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)
    info = critic.worker_info()
    assert [i["dp_size"] for i in info] == [2, 2] and all(i["use_fsdp"] for i in info)


def test_update_critic_moves_values_to_returns(critic):
    critic.init_model()
    data = make_batch(seed=2)
    mask = data.batch["response_mask"]
    returns = (torch.linspace(-1.0, 1.0, 8)[:, None] + 0.5) * mask  # per-row targets
    losses = []
    for _ in range(8):  # PPO iterations: fresh rollout-time values, one update each
        values = critic.compute_values(data).batch["values"]
        m = critic.update_critic(with_tensors(data, values=values, returns=returns)).meta_info["metrics"]
        assert set(m) == CRITIC_METRICS and all(math.isfinite(v) for v in m.values()), m
        # one optimizer step on the current weights: the reported loss is the loss before that step
        assert m["critic/vf_loss"] == pytest.approx(value_loss(values, returns, mask), abs=1e-5)
        vpred_mean = float((values * mask).sum() / mask.sum())
        assert m["critic/vpred_mean"] == pytest.approx(vpred_mean, abs=1e-5)
        assert m["critic/vf_clipfrac"] == 0.0  # vpreds == values at the step: nothing clipped
        losses.append(m["critic/vf_loss"])
    final = value_loss(critic.compute_values(data).batch["values"], returns, mask)
    assert final < 0.25 * losses[0], (losses, final)
    assert losses[-1] < losses[0] and m["critic/skipped_steps"] == 0 and m["critic/lr"] == pytest.approx(1e-2)


def test_stale_values_are_clipped(critic):
    """With rollout-time values kept fixed, updates move vpreds past the clip range and clipfrac becomes > 0."""
    critic.init_model()
    data = make_batch(seed=3)
    mask = data.batch["response_mask"]
    values = critic.compute_values(data).batch["values"]
    batch = with_tensors(data, values=values, returns=(values + 3.0) * mask)
    clipfracs = [critic.update_critic(batch).meta_info["metrics"]["critic/vf_clipfrac"] for _ in range(6)]
    assert clipfracs[0] == 0.0 and clipfracs[-1] > 0.0, clipfracs


def test_critic_checkpoint_round_trip(critic, tmp_path):
    critic.init_model()
    data = make_batch(seed=4)
    mask = data.batch["response_mask"]
    values = critic.compute_values(data).batch["values"]
    batch = with_tensors(data, values=values, returns=mask * 0.7)
    critic.update_critic(batch)
    path = critic.save_checkpoint(str(tmp_path / "ckpt"), 1)[0]
    first = critic.update_critic(batch).meta_info["metrics"]
    critic.load_checkpoint(path)
    again = critic.update_critic(batch).meta_info["metrics"]
    for k in first:
        assert again[k] == pytest.approx(first[k], abs=1e-6), k


def test_update_critic_needs_returns(critic):
    data = make_batch(seed=5)
    with pytest.raises(
        WorkerGroupError, match=r"CriticWorker rank \d/2: update_critic needs batch key\(s\) \['returns'\]"
    ):
        critic.update_critic(with_tensors(data, values=torch.zeros(8, R)))
