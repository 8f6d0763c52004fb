"""The 3D-HybridEngine end to end in the hybrid engine (`workers.roles.hybrid_groups`: actor and rollout roles on
the same actors): a Megatron TP=2 actor whose rollout replica is itself TP=2 (``rollout.tensor_model_parallel_size=
2``) on the same 2 gloo ranks (real Ray actors, real process groups), against a 1-rank FSDP hybrid engine (full
replica).

After the same PPO update on both and ``sync_weights``: greedy generation equals the FSDP group's; the TP
replica's log-probs of its own samples equal the trainer's ``compute_log_prob`` within 1e-5 (a stale replica
misses by > 1e-3); each prompt comes back ``n`` times, once (only generation-TP rank 0 is collected); the
resharder's byte counts are reported. Plus the rollout-mesh dispatch layout and the config errors."""

from __future__ import annotations

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import pytest
import ray
import torch

from controller import PAD_ROWS_KEY, make_nd_split_dataproto_dispatch_fn
from dataproto import DataProto
from resource_pools import ResourcePool
from tests.skips import skip_or_fail
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.engine import MegatronConfig, OptimConfig
from workers.roles import hybrid_groups
from workers.roles.hybrid_engine import rollout_tp_size
from workers.weight_sync import WeightSync

# find_spec, not importorskip: megatron-core itself is imported only in the processes that build engines
if importlib.util.find_spec("megatron.core") is None:
    skip_or_fail("megatron-core is not installed (pip install -e '.[megatron]')", allow_module_level=True)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

P, R, PROMPTS = 6, 5, 5
ATOL = 1e-5  # rollout (native TP=2) vs trainer (Megatron TP=2) log-probs, fp32
ROLLOUT = RolloutConfig(
    n=2,
    temperature=1.0,
    prompt_length=P,
    response_length=R,
    max_num_seqs=16,
    log_prob_use_dynamic_bsz=False,
    log_prob_micro_batch_size_per_gpu=4,
)
TP2 = MegatronConfig(tensor_model_parallel_size=2)


def actor_config(strategy: str) -> ActorConfig:
    return ActorConfig(
        strategy=strategy,
        megatron=TP2 if strategy == "megatron" else MegatronConfig(),
        ppo_mini_batch_size=4,  # x n=2: the 8 rows in one optimizer step
        use_dynamic_bsz=False,
        ppo_micro_batch_size_per_gpu=4,
        optim=OptimConfig(lr=5e-3, grad_clip=1.0),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("hybrid_tp") / "nano", size="nano", seed=0)


@pytest.fixture(scope="module")
def groups(ray_session, model_dir):
    """``tp2``: Megatron TP=2 actor + TP=2 rollout replica on 2 ranks; ``fsdp``: 1-rank FSDP reference."""
    model = ModelConfig(path=model_dir)
    configs = {
        "tp2": (2, actor_config("megatron"), replace(ROLLOUT, tensor_model_parallel_size=2)),
        "fsdp": (1, actor_config("fsdp"), ROLLOUT),
    }
    pools = {k: ResourcePool([size], name=f"hybrid_tp_{k}") for k, (size, _, _) in configs.items()}

    def start(name):
        _, actor, rollout = configs[name]
        return name, hybrid_groups(pools[name], model, actor, rollout, name_prefix=f"hybrid_tp_{name}")

    with ThreadPoolExecutor(len(configs)) as ex:
        wgs = dict(ex.map(start, configs))
    for role in ("actor", "rollout"):  # both groups at once: the TP ranks join each other's process groups
        [f.get() for f in [g[role].init_model.with_options(blocking=False)() for g in wgs.values()]]
    yield wgs
    for g in wgs.values():
        g["actor"].shutdown()
    for pool in pools.values():
        pool.remove()


def call_all(wgs: dict, role: str, method: str, *args) -> dict:
    futures = {k: getattr(g[role], method).with_options(blocking=False)(*args) for k, g in wgs.items()}
    return {k: f.get() for k, f in futures.items()}


