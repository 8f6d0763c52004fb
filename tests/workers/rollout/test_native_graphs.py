"""Native rollout engine: the decode step replayed as CUDA graphs (``workers/rollout/native/graphs.py``).

On the CPU, ``graph_replay="eager"`` runs the very step a CUDA graph captures (static buffers, bucket padding,
device-made masks, the in-graph sampler) without capturing it: it stands in for the capture, which needs CUDA.
Those tests compare it with the engine's ordinary decode path and with Hugging Face ``generate``. The
``gpu``-marked tests at the end capture real graphs (the GPU check's ``pytest_gpu`` step runs them).
"""

import asyncio
import logging

import pytest
import torch
import transformers
from test_native_engine import LOGPROB_TOL, hf_greedy, make_prompts, tiny_model
from test_native_sliding_window import sliding_model

from dataproto import DataProto
from workers.models.tiny import tiny_config as repo_tiny_config
from workers.rollout.native import EngineConfig, NativeCausalLM, NativeEngine
from workers.rollout.native.graphs import DecodeGraphs, batch_buckets, bucket_for, kv_buckets
from workers.rollout.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
SAMPLED = SamplingParams(temperature=0.9, max_new_tokens=24, seed=11)
TRUNCATED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=24, seed=12)
EAGER_GRAPHS = dict(cuda_graphs=True, graph_replay="eager")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine_of(model, graphs: bool, **config) -> NativeEngine:
    """An engine with the static step replayed eagerly (``graphs``) or without graphs; ``config`` overrides."""
    options: dict = dict(max_num_seqs=6, max_model_len=160, eos_token_ids=[])
    options.update(EAGER_GRAPHS if graphs else {"cuda_graphs": False})
    return NativeEngine(model, config=EngineConfig(**{**options, **config}))


def outputs(engine, prompts, params):
    return [group[0] for group in engine.generate_batch(prompts, params)]


def assert_same_samples(plain, graphed):
    assert [o.token_ids for o in graphed] == [o.token_ids for o in plain]
    for a, b in zip(plain, graphed):
        if a.log_probs is not None:
            assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) < LOGPROB_TOL


