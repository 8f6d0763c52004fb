"""``actor.strategy=megatron`` through real 2-rank actor groups (Ray actors, gloo) laid out as Megatron DP=2, TP=2
and PP=2, against the FSDP strategy on one rank: the same old log-probs, update metrics and updated weights;
the TP=2 group is the hybrid engine (a rollout role sharing the actor), whose rollout replicas must receive the full weights. Plus
the n-D dispatch layout each group registers and the engine-selection / group-size errors."""

from __future__ import annotations

import importlib.util
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from controller import RayClassWithInitArgs, RayWorkerGroup, create_colocated_worker_cls
from dataproto import DataProto
from resource_pools import ResourcePool
from tests.skips import skip_or_fail
from workers.config import ActorConfig, CriticConfig, ModelConfig, RolloutConfig
from workers.engine import EngineConfig, MegatronConfig, OptimConfig
from workers.roles import ActorWorker, CriticWorker, hybrid_roles
from workers.roles.common import build_engine, data_parallel_size

# find_spec, not importorskip: megatron-core itself is imported only in the processes that build engines
if importlib.util.find_spec("megatron.core") is None:
    skip_or_fail("megatron-core is not installed (pip install -e '.[megatron]')", allow_module_level=True)


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


def critic_config(strategy: str, megatron: MegatronConfig | None = None) -> CriticConfig:
    return CriticConfig(
        strategy=strategy,
        megatron=megatron or MegatronConfig(),
        ppo_mini_batch_size=4,
        ppo_epochs=2,
        use_dynamic_bsz=False,
        ppo_micro_batch_size_per_gpu=2,
        optim=OptimConfig(lr=5e-3, grad_clip=1.0),
    )


# Megatron layouts of a 2-rank actor group, each compared with the 1-rank FSDP actor. The TP=2 group is the
# hybrid engine (its rollout role as ``rollout_<name>``), so its weight sync from a TP-sharded trainer is checked too. The PP=2 group and
# the FSDP group also hold a critic colocated with the actor (one process per rank, two engines: the critic's
# data methods dispatch on their own mesh, "critic").
LAYOUTS = {
    "dp2": MegatronConfig(),
    "tp2": MegatronConfig(tensor_model_parallel_size=2),
    "pp2": MegatronConfig(pipeline_model_parallel_size=2),
}
HYBRID = {"tp2", "fsdp"}
WITH_CRITIC = {"pp2", "fsdp"}


@pytest.fixture(scope="module")
def groups(ray_session, model_dir):
    """Actor groups by layout name, and their colocated critics as ``critic_<name>``."""
    model = ModelConfig(path=model_dir)
    layouts = {**LAYOUTS, "fsdp": None}
    pools = {name: ResourcePool([1 if name == "fsdp" else 2], name=f"meg_roles_{name}") for name in layouts}

    def start(name):
        layout = layouts[name]
        strategy = "fsdp" if layout is None else "megatron"
        actor_cfg = replace(actor_config(strategy), megatron=layout or MegatronConfig())
        if name in HYBRID:
            roles = hybrid_roles(model, actor_cfg, ROLLOUT)
        else:
            roles = {"actor": RayClassWithInitArgs(ActorWorker, model, actor_cfg, ROLLOUT)}
        if name in WITH_CRITIC:
            roles["critic"] = RayClassWithInitArgs(
                CriticWorker, model, critic_config(strategy, layout), ROLLOUT
            )
        cls = create_colocated_worker_cls(roles)
        spawned = RayWorkerGroup(pools[name], cls, name_prefix=f"meg_roles_{name}").spawn(list(roles))
        # actor first: init_model is called in this order (a process runs its calls in the order sent)
        return {name if role == "actor" else f"{role}_{name}": wg for role, wg in spawned.items()}

    with ThreadPoolExecutor(len(layouts)) as ex:
        wgs = {k: v for started in ex.map(start, layouts) for k, v in started.items()}
    [f.get() for f in [wg.init_model.with_options(blocking=False)() for wg in wgs.values()]]
    yield wgs
    for name in layouts:
        wgs[name].shutdown()
    for pool in pools.values():
        pool.remove()


def call_all(wgs: dict, method: str, *args) -> dict:
    """The same call on every group at once (non-blocking), results by group name."""
    futures = {k: getattr(wg, method).with_options(blocking=False)(*args) for k, wg in wgs.items()}
    return {k: f.get() for k, f in futures.items()}


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


