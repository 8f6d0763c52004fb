"""Tensor parallelism in the native rollout engine (workers/rollout/native/model.py): 2 real gloo processes
run a TP=2 engine on the tiny Qwen2 ("nano": 4 query heads, 2 kv heads, GQA) against the TP=1 engine, with
weights from the HF model, from full state dicts and from the 3D-HybridEngine resharder (train pp=1,tp=2 ->
gen tp_g=2 on the same 2 ranks)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workers.distributed import run_in_processes
from workers.rollout.native.model import spec_from_hf, tp_local_spec

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [300, 301, 302, 303], [40]]  # different lengths
NEW_TOKENS = 10
BUCKET = 20000  # bytes: several resharder buckets


def _model(seed: int = 0, **overrides):
    from transformers import Qwen2ForCausalLM

    from workers.models.tiny import tiny_config

    torch.manual_seed(seed)
    # a wider init than the preset's 0.02, whose greedy outputs just repeat the last prompt token
    overrides.setdefault("initializer_range", 0.2)
    return Qwen2ForCausalLM(tiny_config("nano", **overrides)).eval()


def _run(engine, params):
    outs = [o[0] for o in engine.generate_batch(PROMPTS, params)]
    return [o.token_ids for o in outs], [o.log_probs for o in outs]


def _scenarios(rank: int, world: int, out_dir: str) -> None:
    """Runs in each of 2 spawned gloo ranks; every rank records what it saw for the test process."""
    import torch.distributed as dist

    from workers.rollout.native.engine import EngineConfig, NativeEngine
    from workers.rollout.sampling import SamplingParams
    from workers.weight_sync.reshard import Resharder
    from workers.weight_sync.reshard_plan import (
        GenLayout,
        ReshardPlan,
        TrainLayout,
        expected_gen_shard,
        specs_from_model,
        training_shard,
    )

    group = dist.group.WORLD
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    seeded = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, seed=11)
    unseeded = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    cfg = EngineConfig(max_num_seqs=2, max_model_len=64)  # 4 prompts, 2 slots: requests join and leave
    res: dict = {}

    # (1) TP=2 from the HF model vs TP=1
    model = _model(seed=0)
    ref = NativeEngine(model, config=cfg)
    tp = NativeEngine(model, config=cfg, tp_group=group)
    res["kv_shape"] = tuple(tp.model.kv_shape())
    res["ref_kv_shape"] = tuple(ref.model.kv_shape())
    res["ref_greedy"], res["tp_greedy"] = _run(ref, greedy), _run(tp, greedy)
    res["ref_seeded"], res["tp_seeded"] = _run(ref, seeded), _run(tp, seeded)
    # EngineConfig.seed None: each rank draws request seeds from os.urandom; rank 0's tokens must win
    res["tp_unseeded"] = _run(tp, unseeded)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    tp.update_weights((k, v * 1.0) for k, v in _model(seed=1).state_dict().items())
    res["tp_other_weights"] = _run(tp, greedy)
    tp.update_weights(full.items())  # full tensors: sliced locally
    res["tp_full_reload"] = _run(tp, greedy)

    # (2) weights through the resharder into TP=2 engines built from other weights (tied and untied)
    res["reshard"] = {}
    for tie in (True, False):
        model = _model(seed=0, tie_word_embeddings=tie)
        full = {k: v.detach().clone() for k, v in model.named_parameters()}
        plan = ReshardPlan(specs_from_model(model, 1), TrainLayout(1, 2, 1), GenLayout(2, 1))
        resharder = Resharder(plan, "regrouped")
        engine = NativeEngine(_model(seed=2, tie_word_embeddings=tie), config=cfg, tp_group=group)
        shards = dict(resharder.named_tensors(training_shard(full, plan, rank), bucket_bytes=BUCKET))
        engine.update_weights(shards.items())
        resharder.destroy()
        expected = expected_gen_shard(full, plan, rank)
        weights = dict(engine.named_weights())
        res["reshard"][tie] = {
            "shard_shapes": {n: tuple(t.shape) for n, t in shards.items()},
            "expected_shapes": {n: tuple(t.shape) for n, t in expected.items()},
            # split parameters: the engine holds exactly the resharder's generation chunk
            "split_equal": all(
                torch.equal(weights[n], expected[n])
                for n in expected
                if "embed" not in n and "lm_head" not in n
            ),
            # embedding / lm_head arrive as vocab shards and are all-gathered into the replicated table
            "vocab_equal": torch.equal(engine.model.embed, full["model.embed_tokens.weight"])
            and torch.equal(
                engine.model.lm_head, full.get("lm_head.weight", full["model.embed_tokens.weight"])
            ),
            "tokens": _run(engine, greedy),
            "ref": _run(NativeEngine(model, config=cfg), greedy),
        }

    # (3) errors: a TP size that cuts through the kv heads; a tensor of a wrong shape
    try:
        NativeEngine(_model(num_key_value_heads=1), config=cfg, tp_group=group)
        res["heads_error"] = None
    except ValueError as exc:
        res["heads_error"] = str(exc)
    try:
        tp.update_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(48, 64))])
        res["shape_error"] = None
    except ValueError as exc:
        res["shape_error"] = str(exc)
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("native_tp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_in_processes(_scenarios, 2, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_close_logprobs(got, ref):
    for g, r in zip(got, ref):
        assert len(g) == len(r)
        assert torch.allclose(torch.tensor(g), torch.tensor(r), atol=1e-5, rtol=0), (g, r)


def test_tp2_greedy_tokens_and_logprobs_match_tp1(two_ranks):
    for rank, res in enumerate(two_ranks):
        ref_tokens, ref_logps = res["ref_greedy"]
        tokens, logps = res["tp_greedy"]
        assert tokens == ref_tokens, f"rank {rank}"
        assert all(len(t) == NEW_TOKENS for t in tokens)
        _assert_close_logprobs(logps, ref_logps)
        # the KV cache holds the local kv heads only: 2 kv heads over 2 ranks
        assert res["ref_kv_shape"][2] == 2 and res["kv_shape"][2] == 1
        assert res["kv_shape"][:2] + res["kv_shape"][3:] == res["ref_kv_shape"][:2] + res["ref_kv_shape"][3:]


def test_tp2_sampling_matches_tp1_and_ranks_agree(two_ranks):
    for rank, res in enumerate(two_ranks):
        assert res["tp_seeded"][0] == res["ref_seeded"][0], f"rank {rank}"
        _assert_close_logprobs(res["tp_seeded"][1], res["ref_seeded"][1])
    # unseeded requests draw different seeds per rank; rank 0 samples and broadcasts, so all ranks agree
    assert two_ranks[0]["tp_unseeded"] == two_ranks[1]["tp_unseeded"]


def test_tp2_update_weights_with_full_tensors(two_ranks):
    for rank, res in enumerate(two_ranks):
        assert res["tp_other_weights"][0] != res["ref_greedy"][0], f"rank {rank}: new weights had no effect"
        assert res["tp_full_reload"][0] == res["ref_greedy"][0], f"rank {rank}"
        _assert_close_logprobs(res["tp_full_reload"][1], res["ref_greedy"][1])


@pytest.mark.parametrize("tie", [True, False])
def test_resharded_weights_into_tp2_engines_match_tp1(two_ranks, tie):
    for rank, res in enumerate(two_ranks):
        entry = res["reshard"][tie]
        # what travelled is the generation shard (half of q/k/v/o/gate/up/down, half the vocabulary)
        assert entry["shard_shapes"] == entry["expected_shapes"], f"rank {rank}"
        assert entry["shard_shapes"]["model.layers.0.self_attn.k_proj.weight"] == (16, 64)
        assert entry["shard_shapes"]["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
        assert entry["shard_shapes"]["model.embed_tokens.weight"][0] == 512
        assert entry["split_equal"] and entry["vocab_equal"], f"rank {rank}"
        assert entry["tokens"][0] == entry["ref"][0], f"rank {rank}"
        _assert_close_logprobs(entry["tokens"][1], entry["ref"][1])


def test_errors_name_the_sizes(two_ranks):
    for res in two_ranks:
        assert "tp=2" in res["heads_error"] and "num_key_value_heads=1" in res["heads_error"]
        assert "num_attention_heads" not in res["heads_error"]  # 4 heads divide fine
        assert "(48, 64)" in res["shape_error"] and "(64, 64)" in res["shape_error"]
        assert "(32, 64)" in res["shape_error"]
    spec = spec_from_hf(_model(intermediate_size=250), 64)
    with pytest.raises(ValueError, match="tp=4.*num_key_value_heads=2, intermediate_size=250"):
        tp_local_spec(spec, 4)
    assert tp_local_spec(spec, 1) is spec
