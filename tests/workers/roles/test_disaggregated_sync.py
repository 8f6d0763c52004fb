"""Disaggregated placement on CPU: a 2-rank FSDP2 trainer pool and a 2-rank rollout pool (ResourcePoolManager),
joined by a standalone gloo weight-sync group (trainer rank 0 + both rollout ranks).

Checks with numbers: after an SFT step the rollout pool is stale (its log-probs differ from the trainer's by
far more than ATOL); after a disaggregated ``WeightSync`` both rollout ranks' log-probs of their sampled tokens
equal the trainer's ``compute_log_prob`` (fp32, ATOL); the reported bytes equal the model's parameter bytes,
the bucket count equals what ``iter_buckets`` gives for the bound, and a bound smaller than most tensors
(each travels alone) gives the same result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from controller import RayClassWithInitArgs, RayWorkerGroup, WorkerGroupError, wait_all
from dataproto import DataProto
from resource_pools import ResourcePoolManager
from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.engine import OptimConfig
from workers.roles.actor import ActorWorker
from workers.roles.rollout import RolloutWorker
from workers.rollout.base import RolloutEngine
from workers.weight_sync import WeightSync, iter_buckets

P, R = 8, 10
ATOL = 1e-4
STALE = 1e-2

ROLLOUT = RolloutConfig(n=2, temperature=1.0, prompt_length=P, response_length=R, max_num_seqs=16)


def tiny_model_dir(path) -> str:
    """A random tiny Qwen2 (vocab = the 260 entries of the project's byte-level tokenizer) + that tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from workers.models.tiny import build_tokenizer

    tok = build_tokenizer(seed=0, vocab_size=256)
    cfg = Qwen2Config(
        vocab_size=len(tok),
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
    torch.manual_seed(1)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def make_prompts(n: int, vocab: int, pad: int, seed: int) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((n, P), pad, dtype=torch.long)
    mask = torch.zeros(n, P, dtype=torch.long)
    for i in range(n):
        k = int(torch.randint(3, P + 1, (1,), generator=g))
        ids[i, P - k :] = torch.randint(4, vocab, (k,), generator=g)
        mask[i, P - k :] = 1
    uid = np.array([f"q{i}" for i in range(n)], dtype=object)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"uid": uid})


def masked_max_diff(a, b, mask) -> float:
    return float(((a - b).abs() * mask).max())