def test_megatron_layouts_register_their_mesh(groups):
    """Ranks of one TP/PP replica share a dp rank; only tp rank 0 of the last stage is collected."""
    assert groups["dp2"].dispatch_info("actor") == [(0, True), (1, True)]
    assert groups["tp2"].dispatch_info("actor") == [(0, True), (0, False)]
    assert groups["pp2"].dispatch_info("actor") == [(0, False), (0, True)]
    assert groups["fsdp"].dispatch_info("actor") == [(0, True)]
    assert groups["critic_pp2"].dispatch_info("critic") == [(0, False), (0, True)]
    assert groups["critic_fsdp"].dispatch_info("critic") == [(0, True)]
    info = {k: groups[k].worker_info() for k in LAYOUTS}
    assert [(i["dp_size"], i["dp_rank"], i["tp_rank"], i["pp_rank"]) for i in info["tp2"]] == [
        (1, 0, 0, 0),
        (1, 0, 1, 0),
    ]
    assert [(i["dp_size"], i["dp_rank"], i["tp_rank"], i["pp_rank"]) for i in info["pp2"]] == [
        (1, 0, 0, 0),
        (1, 0, 0, 1),
    ]
    assert [(i["dp_size"], i["dp_rank"]) for i in info["dp2"]] == [(2, 0), (2, 1)]


def test_megatron_actor_matches_fsdp_actor(groups, model_dir, tmp_path):
    """DP=2, TP=2 and PP=2 actors give the 1-rank FSDP actor's old log-probs, update metrics and updated
    weights (log-probs of a fresh batch after two update calls of two optimizer steps each)."""
    from workers.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    actors = {k: groups[k] for k in [*LAYOUTS, "fsdp"]}
    for step in range(2):
        data = make_batch(len(tok), tok.pad_token_id, seed=step)
        old = {k: out.batch for k, out in call_all(actors, "compute_log_prob", data).items()}
        for name in LAYOUTS:
            assert old[name]["old_log_probs"].shape[0] == len(data), name  # one collected rank per replica
            for key in ("old_log_probs", "entropys"):
                assert (old[name][key] - old["fsdp"][key]).abs().max() < 1e-5, (name, step, key)
        batch = DataProto.from_dict({**data.batch, "old_log_probs": old["fsdp"]["old_log_probs"]})
        metrics = {k: out.meta_info["metrics"] for k, out in call_all(actors, "update_actor", batch).items()}
        assert metrics["fsdp"]["actor/pg_loss"] != 0 and metrics["fsdp"]["actor/grad_norm"] > 0
        for name in LAYOUTS:
            assert metrics[name].keys() == metrics["fsdp"].keys(), name
            for key, ref in metrics["fsdp"].items():
                assert math.isclose(metrics[name][key], ref, rel_tol=2e-5, abs_tol=2e-6), (name, step, key)
    # after the updates every actor scores a fresh batch the same: the weights moved identically
    data = make_batch(len(tok), tok.pad_token_id, seed=9)
    after = {k: out.batch["old_log_probs"] for k, out in call_all(actors, "compute_log_prob", data).items()}
    for name in LAYOUTS:
        assert (after[name] - after["fsdp"]).abs().max() < 2e-5, name
    assert (after["fsdp"] - old["fsdp"]["old_log_probs"]).abs().max() > 1e-3  # different batch and weights

    # hybrid worker: the TP-sharded trainer's full weights reach both ranks' rollout replicas (compared with
    # the trainer's own HF export: Adam steps amplify the 1e-7 gradient differences to FSDP on a few elements)
    hybrid = {k: groups[f"rollout_{k}"] for k in HYBRID}
    sync = call_all(hybrid, "sync_weights")
    assert sync["tp2"]["weight_sync/tensors"] == sync["fsdp"]["weight_sync/tensors"] > 0
    export = groups["tp2"].export_hf(str(tmp_path / "tp2_hf"))[0]
    trained = load_file(f"{export}/model.safetensors")
    initial = load_file(f"{model_dir}/model.safetensors")
    rollout = groups["rollout_tp2"].rollout_named_weights()
    assert rollout[0].keys() == rollout[1].keys() == groups["rollout_fsdp"].rollout_named_weights()[0].keys()
    for n, t in rollout[0].items():
        assert torch.equal(t, rollout[1][n]), n
    for n, t in trained.items():
        assert torch.equal(rollout[0][n], t), n
    assert max((rollout[0][n] - initial[n]).abs().max() for n in initial) > 1e-3  # the sync moved weights
    prompts = make_batch(len(tok), tok.pad_token_id, seed=3)
    prompts = DataProto.from_dict(
        {"input_ids": prompts.batch["prompts"], "attention_mask": prompts.batch["attention_mask"][:, :P]},
        meta_info={"n": 1, "do_sample": False, "response_length": 4},
    )
    gen = call_all(hybrid, "generate_sequences", prompts)
    assert torch.equal(gen["tp2"].batch["responses"], gen["fsdp"].batch["responses"])


