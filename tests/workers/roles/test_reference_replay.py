"""The reference role replays the rollout's expert routes where ``actor.moe.reference_replay`` asks (docs/moe.md):
a RefWorker group on the tiny MoE gives the FSDP engine's log-probs with the batch's routes replayed, and its
routers' own choice without the setting. The routes are moved to other experts first, so the two differ."""

from __future__ import annotations

import pytest
import torch

from controller import RayClassWithInitArgs, RayWorkerGroup
from dataproto import DataProto
from resource_pools import ResourcePool
from workers.config import ModelConfig, RolloutConfig
from workers.engine import EngineConfig, FSDPEngine
from workers.models.tiny import build_tiny_model
from workers.roles import RefWorker
from workers.rollout.batch import build_rollout_batch, rows_from_outputs
from workers.rollout.native import EngineConfig as NativeConfig
from workers.rollout.native import NativeEngine
from workers.rollout.sampling import SamplingParams

ROLLOUT = RolloutConfig(temperature=1.0)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("ref_replay") / "nano", size="nano", arch="moe")


@pytest.fixture(scope="module")
def shifted_batch(moe_dir) -> dict[str, torch.Tensor]:
    """Two sampled rows of the tiny MoE whose recorded routes are each moved to the next expert."""
    engine = NativeEngine.from_pretrained(moe_dir, config=NativeConfig(max_num_seqs=4, max_model_len=64))
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    prompts = [[5, 9, 13, 17, 21], [7, 11, 3]]
    outs = [group[0] for group in engine.generate_batch(prompts, params)]
    batch = build_rollout_batch(rows_from_outputs(prompts, outs), pad_token_id=engine.tokenizer.pad_token_id)
    routes = batch["routed_experts"]
    real = routes >= 0
    routes[real] = (routes[real] + 1) % engine.model.spec.num_experts
    return batch


def test_the_reference_replays_the_rollouts_routes_where_asked(ray_session, moe_dir, shifted_batch):
    engine = FSDPEngine(EngineConfig(model_path=moe_dir, optim=None))
    expected = {
        replay: engine.compute_log_prob(shifted_batch, temperature=1.0, replay_routes=column)["log_probs"]
        for replay, column in ((True, "routed_experts"), (False, None))
    }
    mask = shifted_batch["response_mask"].bool()
    assert (expected[True] - expected[False]).abs()[mask].max() > 1e-3  # other experts, other log-probs
    pool = ResourcePool([1], name="ref_replay")
    try:
        for replay in (True, False):
            spec = RayClassWithInitArgs(
                RefWorker, model=ModelConfig(path=moe_dir), rollout=ROLLOUT, reference_replay=replay
            )
            group = RayWorkerGroup(pool, spec, name_prefix=f"ref_replay_{replay}")
            try:
                group.init_model()
                out = group.compute_ref_log_prob(DataProto.from_dict(dict(shifted_batch)))
            finally:
                group.shutdown()
            torch.testing.assert_close(
                out.batch["ref_log_prob"][mask], expected[replay][mask], atol=1e-5, rtol=0
            )
    finally:
        pool.remove()
