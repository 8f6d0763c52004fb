"""workers/models/memory.py against what the code really allocates: the parameter count of the HF model (dense
and MoE, by FSDP unit), the native engine's KV cache and weights (one rank and tensor parallel), the train-state
and reference bytes of FSDP-sharded engines, AdamW's moments in the param dtype, the saved activations of a MoE
forward; the sizing answer (`size_colocated_run`) and docs/sizing.md's table, recomputed; and
workers/device_memory.py on CPU (the CUDA peaks are checked by the GPU check: benchmarks/bench_grpo_step.py,
BENCHMARKS.md)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from workers.device_memory import PeakDeviceMemory
from workers.distributed import run_in_processes
from workers.models.memory import (
    GIB,
    RunSettings,
    activation_bytes,
    chunk_tokens,
    decode_graph_bytes,
    estimate_colocated_step,
    estimate_run,
    kv_bytes,
    layer_activation_bytes,
    num_params,
    param_counts,
    size_colocated_run,
)
from workers.rollout.native import EngineConfig, NativeEngine

ROOT = Path(__file__).resolve().parents[2]


def _config(tie: bool = True):
    return transformers.Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie,
    )  # fmt: skip


def test_parameter_count_equals_the_models_own():
    for tie in (True, False):
        model = transformers.Qwen2ForCausalLM(_config(tie))
        assert num_params(_config(tie)) == sum(p.numel() for p in model.parameters())


def test_kv_cache_equals_the_native_engines_allocation():
    config = _config()
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=6, max_model_len=40, eos_token_ids=[]))
    engine.generate_batch([[1, 2, 3]], None)  # the cache exists once the engine has generated
    cache = engine.model.k_cache
    assert cache is not None
    allocated = 2 * cache.numel() * cache.element_size()  # k and v
    assert kv_bytes(config, 6, 40, torch.bfloat16) == allocated


def test_train_state_is_sixteen_bytes_per_fp32_parameter_sharded_and_stages_add_up():
    config = _config()
    p = num_params(config)
    one = estimate_colocated_step(config, max_num_seqs=4, max_model_len=32, micro_batch_tokens=64,
                                  micro_batch_response_tokens=32)  # fmt: skip
    two = estimate_colocated_step(config, fsdp_world=2, max_num_seqs=4, max_model_len=32, micro_batch_tokens=64,
                                  micro_batch_response_tokens=32)  # fmt: skip
    assert one.train_state == 16 * p and two.train_state == 8 * p
    assert one.fsdp_gather == 0 and two.fsdp_gather > 0  # one fp32 rank gathers nothing
    autocast = estimate_colocated_step(config, compute_dtype=torch.bfloat16, max_num_seqs=4, max_model_len=32,
                                       micro_batch_tokens=64, micro_batch_response_tokens=32)  # fmt: skip
    assert autocast.fsdp_gather == 2 * p  # one rank under autocast: a bf16 copy of every weight
    # trainer offloaded; the decode graphs' pool is held while generating (cuda_graphs defaults to on)
    assert one.gen == one.rollout_weights + one.kv_cache + one.sampling_logits + one.decode_graphs
    resident = estimate_colocated_step(config, max_num_seqs=4, max_model_len=32, micro_batch_tokens=64,
                                       micro_batch_response_tokens=32, trainer_offloaded_in_gen=False)  # fmt: skip
    assert resident.gen == one.gen + one.train_state
    assert one.update_actor == one.train_state + one.rollout_weights + one.activations
    # the chunked vocabulary head: three fp32 [chunk, V] buffers (here the 32 response tokens fit one chunk) and
    # the fp32 gradient of the head, whatever the entropy; the rest grows with the micro-batch's tokens
    layers = config.num_hidden_layers * (6 * config.hidden_size + 3 * config.intermediate_size)
    v, h = config.vocab_size, config.hidden_size
    assert chunk_tokens(v) > 32 and one.activations == 4 * 64 * layers + 3 * 4 * 32 * v + 4 * v * h
    long = estimate_colocated_step(config, max_num_seqs=4, max_model_len=32, micro_batch_tokens=64 + chunk_tokens(v),
                                   micro_batch_response_tokens=32 + chunk_tokens(v))  # fmt: skip
    assert (
        long.activations - one.activations
        == 4 * chunk_tokens(v) * layers + 3 * 4 * (chunk_tokens(v) - 32) * v
    )


def test_decode_graphs_pool_is_logits_plus_sampler_temporaries_plus_one_steps_layer_intermediates():
    config = _config()  # V 512, H 64, I 160, 4 heads, 2 kv heads
    S, L, rb = 6, 48, 2  # max_num_seqs, max_model_len, bf16 rollout
    kw = dict(rollout_dtype=torch.bfloat16, max_num_seqs=S, max_model_len=L, micro_batch_tokens=64,
              micro_batch_response_tokens=32)  # fmt: skip
    on = estimate_colocated_step(config, **kw)  # cuda_graphs defaults to on
    # logits, log_softmax, exp, cumsum (fp32 [S, V] each); the key mask ([S, L] rb, its bool source, its copy per
    # kv head); the larger of attention (scores rb, fp32 softmax, its rb cast: [S * heads, L]) and the MLP (4 [S, I])
    sampler = 4 * 4 * S * 512
    mask = S * L * (rb + 1 + 2 * rb)
    attention, mlp = S * 4 * L * (2 * rb + 4), 4 * S * 160 * rb
    assert attention > mlp
    assert on.decode_graphs == decode_graph_bytes(config, S, L, torch.bfloat16) == sampler + mask + attention
    assert on.terms("gen")["decode_graphs"] == on.decode_graphs
    off = estimate_colocated_step(config, cuda_graphs=False, **kw)
    assert off.decode_graphs == 0 and "decode_graphs" in off.terms("gen")
    assert (
        on.gen - off.gen == on.decode_graphs and on.update_actor == off.update_actor
    )  # freed with the cache
    kept = estimate_colocated_step(config, free_cache_engine=False, **kw)  # the cache and its graphs stay
    assert kept.update_actor - on.update_actor == on.kv_cache + on.decode_graphs
    assert kept.terms("update_actor")["decode_graphs"] == on.decode_graphs
    # auto turns them off where the engine cannot capture: rollout tp > 1, a mixture of experts
    assert estimate_colocated_step(config, rollout_tp=2, **kw).decode_graphs == 0
    assert decode_graph_bytes(_moe_config(), S, L, torch.bfloat16) == 0
    # RunSettings carries the switch (rollout.cuda_graphs)
    settings = RunSettings(devices=1, max_num_seqs=S, prompt_length=8, response_length=L - 8,
                           rollout_dtype=torch.bfloat16)  # fmt: skip
    assert estimate_run(config, settings, 64).decode_graphs == on.decode_graphs
    assert estimate_run(config, replace(settings, cuda_graphs=False), 64).decode_graphs == 0


def _moe_config(**overrides):
    kw = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[1], tie_word_embeddings=False, max_position_embeddings=256,
    )  # fmt: skip
    kw.update(overrides)
    return transformers.Qwen3MoeConfig(**kw)


def test_moe_parameter_counts_equal_the_models_own_by_fsdp_unit():
    from workers.engine.fsdp_engine import decoder_layers

    config = _moe_config()  # layers 0 and 2 sparse, 1 dense (mlp_only_layers)
    model = transformers.Qwen3MoeForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    layers = [sum(p.numel() for p in m.parameters()) for m in decoder_layers(model)]
    counts = param_counts(config)
    assert num_params(config) == counts.total == total  # every expert counted
    assert counts.largest_layer == max(layers) and counts.root == total - sum(layers)
    h, e, im = config.hidden_size, config.num_experts, config.moe_intermediate_size
    assert max(layers) - min(layers) == e * 3 * h * im + e * h - 3 * h * config.intermediate_size


def _saved_bytes_per_token(config, tokens: int = 128) -> float:
    """Bytes of the tensors a forward of the HF model saves for backward, parameters excluded, per token."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=torch.randint(0, config.vocab_size, (1, tokens)))
    return sum(saved.values()) / tokens


