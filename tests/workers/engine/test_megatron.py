"""Megatron-core engine (workers/engine/megatron): HF <-> Megatron conversion round trips, HF vs Megatron
logits and log-probs, Megatron vs FSDP engine training parity in one process, and TP=2 / PP=2 (1F1B) / DP=2
over 2 gloo processes matching one process: losses, grad norms, log-probs and updated weights; the same for
critics (values, value-loss steps) against the FSDP critic; checkpoint save/resume at TP=2 and PP=2 repeating
the uninterrupted steps exactly.

CPU only here: megatron-core runs with the stand-ins of workers/engine/megatron/cpu_compat.py."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import engine_testlib as T
import pytest
import torch

from tests.skips import skip_or_fail
from workers.distributed import run_in_processes
from workers.engine.megatron.hf_conversion import (
    ModelShape,
    hf_chunks,
    hf_chunks_from_megatron,
    megatron_from_hf_chunks,
    param_specs,
)

# find_spec, not importorskip: megatron-core itself is imported only in the processes that build engines
if importlib.util.find_spec("megatron.core") is None:
    skip_or_fail("megatron-core is not installed (pip install -e '.[megatron]')", allow_module_level=True)

STEPS = 2
MICRO = 2  # rows per micro-batch: 4 micro-batches of the 8-row batch (1F1B warm-up, steady state, cool-down)
TOL = 2e-5


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return T.make_model_dir(tmp_path_factory.mktemp("megatron_model"), seed=3)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/workers/conftest.py


# ------------------------------------------------------------------------------------ conversion only


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_megatron_hf_round_trip_is_exact(tied, tp, pp):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(T.tiny_config(tie_word_embeddings=tied))
    full = {n: p.detach() for n, p in hf.named_parameters()}
    shape = ModelShape.from_hf_config(hf.config)
    specs = param_specs(shape, pp)
    assert sorted(s.name for s in specs) == sorted(full)
    rebuilt: dict[str, dict[int, torch.Tensor]] = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            chunks = hf_chunks(full, specs, tp_rank, tp, pp_rank)
            if tied and pp > 1 and pp_rank == pp - 1:
                chunks["model.embed_tokens.weight"] = full["model.embed_tokens.weight"].chunk(tp)[tp_rank]
            meg = megatron_from_hf_chunks(chunks, shape, tp, pp_rank, pp)
            # Megatron's fused shapes: [q; k; v] per group, [gate; up]
            qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"]
            assert qkv.shape == (
                (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim // tp,
                shape.hidden_size,
            )
            assert meg["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] == 2 * shape.intermediate_size // tp
            back = hf_chunks_from_megatron(meg, shape, tp, pp_rank, pp)
            for name, tensor in back.items():
                assert torch.equal(tensor, chunks[name]), name
                rebuilt.setdefault(name, {})[tp_rank] = tensor
    for spec in specs:
        parts = rebuilt[spec.name]
        whole = (
            parts[0] if spec.split_dim is None else torch.cat([parts[i] for i in range(tp)], spec.split_dim)
        )
        assert torch.equal(whole, full[spec.name]), spec.name


def test_qkv_fusion_groups_query_heads_with_their_kv_head():
    torch.manual_seed(0)
    from transformers import Qwen2ForCausalLM

    hf = Qwen2ForCausalLM(T.tiny_config())  # 4 query heads, 2 KV heads, head_dim 16
    shape = ModelShape.from_hf_config(hf.config)
    full = {n: p.detach() for n, p in hf.named_parameters()}
    meg = megatron_from_hf_chunks(hf_chunks(full, param_specs(shape, 1), 0, 1, 0), shape, 1, 0, 1)
    qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"].reshape(2, 4, 16, -1)  # group, slot, dim
    q = full["model.layers.0.self_attn.q_proj.weight"].reshape(4, 16, -1)
    k = full["model.layers.0.self_attn.k_proj.weight"].reshape(2, 16, -1)
    v = full["model.layers.0.self_attn.v_proj.weight"].reshape(2, 16, -1)
    for g in range(2):
        assert torch.equal(qkv[g, 0], q[2 * g]) and torch.equal(qkv[g, 1], q[2 * g + 1])
        assert torch.equal(qkv[g, 2], k[g]) and torch.equal(qkv[g, 3], v[g])


def test_parallel_sizes_that_cut_heads_or_layers_are_errors():
    from transformers import Qwen2Config

    shape = ModelShape.from_hf_config(T.tiny_config())
    with pytest.raises(
        ValueError, match="num_key_value_heads=2 is not divisible by tensor_model_parallel_size=4"
    ):
        shape.check_parallel(4, 1)
    with pytest.raises(
        ValueError, match="num_hidden_layers=2 is not divisible by pipeline_model_parallel_size=3"
    ):
        shape.check_parallel(1, 3)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        cfg = Qwen2Config()
        cfg.model_type = "gpt2"
        ModelShape.from_hf_config(cfg)


# ------------------------------------------------------------------------------- one process (spawned)


def _single(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    """World 1: HF vs Megatron logits and log-probs, round trip through the engine, Megatron vs FSDP train."""
    from megatron.core import parallel_state as ps

    from workers.engine import FSDPEngine, TrainEngine
    from workers.engine.megatron.engine import MegatronEngine

    res: dict = {}
    hf = _hf(model_dir)
    eng = MegatronEngine(T.engine_config(model_dir))
    res["is_train_engine"] = isinstance(eng, TrainEngine)
    # logits of unpadded sequences
    ids = torch.randint(3, T.VOCAB, (3, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        res["megatron_logits"] = eng.logits(ids).float()
        res["hf_logits"] = hf(input_ids=ids).logits.float()
    # HF -> Megatron -> HF through the engine
    hf_params = {n: p.detach() for n, p in hf.named_parameters()}
    back = dict(eng.full_state_dict_iter())
    res["initial"] = {n: t.clone() for n, t in hf_params.items()}
    res["round_trip_names_equal"] = sorted(back) == sorted(hf_params)
    res["round_trip_exact"] = all(torch.equal(back[n], hf_params[n]) for n in hf_params)
    # log-probs on a padded batch
    batch = T.make_batch(8, seed=11)
    res["log_probs"] = eng.compute_log_prob(batch, micro_batch_size=MICRO, calculate_entropy=True)
    # training: Megatron engine vs FSDP engine on the same batches
    fsdp = FSDPEngine(T.engine_config(model_dir))
    res["megatron_train"], res["fsdp_train"] = [], []
    for s in range(STEPS):
        b = T.make_batch(8, seed=100 + s)
        res["megatron_train"].append(
            eng.train_step(b, T.pg_loss, micro_batch_size=MICRO, calculate_entropy=True)
        )
        res["fsdp_train"].append(
            fsdp.train_step(b, T.pg_loss, micro_batch_size=MICRO, calculate_entropy=True)
        )
    res["megatron_params"] = dict(eng.full_state_dict_iter())
    res["fsdp_params"] = {k: v.clone() for k, v in fsdp.full_state_dict_iter()}
    res["critic"] = _critic_run(MegatronEngine(T.engine_config(model_dir, value_head=True)))
    res["fsdp_critic"] = _critic_run(FSDPEngine(T.engine_config(model_dir, value_head=True)))
    eng.destroy()
    assert not ps.model_parallel_is_initialized()
    torch.save(res, Path(out_dir) / "single.pt")


def _critic_run(engine, rows=slice(None)) -> dict:
    """A critic's values on one batch, two value-loss steps, and its weights afterwards."""
    shard = lambda b: {k: v[rows] for k, v in b.items()}  # noqa: E731
    out = {"values": engine.compute_values(shard(T.make_batch(8, seed=11)), micro_batch_size=MICRO)["values"]}
    out["train"] = [
        engine.train_step(shard(T.make_batch(8, seed=200 + s)), T.value_loss, micro_batch_size=MICRO)
        for s in range(STEPS)
    ]
    out["params"] = {k: v.clone() for k, v in engine.full_state_dict_iter()}
    return out


