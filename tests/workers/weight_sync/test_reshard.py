"""3D-HybridEngine resharding (workers/weight_sync/reshard_plan.py, reshard.py): plan invariants in one
process, then 4 real gloo processes resharding a real HF Qwen2 state dict for every layout of the issue,
both paths, checked shard by shard against slices of the full model, and tp_g=1 weights streamed into the
native rollout engine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workers.distributed import run_in_processes
from workers.weight_sync.reshard import paper_volume_bytes
from workers.weight_sync.reshard_plan import (
    GenLayout,
    ParamSpec,
    ReshardPlan,
    TrainLayout,
    hf_param_specs,
    specs_from_model,
)

# (train pp, tp, dp) -> (gen tp_g, dp_g): the three layouts of the issue, plus tp_g == tp and one with DP
LAYOUTS = [
    ((1, 4, 1), (4, 1)),  # micro-DP groups of one: no communication at all
    ((2, 2, 1), (2, 2)),
    ((2, 2, 1), (1, 4)),
    ((1, 4, 1), (2, 2)),
    ((1, 2, 2), (1, 4)),
]
BUCKET = 6000  # bytes: several buckets per reshard, and lone oversize tensors


def _model(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,  # divisible by tp=4
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).eval()


def _plan(model, train, gen):
    return ReshardPlan(specs_from_model(model, train[0]), TrainLayout(*train), GenLayout(*gen))


# ------------------------------------------------------------------------------------------ plan


@pytest.mark.parametrize("train,gen", LAYOUTS)
def test_groups_partition_ranks_and_micro_dp_chunks_union_to_the_generation_chunk(train, gen):
    plan = _plan(_model(), train, gen)
    world = plan.train.world
    groups = plan.micro_dp_groups()
    assert sorted(r for g in groups for r in g) == list(range(world))
    replicas = {}
    for r in range(world):
        dp_g, tp_g = plan.gen_coords(r)
        replicas.setdefault(dp_g, []).append((tp_g, r))
        group = plan.micro_dp_group(r)
        assert len(group) == plan.train.pp * plan.mu
        assert plan.gen_tp_group(r)[tp_g] == r
        for spec in plan.specs:
            need = plan.needed(r, spec)
            contributed = [p for m in group if (p := plan.contribution(m, spec)) is not None]
            if spec.split_dim is None:
                assert [(p.index, p.parts) for p in contributed] == [(0, 1)]
                continue
            # the group's training chunks are exactly the tp/tp_g chunks inside generation chunk `need`
            got = sorted(p.index for p in contributed)
            assert got == list(range(need.index * plan.mu, (need.index + 1) * plan.mu))
            assert sum(p.nbytes for p in contributed) == need.nbytes
    # dp_g replicas, each with one rank per generation TP rank
    assert len(replicas) == plan.gen.dp_g
    for members in replicas.values():
        assert sorted(t for t, _ in members) == list(range(plan.gen.tp_g))


def test_expected_volume_matches_the_hybridflow_formula_for_split_parameters():
    # a model of TP-split parameters only, equal per stage: received = needed - held = the paper's formula
    for (pp, tp, dp), (tp_g, dp_g) in [((2, 2, 1), (2, 2)), ((2, 2, 1), (1, 4)), ((1, 4, 1), (2, 2))]:
        specs = [ParamSpec(f"w{i}", (64, 16), torch.float32, stage=i % pp, split_dim=i % 2) for i in range(4)]
        model_bytes = sum(s.nbytes for s in specs)
        plan = ReshardPlan(specs, TrainLayout(pp, tp, dp), GenLayout(tp_g, dp_g))
        for r in range(plan.train.world):
            assert plan.held_bytes(r) == model_bytes // (pp * tp)
            received = plan.gen_shard_bytes(r) - plan.held_bytes(r)
            assert received == pytest.approx(paper_volume_bytes(model_bytes, plan, "regrouped"))


def test_plan_errors_name_the_problem():
    model = _model()
    specs = specs_from_model(model, 1)
    with pytest.raises(ValueError, match="must divide training TP"):
        ReshardPlan(specs, TrainLayout(1, 4, 2), GenLayout(8, 1))
    with pytest.raises(ValueError, match="same ranks"):
        ReshardPlan(specs, TrainLayout(1, 2, 1), GenLayout(1, 4))
    with pytest.raises(
        ValueError, match="q_proj.weight.: 4 units along dim 0 .size 32. cannot be split evenly over tp=8"
    ):
        ReshardPlan(specs, TrainLayout(1, 8, 1), GenLayout(8, 1))
    with pytest.raises(ValueError, match="not divisible by the pipeline size pp=3"):
        specs_from_model(model, 3)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.weird'"):
        hf_param_specs([("model.layers.0.mlp.weird", (4,), torch.float32)], 2, 1)
    with pytest.raises(ValueError, match="TrainLayout.tp"):
        TrainLayout(1, 0, 1)


# ------------------------------------------------------------------------------- 4 gloo processes


def _scenarios(rank: int, world: int, out_dir: str) -> None:
    """Runs in each of 4 spawned gloo ranks: every layout x both paths, then tp_g=1 into the native engine."""
    from workers.rollout.native.engine import EngineConfig, NativeEngine
    from workers.rollout.sampling import SamplingParams
    from workers.weight_sync.reshard import Resharder
    from workers.weight_sync.reshard_plan import expected_gen_shard, training_shard

    model = _model(seed=0)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    res: dict = {"layouts": {}}
    for train, gen in LAYOUTS:
        plan = _plan(model, train, gen)
        local = training_shard(full, plan, rank)
        for mode in ("regrouped", "naive"):
            resharder = Resharder(plan, mode)
            # regrouped streams in buckets; naive gathers the whole model at once ("gather, then slice")
            got = resharder.reshard(local, bucket_bytes=BUCKET if mode == "regrouped" else None)
            expected = expected_gen_shard(full, plan, rank)
            mismatched = [
                n for n in expected if n not in got or not torch.equal(got[n], expected[n].contiguous())
            ]
            res["layouts"][(train, gen, mode)] = {
                "names": sorted(got),
                "mismatched": mismatched,
                "stats": resharder.stats.as_dict(),
                "bucket_bytes": list(resharder.stats.bucket_bytes),
            }
            resharder.destroy()

    # tp_g = 1: every rank streams full tensors into its own native engine (built from other weights)
    plan = _plan(model, (2, 2, 1), (1, 4))
    resharder = Resharder(plan, "regrouped")
    engine = NativeEngine(_model(seed=1), config=EngineConfig(max_num_seqs=4, seed=0))
    engine.update_weights(resharder.named_tensors(training_shard(full, plan, rank), bucket_bytes=BUCKET))
    resharder.destroy()
    res["engine_weights_equal"] = all(torch.equal(t, full[n]) for n, t in engine.named_weights())
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    res["engine_tokens"] = [o[0].token_ids for o in engine.generate_batch(prompts, greedy)]
    reference = NativeEngine(model, config=EngineConfig(max_num_seqs=4, seed=0))
    res["reference_tokens"] = [o[0].token_ids for o in reference.generate_batch(prompts, greedy)]
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_in_processes(_scenarios, 4, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.mark.parametrize("mode", ["regrouped", "naive"])
@pytest.mark.parametrize("train,gen", LAYOUTS)
def test_every_generation_rank_gets_exactly_its_shard(four_ranks, train, gen, mode):
    model = _model()
    names = sorted(n for n, _ in model.named_parameters())
    for rank, res in enumerate(four_ranks):
        entry = res["layouts"][(train, gen, mode)]
        assert entry["names"] == names, f"rank {rank}"
        assert entry["mismatched"] == [], f"rank {rank}: wrong shards {entry['mismatched']}"


@pytest.mark.parametrize("train,gen", LAYOUTS)
def test_bytes_and_peak_memory_regrouped_vs_naive(four_ranks, train, gen):
    model = _model()
    plan = _plan(model, train, gen)
    model_bytes = sum(s.nbytes for s in plan.specs)
    replicated = sum(s.nbytes for s in plan.specs if s.split_dim is None)
    largest_need = max(plan.needed(0, s).nbytes for s in plan.specs)
    for rank, res in enumerate(four_ranks):
        reg = res["layouts"][(train, gen, "regrouped")]["stats"]
        naive = res["layouts"][(train, gen, "naive")]["stats"]
        held, need = plan.held_bytes(rank), plan.gen_shard_bytes(rank)
        # regrouped: receives exactly what it needs and does not hold (replicated params: one copy)
        own_replicated = sum(
            s.nbytes for s in plan.specs if s.split_dim is None and plan.contribution(rank, s) is not None
        )
        held_split = held - sum(s.nbytes for s in plan.specs if s.split_dim is None and plan.held(rank, s))
        assert reg["bytes_received"] == need - held_split - own_replicated, f"rank {rank}"
        # the HybridFlow formula, up to the replicated norms (which it does not model)
        assert abs(reg["bytes_received"] - paper_volume_bytes(model_bytes, plan, "regrouped")) <= replicated
        # naive: every rank assembles the whole model (minus what it sent itself)
        assert naive["bytes_received"] + naive["bytes_sent"] // max(1, naive["group_size"] - 1) == model_bytes
        # with tp_g == 1 every rank needs the whole model: nothing to save on bytes, only on memory
        if plan.gen.tp_g > 1:
            assert naive["bytes_received"] > reg["bytes_received"]
        else:
            assert naive["bytes_received"] == reg["bytes_received"]
        # bucketed regrouped transient memory stays within the bound (or one lone larger tensor)
        assert reg["peak_transient_bytes"] <= max(BUCKET, largest_need)
        assert naive["peak_transient_bytes"] == model_bytes and naive["buckets"] == 1
        assert reg["buckets"] > 1
        assert reg["gen_shard_bytes"] == need


def _bytes_by_stage(model, pp: int) -> tuple[list[int], list[int]]:
    """Bytes of the TP-split and of the replicated parameters on each of ``pp`` stages, from ``model``'s shapes
    alone: norms are replicated, every other weight is split; decoder layers in equal blocks of stages, the
    embedding on the first stage, the final norm and ``lm_head`` on the last."""
    n_layers = model.config.num_hidden_layers
    split, replicated = [0] * pp, [0] * pp
    for name, p in model.named_parameters():
        if name.startswith("model.layers."):
            stage = int(name.split(".")[2]) // (n_layers // pp)
        else:
            stage = 0 if name == "model.embed_tokens.weight" else pp - 1
        nbytes = p.numel() * p.element_size()
        if name.endswith("norm.weight"):
            replicated[stage] += nbytes
        else:
            split[stage] += nbytes
    return split, replicated


def test_bytes_sent_equal_bytes_received_over_all_ranks(four_ranks):
    """Each rank's sent and received bytes are the volume the layout implies, worked out here from the shapes
    (not from the plan): regrouped, a rank receives HybridFlow's ``M/tp_g - M/(tp*pp)`` of the split weights
    (the rest of its generation chunk, from its micro-DP group of ``pp*tp/tp_g`` ranks) plus the replicated
    ones it does not send itself; naive, the whole model but what it sends. A sender's buffer goes to every
    other member of its group, so the totals over ranks agree."""
    model = _model()
    for (pp, tp, dp), (tp_g, dp_g) in LAYOUTS:
        split, replicated = _bytes_by_stage(model, pp)
        S, Rb = sum(split), sum(replicated)
        assert all(s * pp == S for s in split)  # equal split bytes per stage: the paper's formula applies
        mu = tp // tp_g
        for mode in ("regrouped", "naive"):
            stats = [res["layouts"][((pp, tp, dp), (tp_g, dp_g), mode)]["stats"] for res in four_ranks]
            for rank, st in enumerate(stats):
                pp_rank, tp_rank = rank // (tp * dp), rank % tp
                if mode == "regrouped":
                    # a stage's replicated weights come from its group member with tp_rank % mu == 0
                    own_replicated = replicated[pp_rank] if tp_rank % mu == 0 else 0
                    group = pp * mu
                    received = (S // tp_g - S // (tp * pp)) + (Rb - own_replicated)
                else:  # gather over the model-parallel group: the replicated weights from tp_rank 0
                    own_replicated = replicated[pp_rank] if tp_rank == 0 else 0
                    group = pp * tp
                    received = (S - S // (tp * pp)) + (Rb - own_replicated)
                own = S // (tp * pp) + own_replicated  # what this rank broadcasts to its group
                where = ((pp, tp, dp), (tp_g, dp_g), mode, rank)
                assert st["group_size"] == group, where
                assert st["bytes_received"] == received, where
                assert st["bytes_sent"] == own * (group - 1), where
            total = sum(s["bytes_sent"] for s in stats)
            assert total == sum(s["bytes_received"] for s in stats)
            # every group passes its model share (regrouped: a generation chunk) to each member but its sender
            share = S // tp_g + Rb if mode == "regrouped" else S + Rb
            assert total == (pp * tp * dp // group) * (group - 1) * share, ((pp, tp, dp), (tp_g, dp_g), mode)


def test_tp_g1_weights_stream_into_the_native_engine(four_ranks):
    for rank, res in enumerate(four_ranks):
        assert res["engine_weights_equal"], f"rank {rank}"
        assert res["engine_tokens"] == res["reference_tokens"], f"rank {rank}"
        assert all(len(t) == 8 for t in res["engine_tokens"])