def test_moe_activations_scale_with_top_k_times_moe_intermediate_not_num_experts():
    base = _moe_config(mlp_only_layers=[])
    per_token = sum(layer_activation_bytes(base, 4))

    def delta(**kw) -> tuple[float, float]:
        """(estimated, measured) growth of a forward's saved bytes per token when ``kw`` changes."""
        other = _moe_config(mlp_only_layers=[], **kw)
        return (
            sum(layer_activation_bytes(other, 4)) - per_token,
            _saved_bytes_per_token(other) - _saved_bytes_per_token(base),
        )

    layers, h = base.num_hidden_layers, base.hidden_size
    k_est, k_measured = delta(num_experts_per_tok=4)  # 2 more experts per token
    assert k_est == layers * 2 * (3 * base.moe_intermediate_size + 2 * h) * 4
    im_est, im_measured = delta(moe_intermediate_size=64)
    assert im_est == layers * base.num_experts_per_tok * 3 * 32 * 4
    e_est, e_measured = delta(num_experts=16)  # twice the experts: only the router's [tokens, E] grows
    assert e_est == layers * 8 * (4 + 4)
    # the HF forward saves a little more per computed expert than the model counts (an fp32 CPU autograd graph:
    # four intermediate-sized tensors per expert where the model, like its dense term, counts three)
    assert k_est <= k_measured <= 1.25 * k_est
    assert im_measured == pytest.approx(4 / 3 * im_est, rel=0.02)
    dense, wider = (
        _moe_config(mlp_only_layers=[0, 1, 2]),
        _moe_config(mlp_only_layers=[0, 1, 2], intermediate_size=192),
    )
    dense_est = sum(layer_activation_bytes(wider, 4)) - sum(layer_activation_bytes(dense, 4))
    dense_measured = _saved_bytes_per_token(wider) - _saved_bytes_per_token(dense)
    assert dense_est == layers * 3 * 96 * 4 and dense_measured == pytest.approx(4 / 3 * dense_est, rel=0.02)
    # the router's softmax only (the engine's route recorder also keeps the logits, which the model counts)
    assert 0 < e_measured <= e_est and e_measured < 0.05 * k_measured
    # and the whole forward grows with the number of tokens only through these per-token terms
    assert activation_bytes(base, 2000, 0, 2) - activation_bytes(base, 1000, 0, 2) == 1000 * sum(
        layer_activation_bytes(base, 2)
    )