def _pair(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    """World 2: TP=2, PP=2 (1F1B) and DP=2 in turn, same batches as the single-process run."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from workers.engine import MegatronConfig
    from workers.engine.megatron.engine import MegatronEngine

    res = {}
    for label, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2), ("dp2", 1, 1)):
        eng = MegatronEngine(T.engine_config(model_dir), MegatronConfig(tp, pp))
        entry: dict = {"schedule": get_forward_backward_func().__name__}
        batch = T.make_batch(8, seed=11)
        rows = slice(None) if eng.dp_size == 1 else slice(4 * eng.dp_rank, 4 * eng.dp_rank + 4)
        shard = lambda b, rows=rows: {k: v[rows] for k, v in b.items()}  # noqa: E731
        entry["log_probs"] = eng.compute_log_prob(
            shard(batch), micro_batch_size=MICRO, calculate_entropy=True
        )
        entry["train"] = [
            eng.train_step(
                shard(T.make_batch(8, seed=100 + s)),
                T.pg_loss,
                micro_batch_size=MICRO,
                calculate_entropy=True,
            )
            for s in range(STEPS)
        ]
        entry["params"] = dict(eng.full_state_dict_iter())
        # generation shards for tp_g = tp (the training chunks, reused in place) straight from the engine
        entry["gen_shard"] = {n: t.clone() for n, t in eng.generation_shard_iter(tp_g=tp)}
        entry["hf_shard_names"] = sorted(eng.hf_shard())
        if label != "dp2":  # the critic under TP=2 and PP=2
            entry["critic"] = _critic_run(
                MegatronEngine(T.engine_config(model_dir, value_head=True), MegatronConfig(tp, pp))
            )
        res[label] = entry
        eng.destroy()
    torch.save(res, Path(out_dir) / f"pair{rank}.pt")


def _resume(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    """World 2 at TP=2, PP=2 and DP=2 in turn: two steps, a checkpoint, two more steps; a fresh engine loads
    the checkpoint and repeats the last two. Then the TP=2 checkpoint offered to the PP=2 engine."""
    from workers.engine import CheckpointError, MegatronConfig, load_checkpoint, save_checkpoint
    from workers.engine.megatron.engine import MegatronEngine

    res: dict = {}
    batches = [T.make_batch(8, seed=300 + s) for s in range(4)]
    for label, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2), ("dp2", 1, 1)):
        run = lambda eng, b: eng.train_step(b, T.pg_loss, micro_batch_size=MICRO, shuffle=True)  # noqa: E731
        eng = MegatronEngine(T.engine_config(model_dir), MegatronConfig(tp, pp))
        for b in batches[:2]:
            run(eng, b)
        path = save_checkpoint(eng, str(Path(out_dir) / label), extra={"data_pos": 2})
        entry = {"full": [run(eng, b) for b in batches[2:]], "full_params": dict(eng.full_state_dict_iter())}
        eng.destroy()
        eng = MegatronEngine(T.engine_config(model_dir), MegatronConfig(tp, pp))
        entry["extra"], entry["step"] = load_checkpoint(eng, path), eng.global_step
        entry["resumed"] = [run(eng, b) for b in batches[2:]]
        entry["resumed_params"] = dict(eng.full_state_dict_iter())
        entry["files"] = sorted(p.name for p in (Path(path) / "model_optim").iterdir())
        entry["bytes"] = sum(p.stat().st_size for p in (Path(path) / "model_optim").glob("*.distcp"))
        if label == "pp2":
            try:
                load_checkpoint(eng, str(Path(out_dir) / "tp2" / "step_2"))
            except CheckpointError as e:
                entry["layout_error"] = str(e)
        eng.destroy()
        res[label] = entry
    torch.save(res, Path(out_dir) / f"resume{rank}.pt")


@pytest.fixture(scope="module")
def resumed(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_resume")
    run_in_processes(_resume, 2, model_dir, str(out))
    return [torch.load(out / f"resume{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_single")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_in_processes(_single, 1, model_dir, str(out))
    return torch.load(out / "single.pt", weights_only=False)


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_pair")
    run_in_processes(_pair, 2, model_dir, str(out))
    return [torch.load(out / f"pair{r}.pt", weights_only=False) for r in range(2)]


def test_megatron_engine_is_a_train_engine(single):
    assert single["is_train_engine"]


def test_megatron_logits_match_hf(single):
    diff = (single["megatron_logits"] - single["hf_logits"]).abs().max()
    assert diff < 1e-4, diff


def test_engine_round_trip_to_hf_is_exact(single):
    assert single["round_trip_names_equal"] and single["round_trip_exact"]


def test_log_probs_match_hf_on_a_padded_batch(single, model_dir):
    batch = T.make_batch(8, seed=11)
    hf = _hf(model_dir)
    r = batch["responses"].shape[1]
    with torch.no_grad():
        logits = hf(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits.float()[:, -r - 1 : -1]
    valid = batch["attention_mask"][:, -r:].float()
    ref = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1) * valid
    got = single["log_probs"]
    assert got["log_probs"].shape == (8, r)
    assert (got["log_probs"] - ref).abs().max() < 1e-5
    assert (got["log_probs"][valid == 0] == 0).all()
    p = torch.softmax(logits, -1)
    ref_entropy = -(p * torch.log_softmax(logits, -1)).sum(-1) * valid
    assert (got["entropy"] - ref_entropy).abs().max() < 1e-5


def test_megatron_training_matches_the_fsdp_engine(single):
    for m, f in zip(single["megatron_train"], single["fsdp_train"]):
        assert m["loss"] == pytest.approx(f["loss"], rel=1e-5, abs=1e-7)
        assert m["grad_norm"] == pytest.approx(f["grad_norm"], rel=1e-5)
        assert m["lr"] == pytest.approx(f["lr"])
        assert m["ratio_mean"] == pytest.approx(f["ratio_mean"], rel=1e-5)
    for name, ref in single["fsdp_params"].items():
        assert (single["megatron_params"][name] - ref).abs().max() < TOL, name
    moved = max((single["megatron_params"][n] - p).abs().max() for n, p in single["initial"].items())
    assert moved > 1e-3  # the steps did change the weights


@pytest.mark.parametrize("label", ["tp2", "pp2", "dp2"])
def test_two_ranks_match_one_process(pair, single, label, model_dir):
    specs = {s.name: s for s in param_specs(ModelShape.from_hf_config(_hf(model_dir).config), 1)}
    expected_schedule = (
        "forward_backward_pipelining_without_interleaving"
        if label == "pp2"
        else "forward_backward_no_pipelining"
    )
    for rank, res in enumerate(pair):
        entry = res[label]
        assert entry["schedule"] == expected_schedule
        rows = slice(None) if label != "dp2" else slice(4 * rank, 4 * rank + 4)
        for key in ("log_probs", "entropy"):
            assert (entry["log_probs"][key] - single["log_probs"][key][rows]).abs().max() < 1e-5, (
                label,
                rank,
                key,
            )
        for got, ref in zip(entry["train"], single["megatron_train"]):
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), (label, rank)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (label, rank)
            assert got["global_step"] == ref["global_step"]
        for name, ref in single["megatron_params"].items():
            assert (entry["params"][name] - ref).abs().max() < TOL, (label, rank, name)
        tp = 2 if label == "tp2" else 1
        for name, chunk in entry["gen_shard"].items():
            want = specs[name].chunk(entry["params"][name], rank if tp == 2 else 0, tp)
            assert torch.equal(chunk, want), (label, rank, name)


def _assert_critic_close(got: dict, ref: dict, what) -> None:
    assert (got["values"] - ref["values"]).abs().max() < 1e-5, what
    for g, r in zip(got["train"], ref["train"]):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7), what
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), what
    assert sorted(got["params"]) == sorted(ref["params"]), what
    for name, t in ref["params"].items():
        assert (got["params"][name] - t).abs().max() < TOL, (what, name)


def test_megatron_critic_matches_the_fsdp_critic(single):
    assert "score.weight" in single["critic"]["params"] and "lm_head.weight" not in single["critic"]["params"]
    _assert_critic_close(single["critic"], single["fsdp_critic"], "megatron vs fsdp critic")
    assert single["critic"]["values"].abs().max() > 0


@pytest.mark.parametrize("label", ["tp2", "pp2"])
def test_two_rank_critics_match_one_process(pair, single, label):
    for rank, res in enumerate(pair):
        _assert_critic_close(res[label]["critic"], single["critic"], (label, rank))


@pytest.mark.parametrize("label", ["tp2", "pp2", "dp2"])
def test_resumed_checkpoint_repeats_the_uninterrupted_steps(resumed, label):
    for rank, res in enumerate(resumed):
        entry = res[label]
        assert entry["extra"] == {"data_pos": 2} and entry["step"] == 2, (label, rank)
        for got, ref in zip(entry["resumed"], entry["full"], strict=True):
            assert got["losses"] == ref["losses"] and got["grad_norms"] == ref["grad_norms"], (label, rank)
            assert got["lr"] == ref["lr"] and got["global_step"] == ref["global_step"], (label, rank)
        for name, ref in entry["full_params"].items():
            assert torch.equal(entry["resumed_params"][name], ref), (label, rank, name)
        if label != "dp2":  # each rank wrote its own shard (DP replicas share keys: DCP writes them once)
            assert entry["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert resumed[0]["tp2"]["full"][-1]["loss"] != resumed[0]["tp2"]["full"][0]["loss"]  # the steps differ
    # DP replicas hold one copy of the model + optimizer between them, as TP=2's two shards do
    assert 0.9 < resumed[0]["dp2"]["bytes"] / resumed[0]["tp2"]["bytes"] < 1.1
    for rank in range(2):
        assert (
            "tensor_model_parallel_size=2 in the checkpoint, 1 here, pipeline_model_parallel_size=1 in the "
            "checkpoint, 2 here" in resumed[rank]["pp2"]["layout_error"]
        )


def test_pipeline_stages_hold_their_own_layers(pair):
    first, last = pair[0]["pp2"]["hf_shard_names"], pair[1]["pp2"]["hf_shard_names"]
    assert "model.embed_tokens.weight" in first and "model.norm.weight" in last
    assert all(".layers.0." in n or "embed" in n for n in first)
    assert all(".layers.1." in n or "norm.weight" == n.split("model.")[-1] for n in last)


# --------------------------------------------------------------------------------------- cpu_compat


def test_cpu_rng_tracker_forks_a_named_stream_and_restores_the_outer_one():
    from workers.engine.megatron.cpu_compat import CpuRNGStatesTracker

    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    torch.manual_seed(0)
    outer = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(3)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)  # the named stream continues where it stopped
    assert torch.equal(torch.rand(3), outer)  # the caller's stream never moved
    g = torch.Generator().manual_seed(7)
    assert torch.equal(first, torch.rand(3, generator=g)) and torch.equal(second, torch.rand(3, generator=g))
    with pytest.raises(ValueError, match="seed 7 already tracked"):
        tracker.add("other", 7)
    with pytest.raises(KeyError, match="'nope' was not added"):
        with tracker.fork("nope"):
            pass


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the CPU stand-ins, which a GPU machine never uses"
)
def test_cuda_device_arguments_map_to_cpu_inside_the_scope_only():
    from workers.engine.megatron.cpu_compat import cpu_device_scope

    with cpu_device_scope():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.ones(1).to("cuda").device.type == "cpu"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2, device="cuda")