@pytest.fixture(scope="module")
def setup(ray_session, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from workers.models import load_tokenizer

    path = tiny_model_dir(tmp_path_factory.mktemp("disagg") / "tiny")
    tok = load_tokenizer(path)
    model = ModelConfig(path=path)
    actor = ActorConfig(ppo_mini_batch_size=2, optim=OptimConfig(lr=1e-2, grad_clip=None))
    mgr = ResourcePoolManager(
        {"disagg_trainer": [2], "disagg_rollout": [2]},
        {"actor": "disagg_trainer", "rollout": "disagg_rollout"},
    )
    mgr.create_resource_pools()
    assert not mgr.is_colocated("actor", "rollout")
    actor_wg = RayWorkerGroup(
        mgr.get_pool("actor"),
        RayClassWithInitArgs(ActorWorker, model=model, actor=actor, rollout=ROLLOUT),
        name_prefix="trainer",
    )
    rollout_wg = RayWorkerGroup(
        mgr.get_pool("rollout"),
        RayClassWithInitArgs(RolloutWorker, model=model, rollout=ROLLOUT),
        name_prefix="rollout",
    )
    inits = [wg.init_model.with_options(blocking=False)() for wg in (actor_wg, rollout_wg)]
    [f.get() for f in inits]
    hf = AutoModelForCausalLM.from_pretrained(path)
    weight_sync = WeightSync(actor_wg, rollout_wg, "disaggregated")
    yield {
        "actor": actor_wg,
        "rollout": rollout_wg,
        "weight_sync": weight_sync,
        "vocab": len(tok),
        "pad": tok.pad_token_id,
        "named": [(n, p.detach()) for n, p in hf.named_parameters()],  # tied embedding once
    }
    weight_sync.close()
    actor_wg.shutdown()
    rollout_wg.shutdown()
    mgr.remove()


def perturb(actor_wg, rollout_wg, prompts) -> None:
    """One SFT step on the rollout's own samples: the trainer's weights move, the rollout's do not."""
    batch = rollout_wg.generate_sequences(prompts)
    metrics = actor_wg.sft_step(batch).meta_info["metrics"]
    assert np.isfinite(metrics["sft/loss"]) and metrics["sft/grad_norm"] > 0


def check_rollout_matches_trainer(actor_wg, rollout_wg, prompts) -> float:
    out = rollout_wg.generate_sequences(prompts)
    assert len(out) == 2 * len(prompts)  # n=2 from the rollout config, rows on both rollout ranks
    lp = actor_wg.compute_log_prob(out).batch["old_log_probs"]
    return masked_max_diff(lp, out.batch["rollout_log_probs"], out.batch["response_mask"])


def test_disaggregated_sync(setup):
    actor_wg, rollout_wg, named = setup["actor"], setup["rollout"], setup["named"]
    prompts = make_prompts(3, setup["vocab"], setup["pad"], seed=0)  # 3 prompts x 2 samples over 2 ranks
    total_bytes = sum(t.numel() * t.element_size() for _, t in named)

    assert check_rollout_matches_trainer(actor_wg, rollout_wg, prompts) < ATOL  # same initial weights
    perturb(actor_wg, rollout_wg, prompts)
    assert check_rollout_matches_trainer(actor_wg, rollout_wg, prompts) > STALE  # rollout is stale

    m = setup["weight_sync"].sync()  # default bucket: rollout.weight_bucket_mb = 64 MiB
    assert m["perf/weight_sync_bytes"] == total_bytes
    assert m["weight_sync/tensors"] == len(named)
    assert m["weight_sync/buckets"] == 1 and m["weight_sync/receivers"] == 2
    assert m["weight_sync/wire_bytes"] >= total_bytes and m["timing_s/update_weights"] > 0
    assert check_rollout_matches_trainer(actor_wg, rollout_wg, prompts) < ATOL

    # a bound below the size of most tensors: those travel alone, small ones (norms, biases) are grouped
    bound = 4096
    expected = list(iter_buckets(named, bound))
    assert sum(1 for b in expected if len(b) == 1 and b[0][1].numel() * 4 > bound) >= 8
    perturb(actor_wg, rollout_wg, make_prompts(4, setup["vocab"], setup["pad"], seed=1))
    assert check_rollout_matches_trainer(actor_wg, rollout_wg, prompts) > STALE
    m = setup["weight_sync"].sync(bucket_bytes=bound)
    assert m["weight_sync/buckets"] == len(expected)
    assert m["perf/weight_sync_bytes"] == total_bytes and m["weight_sync/tensors"] == len(named)
    assert m["weight_sync/max_bucket_bytes"] == max(sum(t.numel() * 4 for _, t in b) for b in expected)
    assert check_rollout_matches_trainer(actor_wg, rollout_wg, prompts) < ATOL

    # the per-rank receive metrics agree with what the trainer sent (the two sides issued by hand)
    link = setup["weight_sync"].link
    assert link.syncs == 2 and link.backend == "gloo" and link.world_size == 3
    send = actor_wg.send_weights.with_options(blocking=False)(bucket_bytes=bound, group_name=link.group_name)
    recv = rollout_wg.receive_weights.with_options(blocking=False)(group_name=link.group_name)
    sent, received = wait_all([send, recv])
    assert [r["weight_sync/buckets"] for r in received] == [len(expected)] * 2
    assert [r["perf/weight_sync_bytes"] for r in received] == [sent["perf/weight_sync_bytes"]] * 2
    assert [r["weight_sync/count"] for r in received] == [3, 3]


def test_receive_without_group_names_role_and_rank(setup):
    with pytest.raises(
        WorkerGroupError,
        match=r"RolloutWorker rank [01]/2: receive_weights before init_weight_sync",  # first to fail wins
    ):
        setup["rollout"].receive_weights(group_name="no_such_group")


class ReadOnlyVersionEngine(RolloutEngine):
    """A rollout engine written from the contract (docs/rollout_engines.md) alone, whose ``weight_version`` is a
    read-only property: only its own ``update_weights`` changes it, as the contract documents. It keeps the
    tensors it is given; the methods a weight sync does not call are not implemented."""

    def __init__(self):
        self._version = 0
        self.loaded: dict[str, torch.Tensor] = {}
        self.flushes = 0

    @classmethod
    def from_config(cls, model, rollout, tokenizer, *, rank=0, tp_group=None):
        return cls()

    @property
    def weight_version(self) -> int:  # type: ignore[override]
        return self._version

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def update_weights(self, named_tensors, *, version=None, flush_cache=True, abort_running=False):
        self.loaded.update((n, t.clone()) for n, t in named_tensors)
        if version is not None:
            self._version = int(version)
        if flush_cache:
            self.flush_cache()

    def flush_cache(self) -> None:
        self.flushes += 1

    def generate_sequences(self, prompts):
        raise NotImplementedError

    async def generate(self, prompt_ids, sampling_params=None):
        raise NotImplementedError

    def release_memory(self, weights=False) -> None:
        pass

    def resume_memory(self, kv_cache=True) -> None:
        pass


def test_receive_into_an_engine_whose_weight_version_is_read_only(monkeypatch):
    """The rollout role's receive (a real two-member gloo weight-sync group in this process: the trainer side in
    a thread) sets the policy version through ``update_weights(version=)``, never by writing the engine's
    ``weight_version``: an engine that exposes it read-only receives the weights and the version."""
    import threading

    from workers.weight_sync import WeightSyncGroup, host_store

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # Worker() outside a group would export a port of its own
    monkeypatch.setenv("MASTER_PORT", "1")
    worker = RolloutWorker(ModelConfig(path="unused"), ROLLOUT)
    engine = worker.rollout_engine = ReadOnlyVersionEngine()
    store, addr, port = host_store(2, timeout_s=30)
    weights = [("a.weight", torch.arange(6.0).reshape(2, 3)), ("b.bias", torch.ones(5))]
    sent: dict = {}

    def trainer() -> None:
        source = WeightSyncGroup(0, 2, store=store, group_name="ro", timeout_s=30)
        sent.update(source.send(weights, bucket_bytes=32))  # two buckets: each tensor alone
        source.destroy()

    thread = threading.Thread(target=trainer)
    thread.start()
    worker.weight_sync_groups.join("ro", 1, 2, master_addr=addr, master_port=port, timeout_s=30)
    metrics = worker.receive_weights(group_name="ro", version=3)
    thread.join(timeout=30)
    worker.weight_sync_groups.leave("ro")
    assert sent["buckets"] == metrics["weight_sync/buckets"] == 2
    assert engine.weight_version == 3
    assert sorted(engine.loaded) == ["a.weight", "b.bias"]
    assert all(torch.equal(engine.loaded[n], t) for n, t in weights)
    assert engine.flushes == 1  # once for the whole stream, not per bucket