def test_activation_checkpointing_keeps_one_hidden_state_per_layer_and_the_engine_turns_it_on(tmp_path):
    from workers.config import ModelConfig
    from workers.engine import FSDPEngine
    from workers.roles.common import engine_config

    config = _moe_config()
    per_layer = layer_activation_bytes(config, 2)
    full = activation_bytes(config, 1000, 100, 2)
    ckpt = activation_bytes(config, 1000, 100, 2, activation_checkpointing=True)
    head = activation_bytes(config, 0, 100, 2)
    assert full - head == 1000 * sum(per_layer)
    assert ckpt - head == 1000 * (config.num_hidden_layers * config.hidden_size * 2 + max(per_layer))
    # what the model assumes of model.activation_checkpointing: HF gradient checkpointing of every decoder layer
    transformers.Qwen2ForCausalLM(_config()).save_pretrained(tmp_path)
    engine = FSDPEngine(
        engine_config(ModelConfig(path=str(tmp_path), activation_checkpointing=True), optim=None)
    )
    layers = engine.model.model.layers
    assert len(layers) == 3 and all(layer.gradient_checkpointing for layer in layers)


def test_adamw_keeps_its_moments_in_the_parameters_dtype():
    from workers.engine.base import OptimConfig
    from workers.engine.optim import build_optimizer

    config = _config()
    p = num_params(config)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    optimizer, _ = build_optimizer(model, OptimConfig())
    assert optimizer is not None
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    grads = [q.grad for q in model.parameters() if q.grad is not None]
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *grads, *state])
    est = estimate_colocated_step(config, param_dtype=torch.bfloat16, max_num_seqs=1, max_model_len=8,
                                  micro_batch_tokens=8, micro_batch_response_tokens=4)  # fmt: skip
    assert held == est.train_state == 8 * p  # bf16 params, grads and both moments


