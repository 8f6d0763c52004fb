"""`WeightSync` driven through `Roles` (``build_roles`` from a recipe config, ``roles.sync_weights()`` as the
recipes call it) on the nano model, for the colocated placement (hybrid engine: in-process stream) and the
disaggregated one (a training pool of 2, a rollout pool of 1, a gloo weight-sync group).

After an SFT step the rollout engines are stale; after one sync every rollout replica holds exactly the
actor's weights (compared with the actor's own HF export), and the sync reports the model's parameter bytes
and its wall time, also kept on the WeightSync object."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dataproto import DataProto
from recipes.config import load_config
from recipes.trainer.roles import build_roles
from recipes.trainer.run import start_run

pytestmark = pytest.mark.e2e

P = 8
TINY = [
    "model.tiny_size=nano",
    "task.name=arithmetic",
    "task.n_train=16",
    "task.n_val=4",
    "data.max_prompt_length=8",
    "data.max_response_length=8",
    "rollout.n=2",
    "trainer.resume_mode=disable",
]
PLACEMENT = {
    "colocated": ["trainer.placement=colocated", "trainer.n_gpus_per_node=1"],
    "disaggregated": [
        "trainer.placement=disaggregated",
        "trainer.n_gpus_per_node=3",
        "trainer.rollout_gpus_per_node=1",
    ],
}


def prompts(tokenizer, rows: int = 3) -> DataProto:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tokenizer), (rows, P), generator=g)
    mask = torch.ones(rows, P, dtype=torch.long)
    uid = np.array([f"q{i}" for i in range(rows)], dtype=object)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"uid": uid})


def max_diff(replica: dict, exported: dict) -> float:
    return max(float((replica[name] - t).abs().max()) for name, t in exported.items())


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_sync_weights_through_roles(ray_session, tmp_path, placement):
    cfg = load_config("grpo", [*TINY, *PLACEMENT[placement], f"trainer.default_local_dir={tmp_path / 'run'}"])
    run = start_run(cfg, "grpo", start_ray=False)
    roles = build_roles(cfg, run)
    try:
        assert roles.weight_sync.strategy == placement
        assert roles.rollout.shares_processes_with(roles.actor) == (placement == "colocated")
        batch = roles.generate(prompts(run.tokenizer), {})
        roles.actor.sft_step(batch)  # the actor moves, the rollout engines do not
        exported = load_file(f"{roles.actor.export_hf(str(tmp_path / 'export'))[0]}/model.safetensors")
        assert all(max_diff(r, exported) > 1e-4 for r in roles.rollout.rollout_named_weights())

        m = roles.sync_weights()

        for replica in roles.rollout.rollout_named_weights():  # every rollout rank
            assert max_diff(replica, exported) == 0.0
        hf_bytes = load_file(f"{run.model_path}/model.safetensors")  # tied embedding stored once
        assert m["perf/weight_sync_bytes"] == sum(t.numel() * t.element_size() for t in hf_bytes.values())
        assert m["timing_s/update_weights"] > 0 and m["weight_sync/tensors"] == len(hf_bytes)
        assert roles.weight_sync.syncs == 1 and roles.weight_sync.last == m
        if placement == "disaggregated":
            assert m["weight_sync/receivers"] == 1 and roles.weight_sync.link.syncs == 1
    finally:
        roles.shutdown()