# ---- buckets ---------------------------------------------------------------------------------------------------


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(70) == [1, 2, 4, 8, 16, 32, 48, 64, 70]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]
    assert kv_buckets(257) == [64, 128, 256, 257]
    assert kv_buckets(256) == [64, 128, 256]
    assert kv_buckets(40) == [40]
    assert [bucket_for([1, 2, 4, 6], n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    with pytest.raises(ValueError, match="larger than the largest bucket 6"):
        bucket_for([1, 2, 4, 6], 7)


# ---- the static step against the engine's decode and Hugging Face ----------------------------------------------


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_greedy_tokens_equal_hf_generate_and_the_ungraphed_engine(kind):
    model = tiny_model(kind)
    prompts = make_prompts(
        [5, 17, 9, 30, 3, 12, 40, 70], seed=3
    )  # 8 prompts over 6 slots: rows join and leave
    plain = outputs(engine_of(model, False, eos_token_ids=None), prompts, GREEDY)  # EOS as generate has it
    engine = engine_of(model, True, eos_token_ids=None)
    graphed = outputs(engine, prompts, GREEDY)
    assert_same_samples(plain, graphed)
    assert [o.token_ids for o in graphed] == [hf_greedy(model, p, 24) for p in prompts]
    # 6 rows first, fewer as they finish; prompts of 3..70 + 24 tokens read 64 or 128 positions
    buckets = engine.graphs.captured
    assert 6 in {b for b, _, _ in buckets} and {t for _, t, _ in buckets} == {64, 128}
    assert {mode for _, _, mode in buckets} == {"greedy"}
    assert engine.stats["graph_replays"] == engine.stats["decode_steps"] > 0


@pytest.mark.parametrize("params", [SAMPLED, TRUNCATED], ids=["temperature", "top_k_top_p"])
def test_seeded_samples_equal_the_ungraphed_engine(model, params):
    prompts = make_prompts([5, 17, 9, 30, 3, 12, 40], seed=4)
    engine = engine_of(model, True)
    assert_same_samples(outputs(engine_of(model, False), prompts, params), outputs(engine, prompts, params))
    mode = "sample" if params is SAMPLED else "logits"  # top-k/top-p: the forward replayed, sampled eagerly
    assert {m for _, _, m in engine.graphs.captured} == {mode}


def test_greedy_and_sampled_rows_in_one_batch(model):
    prompts = make_prompts([7, 11, 5, 20, 9], seed=5)
    params = [GREEDY, SAMPLED, GREEDY, SamplingParams(temperature=1.3, max_new_tokens=24, seed=1), SAMPLED]
    assert_same_samples(
        outputs(engine_of(model, False), prompts, params), outputs(engine_of(model, True), prompts, params)
    )


def test_padding_rows_leave_the_running_rows_and_later_prompts_alone(model):
    """3 rows run in the 4-row bucket: the padding row writes position 0 of free slot 3, which the next admitted
    request's prefill overwrites."""
    prompts = make_prompts([6, 9, 12, 15, 8], seed=6)
    budgets = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (30, 30, 30, 4, 30)]
    engine = engine_of(model, True)
    graphed = outputs(engine, prompts, budgets)
    assert_same_samples(outputs(engine_of(model, False), prompts, budgets), graphed)
    assert any(b == 4 for b, _, _ in engine.graphs.captured)  # 3 or 4 rows ran padded to 4
    assert [o.token_ids for o in graphed] == [
        hf_greedy(model, p, b.max_new_tokens) for p, b in zip(prompts, budgets)
    ]


def test_shared_prompt_prefill_and_requests_joining_mid_flight(model):
    """n samples of a prompt share its prefill (copy_slot), and async requests join the running batch while it
    decodes: the graphed engine gives the ungraphed engine's tokens."""
    prompts = make_prompts([9, 14, 4], seed=7)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, n=3, seed=21)

    async def run(engine):
        async def later(i, prompt):
            await asyncio.sleep(0.002 * i)
            return await engine.generate(prompt, params)

        return await asyncio.gather(*(later(i, p) for i, p in enumerate(prompts)))

    def tokens(engine):
        out = asyncio.run(run(engine))
        engine.shutdown()
        return [[o.token_ids for o in group] for group in out]

    plain_engine, graphed_engine = engine_of(model, False), engine_of(model, True)
    plain = tokens(plain_engine)
    assert tokens(graphed_engine) == plain
    assert graphed_engine.stats["prefill_tokens"] < graphed_engine.stats["prompt_tokens"]  # prefills shared


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_windows_in_the_static_step(kind):
    model = (
        sliding_model(kind, window=5) if kind == "mistral" else sliding_model(kind, 6, max_window_layers=1)
    )
    prompts = make_prompts([12, 3, 20], seed=8)
    graphed = outputs(engine_of(model, True), prompts, GREEDY)
    assert_same_samples(outputs(engine_of(model, False), prompts, GREEDY), graphed)
    assert [o.token_ids for o in graphed] == [hf_greedy(model, p, 24) for p in prompts]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_sdpa_static_attention_equals_the_bmm_form(kind):
    """The static step's two attention forms (the GPU check measures which is faster) give the same samples."""
    model = tiny_model(kind)
    prompts = make_prompts([5, 17, 9, 30], seed=16)
    bmm = outputs(engine_of(model, True), prompts, SAMPLED)
    engine = engine_of(model, True)
    engine.model.static_attention = "sdpa"
    assert_same_samples(bmm, outputs(engine, prompts, SAMPLED))
    window = sliding_model("mistral", window=5)
    engine = engine_of(window, True)
    engine.model.static_attention = "sdpa"
    assert [o.token_ids for o in outputs(engine, prompts, GREEDY)] == [
        hf_greedy(window, p, 24) for p in prompts
    ]


def test_compiled_blocks_in_the_static_step(model):
    prompts = make_prompts([5, 17], seed=9)
    graphed = outputs(engine_of(model, True, compile=True), prompts, GREEDY)
    assert [o.token_ids for o in graphed] == [hf_greedy(model, p, 24) for p in prompts]


# ---- fixed addresses: weight updates without re-capture --------------------------------------------------------


def test_a_weight_update_between_replays_needs_no_recapture(model):
    other = tiny_model(seed=5)
    prompts = make_prompts([5, 17, 9], seed=10)
    engine = engine_of(model, True)
    outputs(engine, prompts, GREEDY)
    captures, graphs = engine.stats["graph_captures"], engine.graphs.captured
    flat = engine.model.store.flat.data_ptr()
    engine.update_weights(other.named_parameters(), version=1)
    after = outputs(engine, prompts, GREEDY)
    assert engine.model.store.flat.data_ptr() == flat
    assert (
        engine.graphs.captured == graphs and engine.stats["graph_captures"] == captures
    )  # replayed, not re-made
    fresh = outputs(engine_of(other, False), prompts, GREEDY)
    assert (
        [o.token_ids for o in after]
        == [o.token_ids for o in fresh]
        == [hf_greedy(other, p, 24) for p in prompts]
    )
    assert [o.token_ids for o in after] != [hf_greedy(model, p, 24) for p in prompts]