def test_colocated_megatron_critic_matches_fsdp_critic(groups, model_dir):
    """A PP=2 critic colocated with a PP=2 actor (one Megatron parallel state per process) gives the 1-rank
    FSDP critic's values, value-loss metrics and updated values."""
    from workers.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    critics = {k: groups[f"critic_{k}"] for k in WITH_CRITIC}
    data = make_batch(len(tok), tok.pad_token_id, seed=5)
    values = {k: out.batch["values"] for k, out in call_all(critics, "compute_values", data).items()}
    assert values["pp2"].shape == values["fsdp"].shape == (8, R)
    assert (values["pp2"] - values["fsdp"]).abs().max() < 1e-5
    returns = data.batch["advantages"] + 0.5
    batch = DataProto.from_dict({**data.batch, "values": values["fsdp"], "returns": returns})
    metrics = {k: out.meta_info["metrics"] for k, out in call_all(critics, "update_critic", batch).items()}
    assert metrics["fsdp"]["critic/vf_loss"] > 0 and metrics["fsdp"]["critic/grad_norm"] > 0
    assert metrics["pp2"].keys() == metrics["fsdp"].keys()
    for key, ref in metrics["fsdp"].items():
        assert math.isclose(metrics["pp2"][key], ref, rel_tol=2e-5, abs_tol=2e-6), key
    after = {k: out.batch["values"] for k, out in call_all(critics, "compute_values", data).items()}
    assert (after["pp2"] - after["fsdp"]).abs().max() < 2e-5
    assert (after["fsdp"] - values["fsdp"]).abs().max() > 1e-3  # the updates moved the values


def test_engine_selection_errors(monkeypatch):
    cfg = EngineConfig(model_path="/nonexistent")
    with pytest.raises(ValueError, match="strategy must be 'fsdp' or 'megatron', got 'deepspeed'"):
        build_engine(cfg, "deepspeed")
    with pytest.raises(ValueError, match="MegatronConfig.pipeline_model_parallel_size"):
        MegatronConfig(pipeline_model_parallel_size=0)
    tp2 = MegatronConfig(tensor_model_parallel_size=2)
    assert data_parallel_size(4, "megatron", tp2, section="actor", tag="t") == 2
    assert data_parallel_size(3, "fsdp", tp2, section="actor", tag="t") == 3  # megatron sizes unused
    # a 3-rank group cannot hold TP=2 replicas: the worker names the keys (checked before any engine is built)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_PORT", "29555")
    with pytest.raises(
        ValueError,
        match=r"ActorWorker rank 1/3: the group has 3 rank\(s\), not a multiple of "
        r"actor.megatron.tensor_model_parallel_size \* actor.megatron.pipeline_model_parallel_size",
    ):
        ActorWorker(
            ModelConfig(path="/nonexistent"), replace(actor_config("megatron"), megatron=tp2), ROLLOUT
        )
    # 4 ranks at TP=2 are 2 data-parallel replicas: 2 rows per optimizer step divide among them (4 FSDP ranks
    # would reject it), 1 row does not
    monkeypatch.setenv("WORLD_SIZE", "4")
    two_rows = replace(actor_config("megatron"), megatron=tp2, ppo_mini_batch_size=1)
    ActorWorker(ModelConfig(path="/nonexistent"), two_rows, ROLLOUT)
    with pytest.raises(ValueError, match="group size 4|data-parallel size 4"):
        ActorWorker(ModelConfig(path="/nonexistent"), replace(two_rows, strategy="fsdp"), ROLLOUT)
    one_row = two_rows
    with pytest.raises(
        ValueError,
        match="= 1 rows per optimizer step must be a positive multiple of the data-parallel size 2",
    ):
        ActorWorker(ModelConfig(path="/nonexistent"), one_row, replace(ROLLOUT, n=1))