def _sharded_state(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    """On each gloo rank: this rank's bytes of the reference engine (as RefWorker builds it), of the actor's
    params + grads + AdamW state after a step, and of a tensor-parallel native engine's weights and KV cache."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from workers.config import ModelConfig
    from workers.engine import FSDPEngine
    from workers.engine.base import OptimConfig
    from workers.roles.common import engine_config

    def local_bytes(tensors) -> int:
        out = 0
        for t in tensors:
            t = t.to_local() if isinstance(t, DTensor) else t
            out += t.numel() * t.element_size()
        return out

    model = ModelConfig(path=model_dir)  # model.dtype float32, as the recipes default
    ref = FSDPEngine(engine_config(model, optim=None))
    actor = FSDPEngine(engine_config(model, optim=OptimConfig()))
    assert actor.optimizer is not None
    for p in actor.model.parameters():
        p.grad = torch.zeros_like(p)
    actor.optimizer.step()
    state = [t for s in actor.optimizer.state.values() for k, t in s.items() if k != "step"]
    grads = [p.grad for p in actor.model.parameters() if p.grad is not None]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to(torch.bfloat16)
    native = NativeEngine(hf, config=EngineConfig(max_num_seqs=3, max_model_len=24, eos_token_ids=[]),
                          tp_group=dist.group.WORLD)  # fmt: skip
    kv_shape = native.model.kv_shape()
    result = {
        "ref_sharded": ref.use_fsdp,
        "reference": local_bytes(ref.model.parameters()),
        "train_state": local_bytes([*actor.model.parameters(), *grads, *state]),
        "rollout_weights": native.model.store.nbytes(),
        "kv_cache": 2 * torch.Size(kv_shape).numel() * 2,
    }
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def test_reference_and_train_state_shard_over_the_fsdp_world_and_tp_splits_the_rollout_layers(tmp_path):
    config = _config(tie=False)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "model")
    run_in_processes(_sharded_state, 2, str(tmp_path / "model"), str(tmp_path))
    est = estimate_colocated_step(config, fsdp_world=2, reference=True, rollout_dtype=torch.bfloat16, rollout_tp=2,
                                  max_num_seqs=3, max_model_len=24, micro_batch_tokens=8,
                                  micro_batch_response_tokens=4)  # fmt: skip
    counts, p = param_counts(config), num_params(config)
    assert est.reference == 4 * p // 2 and est.train_state == 16 * p // 2
    assert est.rollout_weights == 2 * counts.root + 2 * (p - counts.root) // 2
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["ref_sharded"]  # RefWorker's engine is FSDP-sharded like the actor's
        for term in ("reference", "train_state", "kv_cache"):
            assert got[term] == getattr(est, term), (rank, term, got[term], getattr(est, term))
        # the layers' norms are replicated too, which the model leaves out (two [H] weights per layer)
        norms = config.num_hidden_layers * 2 * config.hidden_size * 2
        assert 0 <= got["rollout_weights"] - est.rollout_weights <= norms // 2


def _sizing_settings(**kw) -> RunSettings:
    return RunSettings(**{**dict(devices=2, max_num_seqs=4, prompt_length=16, response_length=48), **kw})


def test_the_sizing_answer_is_the_largest_budget_under_the_limit_and_grows_with_memory():
    config = _config(tie=False)
    counts = param_counts(config)
    settings = _sizing_settings(activation_checkpointing=False)
    answers = [
        size_colocated_run(config, gib, settings, step=64, counts=counts) for gib in (0.01, 0.02, 0.05, 0.1)
    ]
    budgets = [a.max_token_len for a in answers]
    assert all(b is not None for b in budgets) and budgets == sorted(budgets) and budgets[0] < budgets[-1]
    for a in answers:
        assert a.max_token_len is not None and a.max_token_len % 64 == 0 and a.max_token_len >= 64
        assert a.estimate.update_actor <= a.limit_bytes == int(a.gib * GIB * 0.9)
        assert a.estimate == estimate_run(config, settings, a.max_token_len, counts)
        # a step more does not fit: it is the largest
        assert estimate_run(config, settings, a.max_token_len + 64, counts).update_actor > a.limit_bytes
        assert a.estimate.gen <= a.limit_bytes
    # checkpointing lets a larger micro-batch fit in the same memory; more devices shard the state
    ckpt = size_colocated_run(
        config, 0.1, replace(settings, activation_checkpointing=True), step=64, counts=counts
    )
    wide = size_colocated_run(config, 0.1, replace(settings, devices=8), step=64, counts=counts)
    at_01 = answers[3].max_token_len  # the same 0.1 GiB on 2 devices, no checkpointing
    assert at_01 is not None and ckpt.max_token_len is not None and wide.max_token_len is not None
    assert ckpt.max_token_len > at_01 and wide.max_token_len >= at_01


def test_the_sizing_answer_names_the_term_that_does_not_fit():
    config = _config(tie=False)
    too_small = size_colocated_run(config, 0.0005, _sizing_settings(), step=64)
    assert not too_small.fits and too_small.reason.startswith("gen ")
    # a KV cache (and its decode graphs' pool) that fits generation but leaves no room for one sequence's update
    # when it is kept
    kv = size_colocated_run(
        config, 0.02, _sizing_settings(max_num_seqs=475, free_cache_engine=False), step=64
    )
    assert kv.fits is False and kv.reason.startswith("update_actor ")
    assert kv.reason.split(": ", 1)[1].startswith("kv_cache")  # the largest term first


def _table(markdown: str, header_start: str) -> list[list[str]]:
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [rows[0], *rows[2:]]  # the header and the body, without the |---| line


def test_docs_sizing_table_is_what_the_cli_computes():
    from benchmarks.size_run import DOCS_COLUMNS, DOCS_GIB, DOCS_ROWS, PRESETS, docs_table

    page = (ROOT / "docs" / "sizing.md").read_text(encoding="utf-8")
    header = "| " + " | ".join(DOCS_COLUMNS[:2])
    documented = _table(page, header)
    computed = _table(docs_table(), header)
    assert documented[0] == computed[0] == DOCS_COLUMNS
    assert len(documented) == len(computed)
    for doc_row, row in zip(documented[1:], computed[1:], strict=True):
        assert doc_row == row, (
            f"docs/sizing.md says {doc_row}, python -m benchmarks.size_run --docs says {row}"
        )
    # every number set in bold in the prose is one of the table's cells
    for number in re.findall(r"\*\*(\d[\d,.]*)\*\*", page):
        assert any(number in r for r in computed[1:]), number
    # and the others it quotes: the presets' parameter counts and the usable memory after the margin
    for preset in ("qwen2.5-7b", "qwen3-30b-a3b"):
        assert f"{param_counts(PRESETS[preset]()).total / 1e9:.2f}B" in page
    limit = size_colocated_run(PRESETS["qwen2.5-7b"](), DOCS_GIB, DOCS_ROWS[0][1]).limit_bytes / GIB
    assert f"of the {limit:.1f} usable" in page
    # docs/recipes.md's section quotes budgets from the same table
    recipes = (
        (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8").split("## Sizing a run on a GPU", 1)[1]
    )
    quoted = re.findall(r"\b\d{1,3}(?:,\d{3})+\b", recipes)
    assert quoted and all(any(n in r for r in computed[1:]) for n in quoted), quoted


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_peak_device_memory_reports_nothing_without_cuda():
    with PeakDeviceMemory("gen") as peak:
        torch.zeros(1000)
    assert peak.metrics == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_peak_device_memory_is_the_stages_own_peak():
    torch.zeros(1 << 28, device="cuda")  # 1 GiB before the stage, freed: not the stage's peak
    with PeakDeviceMemory("gen") as peak:
        x = torch.zeros(1 << 26, device="cuda")  # 256 MiB
    assert 0.25 <= peak.metrics["perf/max_memory_allocated_gib/gen"] < 0.9, peak.metrics
    del x