def test_a_lora_merge_between_replays_needs_no_recapture(model):
    prompts = make_prompts([8, 13], seed=11)
    engine = engine_of(model, True)
    outputs(engine, prompts, GREEDY)
    captures = engine.stats["graph_captures"]
    g = torch.Generator().manual_seed(0)
    adapter = {
        f"base_model.model.model.layers.{i}.mlp.down_proj.lora_{ab}.weight": torch.randn(shape, generator=g)
        for i in range(2)
        for ab, shape in (("A", (4, 128)), ("B", (64, 4)))
    }
    engine.load_adapter(adapter.items(), scaling=2.0, version=1)
    merged = tiny_model()
    with torch.no_grad():
        for i in range(2):
            down = merged.model.layers[i].mlp.down_proj.weight
            prefix = f"base_model.model.model.layers.{i}.mlp.down_proj.lora_"
            down += 2.0 * adapter[prefix + "B.weight"] @ adapter[prefix + "A.weight"]
    got = outputs(engine, prompts, GREEDY)
    assert engine.stats["graph_captures"] == captures
    assert [o.token_ids for o in got] == [hf_greedy(merged, p, 24) for p in prompts]
    assert [o.token_ids for o in got] != [hf_greedy(model, p, 24) for p in prompts]


def test_releasing_memory_drops_the_graphs_and_they_are_made_again(model):
    prompts = make_prompts([5, 17, 9], seed=12)
    engine = engine_of(model, True)
    first = outputs(engine, prompts, GREEDY)
    captures = engine.stats["graph_captures"]
    engine.release_memory(weights=True)
    assert engine.graphs.captured == []
    engine.resume_memory()
    engine.update_weights(model.named_parameters())
    again = outputs(engine, prompts, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert engine.stats["graph_captures"] > captures


def test_a_graph_over_moved_memory_is_captured_again(model):
    """A cache that moved without release_memory (the model's own free/allocate) is caught by the addresses each
    graph was captured over: the next step re-captures instead of replaying over freed memory."""
    prompts = make_prompts([5, 17], seed=13)
    engine = engine_of(model, True)
    first = outputs(engine, prompts, GREEDY)
    captures = engine.stats["graph_captures"]
    old_cache = engine.model.k_cache  # kept alive, so the new cache cannot reuse its address
    engine.model.free_kv()
    engine.model.allocate_kv()
    assert engine.model.k_cache.data_ptr() != old_cache.data_ptr()
    again = outputs(engine, prompts, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert engine.stats["graph_captures"] > captures


# ---- the switch, refusals, metrics ----------------------------------------------------------------------------


def test_auto_is_off_without_cuda_and_true_asks_for_cuda(model):
    assert NativeEngine(model, config=EngineConfig(max_num_seqs=2, max_model_len=64)).graphs is None
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; the engine runs on cpu"):
        NativeEngine(model, config=EngineConfig(max_num_seqs=2, max_model_len=64, cuda_graphs=True))
    with pytest.raises(ValueError, match="graph_replay must be one of"):
        EngineConfig(graph_replay="lazy")


def test_a_mixture_of_experts_is_refused_with_its_reason():
    torch.manual_seed(0)
    moe = transformers.Qwen3MoeForCausalLM(repo_tiny_config("nano", vocab_size=256, arch="moe")).eval()
    with pytest.raises(ValueError, match="cannot be captured as CUDA graphs: a mixture of experts"):
        NativeEngine(moe, config=EngineConfig(max_num_seqs=2, max_model_len=64, **EAGER_GRAPHS))
    auto = NativeEngine(moe, config=EngineConfig(max_num_seqs=2, max_model_len=64, graph_replay="eager"))
    assert auto.graphs is None  # auto: off, and the engine still runs
    assert auto.generate_batch([[1, 2, 3]], GREEDY)[0][0].token_ids


def test_generate_sequences_reports_captures_and_replays(model):
    engine = engine_of(model, True, response_length=8)
    prompts = make_prompts([5, 9], seed=14)
    ids = torch.tensor([[0] * 4 + prompts[0], prompts[1]])
    batch = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": (torch.arange(9) >= torch.tensor([[4], [0]])).long()},
        meta_info={"do_sample": False, "max_new_tokens": 8},
    )
    meta = engine.generate_sequences(batch).meta_info
    assert meta["rollout/num_graph_captures"] >= 1 and meta["timing_s/graph_capture"] > 0
    assert meta["rollout/num_graph_replays"] == meta["rollout/decode_steps"] == 7
    assert meta["rollout/max_graphs_held"] == len(engine.graphs.captured)
    meta2 = engine.generate_sequences(batch).meta_info
    assert meta2["rollout/num_graph_captures"] == 0 and meta2["timing_s/graph_capture"] == 0  # all replayed
    plain = engine_of(model, False, response_length=8).generate_sequences(batch).meta_info
    assert "rollout/num_graph_captures" not in plain


def test_auto_falls_back_to_eager_decode_when_a_graph_fails(model, monkeypatch, caplog):
    prompts = make_prompts([5, 17, 9], seed=15)
    expected = [hf_greedy(model, p, 24) for p in prompts]
    engine = engine_of(model, True, cuda_graphs=None)  # auto, eager replay
    monkeypatch.setattr(
        NativeCausalLM, "decode_static", lambda *a: (_ for _ in ()).throw(RuntimeError("no capture"))
    )
    with caplog.at_level(logging.WARNING):
        got = outputs(engine, prompts, GREEDY)
    assert [o.token_ids for o in got] == expected
    assert engine.graphs is None and engine.stats["graph_failures"] == 1
    assert "decoding without graphs from now on" in caplog.text
    asked = engine_of(model, True)  # cuda_graphs=True: the error is raised
    with pytest.raises(RuntimeError, match="no capture"):
        outputs(asked, prompts, GREEDY)


def test_decode_graphs_refuses_a_cuda_capture_off_cuda(model):
    engine = engine_of(model, False)
    with pytest.raises(ValueError, match="need a CUDA device"):
        DecodeGraphs(engine.model, "cuda")


# ---- GPU: real captures ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_fp32_greedy_equal_hf_generate_and_no_graphs():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model().cuda()
    prompts = make_prompts([5, 17, 9, 30, 3, 12, 40, 70], seed=3)
    graphed_engine = NativeEngine(
        model, config=EngineConfig(max_num_seqs=6, max_model_len=160, eos_token_ids=[])
    )
    assert graphed_engine.graphs is not None and graphed_engine.graphs.replay == "cuda"  # auto: on with CUDA
    graphed = outputs(graphed_engine, prompts, GREEDY)
    plain = outputs(engine_of(model, False, device="cuda"), prompts, GREEDY)
    assert_same_samples(plain, graphed)
    assert [o.token_ids for o in graphed] == [hf_greedy_cuda(model, p, 24) for p in prompts]
    assert graphed_engine.stats["graph_captures"] > 0 and graphed_engine.stats["graph_memory_bytes"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("params", [SAMPLED, TRUNCATED], ids=["temperature", "top_k_top_p"])
def test_cuda_graphs_seeded_samples_equal_no_graphs(params):
    model = tiny_model().cuda()
    prompts = make_prompts([5, 17, 9, 30], seed=4)
    graphed = outputs(engine_of(model, False, device="cuda", cuda_graphs=True), prompts, params)
    assert_same_samples(outputs(engine_of(model, False, device="cuda"), prompts, params), graphed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_replay_the_updated_weights():
    model, other = tiny_model().cuda(), tiny_model(seed=5).cuda()
    prompts = make_prompts([5, 17, 9], seed=10)
    engine = engine_of(model, False, device="cuda", cuda_graphs=True)
    outputs(engine, prompts, GREEDY)
    captures = engine.stats["graph_captures"]
    engine.update_weights(other.named_parameters(), version=1)
    after = outputs(engine, prompts, GREEDY)
    assert engine.stats["graph_captures"] == captures
    assert [o.token_ids for o in after] == [hf_greedy_cuda(other, p, 24) for p in prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_bf16_log_probs_within_hf_bf16_error():
    prompts = make_prompts([5, 17, 9], seed=8)
    bf16 = tiny_model().to(device="cuda", dtype=torch.bfloat16)
    fp32 = tiny_model().cuda()
    fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    engine = engine_of(bf16, False, device="cuda", cuda_graphs=True)
    ours, hf = [], []
    for prompt, out in zip(
        prompts, outputs(engine, prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=0))
    ):
        ids = torch.tensor([prompt + out.token_ids], device="cuda")
        exact = _log_probs(fp32, ids, len(prompt))
        ours.append((torch.tensor(out.log_probs) - exact).abs())
        hf.append((_log_probs(bf16, ids, len(prompt)) - exact).abs())
    ours_err, hf_err = torch.cat(ours), torch.cat(hf)
    assert ours_err.mean() <= 2 * hf_err.mean() + 0.01, (ours_err.mean(), hf_err.mean())
    assert ours_err.max() <= 2 * hf_err.max() + 0.05, (ours_err.max(), hf_err.max())


def hf_greedy_cuda(model, prompt, max_new_tokens):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def _log_probs(model, ids, prompt_len):
    with torch.inference_mode():
        logits = model(ids).logits[0, prompt_len - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, ids[0, prompt_len:, None])[:, 0].cpu()