def prompt_batch(vocab: int, pad: int, rows: int, seed: int, **meta) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((rows, P), pad, dtype=torch.long)
    mask = torch.zeros(rows, P, dtype=torch.long)
    for i in range(rows):
        length = int(torch.randint(2, P + 1, (1,), generator=g))
        ids[i, P - length :] = torch.randint(4, vocab, (length,), generator=g)
        mask[i, P - length :] = 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, meta_info=meta)


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def test_rollout_tp_replica_after_update_and_sync(groups, model_dir):
    from workers.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    tp2, fsdp = groups["tp2"], groups["fsdp"]
    # one generation replica over both ranks: same prompts to both, rank 0 collected; FSDP: one per rank
    assert tp2["rollout"].dispatch_info("rollout") == [(0, True), (0, False)]
    assert fsdp["rollout"].dispatch_info("rollout") == [(0, True)]

    # the same PPO update on both trainers (sampled by the FSDP replica, scored by the FSDP trainer)
    batch = fsdp["rollout"].generate_sequences(prompt_batch(len(tok), tok.pad_token_id, 4, 0))
    old = fsdp["actor"].compute_log_prob(batch).batch["old_log_probs"]
    sign = torch.tensor([1.0, -1.0] * 4)[:, None]
    update = DataProto.from_dict(
        {**batch.batch, "old_log_probs": old, "advantages": sign * batch.batch["response_mask"]}
    )
    metrics = {
        k: out.meta_info["metrics"] for k, out in call_all(groups, "actor", "update_actor", update).items()
    }
    assert abs(metrics["tp2"]["actor/pg_loss"] - metrics["fsdp"]["actor/pg_loss"]) < 1e-5

    # a stale TP replica: its sampled log-probs no longer match the updated trainer
    sampled = tp2["rollout"].generate_sequences(prompt_batch(len(tok), tok.pad_token_id, PROMPTS, 1))
    mask = sampled.batch["response_mask"]
    stale = masked_max_diff(
        sampled.batch["rollout_log_probs"],
        tp2["actor"].compute_log_prob(sampled).batch["old_log_probs"],
        mask,
    )
    assert stale > 1e-3

    sync = {
        "tp2": WeightSync(tp2["actor"], tp2["rollout"], "resharded").sync(),
        "fsdp": WeightSync(fsdp["actor"], fsdp["rollout"], "colocated").sync(),
    }
    model_bytes = sync["fsdp"]["perf/weight_sync_bytes"]  # full tensors into one full replica
    s = sync["tp2"]
    # tp_g == tp, pp == 1: every rank already holds its generation shard, the resharder moves nothing
    # (HybridFlow's M/tp_g - M/(tp*pp) = 0) and hands over a TP=2 shard: less than the model, more than half
    assert s["weight_sync/rollout_tp"] == 2
    assert s["weight_sync/bytes_received"] == s["weight_sync/bytes_sent"] == 0  # TP=2 -> tp_g=2: in place
    assert s["perf/weight_sync_bytes"] == s["weight_sync/gen_shard_bytes"] == s["weight_sync/held_bytes"]
    assert model_bytes / 2 < s["weight_sync/gen_shard_bytes"] < model_bytes
    assert s["weight_sync/tensors"] == sync["fsdp"]["weight_sync/tensors"] > 0
    shards = tp2["rollout"].rollout_named_weights()
    assert shards[0].keys() == shards[1].keys()
    w = "model.layers.0.mlp.gate_proj.weight"
    assert (
        shards[0][w].shape[0] * 2 == fsdp["rollout"].rollout_named_weights([w])[0][w].shape[0]
    )  # column-parallel half
    assert not torch.equal(shards[0][w], shards[1][w])

    # sampled generation, n = 2: every prompt n times, interleaved, no duplicates from the 2 TP ranks
    prompts = prompt_batch(len(tok), tok.pad_token_id, PROMPTS, 2)
    sampled = tp2["rollout"].generate_sequences(prompts)
    assert len(sampled) == PROMPTS * ROLLOUT.n
    assert torch.equal(sampled.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(2, dim=0))
    mask = sampled.batch["response_mask"]
    assert mask.sum() > PROMPTS * ROLLOUT.n  # some real response tokens to compare
    trainer = tp2["actor"].compute_log_prob(sampled).batch["old_log_probs"]
    assert masked_max_diff(sampled.batch["rollout_log_probs"], trainer, mask) < ATOL

    # greedy: the same responses as the FSDP group's full replica (both trainers took the same update)
    greedy = prompt_batch(len(tok), tok.pad_token_id, PROMPTS, 3, do_sample=False, n=1)
    gen = call_all(groups, "rollout", "generate_sequences", greedy)
    assert len(gen["tp2"]) == len(gen["fsdp"]) == PROMPTS
    assert torch.equal(gen["tp2"].batch["responses"], gen["fsdp"].batch["responses"])
    mask = gen["tp2"].batch["response_mask"]
    trainer = tp2["actor"].compute_log_prob(gen["tp2"]).batch["old_log_probs"]
    assert masked_max_diff(gen["tp2"].batch["rollout_log_probs"], trainer, mask) < ATOL


