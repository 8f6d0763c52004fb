"""``actor.strategy=megatron`` through a real ActorWorker group (2 Ray actors, gloo, Megatron DP=2) against
the FSDP strategy on one rank: the same old log-probs, update metrics and updated weights. Plus the
engine-selection errors (TP/PP inside role workers, unknown strategies)."""

from __future__ import annotations

import importlib.util
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from controller import RayClassWithInitArgs, RayWorkerGroup
from dataproto import DataProto
from resource_pools import ResourcePool
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.engine import EngineConfig, OptimConfig
from workers.roles import ActorWorker
from workers.roles.common import build_engine

# find_spec, not importorskip: megatron-core itself is imported only in the processes that build engines
if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install hyflow[megatron])", allow_module_level=True)

from workers.engine.megatron.engine import MegatronConfig  # noqa: E402

P, R = 6, 5
ROLLOUT = RolloutConfig(
    n=2, temperature=1.0, log_prob_use_dynamic_bsz=False, log_prob_micro_batch_size_per_gpu=2
)


def actor_config(strategy: str) -> ActorConfig:
    return ActorConfig(
        strategy=strategy,
        # x n=2: all 8 rows in one optimizer step (with 2 mini-batches the global mini-batches of a 2-rank
        # and a 1-rank group would hold different rows), 2 epochs: 2 steps per call
        ppo_mini_batch_size=4,
        ppo_epochs=2,
        use_dynamic_bsz=False,
        ppo_micro_batch_size_per_gpu=2,
        entropy_coeff=0.01,
        optim=OptimConfig(lr=5e-3, grad_clip=1.0),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("megatron_roles") / "nano", size="nano", seed=0)


@pytest.fixture(scope="module")
def groups(ray_session, model_dir):
    model = ModelConfig(path=model_dir)
    pools = [ResourcePool([2], name="megatron_actor2"), ResourcePool([1], name="fsdp_actor1")]
    specs = [
        (pools[0], RayClassWithInitArgs(ActorWorker, model, actor_config("megatron"), ROLLOUT), "meg_actor"),
        (pools[1], RayClassWithInitArgs(ActorWorker, model, actor_config("fsdp"), ROLLOUT), "fsdp_actor"),
    ]
    with ThreadPoolExecutor(2) as ex:
        megatron, fsdp = ex.map(lambda s: RayWorkerGroup(s[0], s[1], name_prefix=s[2]), specs)
    [f.get() for f in [wg.init_model.with_options(blocking=False)() for wg in (megatron, fsdp)]]
    yield {"megatron": megatron, "fsdp": fsdp}
    for wg in (megatron, fsdp):
        wg.shutdown()
    for pool in pools:
        pool.remove()


def make_batch(vocab: int, pad: int, n: int = 8, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.full((n, P), pad, dtype=torch.long)
    responses = torch.full((n, R), pad, dtype=torch.long)
    p_mask = torch.zeros(n, P, dtype=torch.long)
    r_mask = torch.zeros(n, R, dtype=torch.long)
    for i in range(n):
        pl, rl = (
            int(torch.randint(2, P + 1, (1,), generator=g)),
            int(torch.randint(2, R + 1, (1,), generator=g)),
        )
        prompts[i, P - pl :] = torch.randint(4, vocab, (pl,), generator=g)
        responses[i, :rl] = torch.randint(4, vocab, (rl,), generator=g)
        p_mask[i, P - pl :], r_mask[i, :rl] = 1, 1
    mask = torch.cat([p_mask, r_mask], dim=1)
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n)])[:, None]
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": r_mask.float(),
            "advantages": sign * r_mask.float(),
        }
    )


def test_megatron_actor_matches_fsdp_actor(groups, model_dir):
    from workers.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    info = groups["megatron"].worker_info()
    assert [i["dp_size"] for i in info] == [2, 2] and [i["dp_rank"] for i in info] == [0, 1]
    for step in range(2):
        data = make_batch(len(tok), tok.pad_token_id, seed=step)
        old = {k: wg.compute_log_prob(data).batch for k, wg in groups.items()}
        for key in ("old_log_probs", "entropys"):
            assert (old["megatron"][key] - old["fsdp"][key]).abs().max() < 1e-5, (step, key)
        batch = DataProto.from_dict({**data.batch, "old_log_probs": old["fsdp"]["old_log_probs"]})
        metrics = {k: wg.update_actor(batch).meta_info["metrics"] for k, wg in groups.items()}
        assert metrics["megatron"].keys() == metrics["fsdp"].keys()
        for name, ref in metrics["fsdp"].items():
            assert math.isclose(metrics["megatron"][name], ref, rel_tol=1e-4, abs_tol=1e-6), (step, name)
    # after the updates both actors score a fresh batch the same: the weights moved identically
    data = make_batch(len(tok), tok.pad_token_id, seed=9)
    after = {k: wg.compute_log_prob(data).batch["old_log_probs"] for k, wg in groups.items()}
    assert (after["megatron"] - after["fsdp"]).abs().max() < 1e-4
    assert (after["megatron"] - old["megatron"]["old_log_probs"]).abs().max() > 0  # different batch, sanity


def test_engine_selection_errors():
    cfg = EngineConfig(model_path="/nonexistent")
    with pytest.raises(NotImplementedError, match="tensor_model_parallel_size=2.*no dispatch mode"):
        build_engine(
            cfg, "megatron", MegatronConfig(tensor_model_parallel_size=2), tag="ActorWorker rank 0/2"
        )
    with pytest.raises(ValueError, match="strategy must be 'fsdp' or 'megatron', got 'deepspeed'"):
        build_engine(cfg, "deepspeed")
    with pytest.raises(ValueError, match="MegatronConfig.pipeline_model_parallel_size"):
        MegatronConfig(pipeline_model_parallel_size=0)