class _Layout(SimpleNamespace):
    """Stands in for a worker group's registered mesh (only ``dispatch_info`` is read by the dispatch)."""

    def dispatch_info(self, mesh_name):
        return self.info


def test_rollout_mesh_dispatch_splits_over_replicas(ray_session):
    """4 ranks as 2 TP=2 replicas: prompts split per replica (before repetition), both TP ranks of a replica
    get the same chunk, the collect ranks' outputs are concatenated in replica order."""
    mode = make_nd_split_dataproto_dispatch_fn("rollout_test")
    wg = _Layout(world_size=4, name="wg", info=[(0, True), (0, False), (1, True), (1, False)])
    data = DataProto.from_dict({"input_ids": torch.arange(3)[:, None]})
    sent = mode.dispatch_fn(wg, data)
    chunks = [ray.get(ref) for ref in sent.args[0]]
    assert [c.batch["input_ids"].flatten().tolist() for c in chunks] == [[0, 1], [0, 1], [2], [2]]
    assert [c.meta_info[PAD_ROWS_KEY] for c in chunks] == [0, 0, 0, 0]
    outs = [DataProto.from_dict({"x": torch.tensor([[r]])}) for r in range(4)]
    assert mode.collect(wg, outs).batch["x"].flatten().tolist() == [0, 2]
    # fewer prompts than replicas: the empty replica gets a placeholder row to drop
    one = [ray.get(ref) for ref in mode.dispatch_fn(wg, data.slice(0, 1)).args[0]]
    assert [c.meta_info[PAD_ROWS_KEY] for c in one] == [0, 0, 1, 1]
    with pytest.raises(TypeError, match="rank 2 of worker group 'wg' returned int"):
        mode.collect(wg, [outs[0], outs[1], 7, outs[3]])


def test_rollout_tp_config_errors():
    from recipes.config import ConfigError, load_config, validate

    megatron = actor_config("megatron")
    assert rollout_tp_size(megatron, replace(ROLLOUT, tensor_model_parallel_size=2), "t") == 2
    assert rollout_tp_size(actor_config("fsdp"), ROLLOUT, "t") == 1
    with pytest.raises(
        ValueError, match="t: rollout.tensor_model_parallel_size=2 needs actor.strategy=megatron"
    ):
        rollout_tp_size(actor_config("fsdp"), replace(ROLLOUT, tensor_model_parallel_size=2), "t")
    with pytest.raises(ValueError, match="=4 must divide actor.megatron.tensor_model_parallel_size=2"):
        rollout_tp_size(megatron, replace(ROLLOUT, tensor_model_parallel_size=4), "t")
    with pytest.raises(ValueError, match="is for the native engine"):
        rollout_tp_size(megatron, replace(ROLLOUT, tensor_model_parallel_size=2, name="sglang"), "t")

    base = ["trainer.n_gpus_per_node=4", "trainer.save_freq=-1", "actor.strategy=megatron"]
    ok = load_config(
        "grpo", [*base, "actor.megatron.tensor_model_parallel_size=2", "rollout.tensor_model_parallel_size=2"]
    )
    validate(ok)
    for overrides, message in [
        (["rollout.tensor_model_parallel_size=2", "actor.strategy=fsdp"], "needs actor.strategy=megatron"),
        (
            ["actor.megatron.tensor_model_parallel_size=2", "rollout.tensor_model_parallel_size=4"],
            "must divide",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(load_config("grpo", [*base, *overrides]))
