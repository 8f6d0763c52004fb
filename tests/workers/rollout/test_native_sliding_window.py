"""Native rollout engine: sliding-window attention (every layer, or local and global layers mixed) as Hugging Face
computes it.

References come from ``transformers`` itself (``generate`` for greedy tokens, a plain forward for log-probs) on
tiny random-init fp32 models whose windows (4-6 positions) are far shorter than prompt + response, so the window
changes the outputs: every parity case also checks that HF's own tokens differ from the same weights' tokens
under full attention.
"""

import pytest
import torch
import transformers
from test_native_engine import LOGPROB_TOL, hf_greedy, hf_logprobs, make_prompts, tiny_config

from workers.models.tiny import tiny_config as moe_tiny_config
from workers.rollout.native import EngineConfig, NativeEngine
from workers.rollout.native.model import spec_from_hf
from workers.rollout.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLASSES = {
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
}
S, F = "sliding_attention", "full_attention"


def sliding_config(kind: str, window: int | None, **overrides):
    """``tiny_config(kind)`` (mistral: the llama sizes, no biases, untied; qwen3_moe: the repository's nano MoE)
    with sliding windows. Qwen2/Qwen3: ``use_sliding_window`` with ``overrides`` (``max_window_layers`` /
    ``layer_types``; the config derives ``layer_types`` from ``max_window_layers`` when none is given); ``window``
    None: full attention."""
    if kind == "qwen3_moe":  # every layer slides when use_sliding_window (no layer_types)
        return moe_tiny_config(
            "nano", vocab_size=256, arch="moe", initializer_range=0.3, use_sliding_window=window is not None,
            sliding_window=window,
        )  # fmt: skip
    if kind == "mistral":
        sizes = tiny_config("llama").to_dict()
        for key in ("model_type", "architectures", "attention_bias", "mlp_bias", "pretraining_tp"):
            sizes.pop(key, None)
        return transformers.MistralConfig.from_dict({**sizes, "sliding_window": window})
    base = tiny_config(kind).to_dict()
    cls = type(tiny_config(kind))
    if window is None:
        return cls.from_dict({**base, "use_sliding_window": False, "layer_types": None})
    return cls.from_dict(
        {**base, "use_sliding_window": True, "sliding_window": window, "layer_types": None, **overrides}
    )


def sliding_model(kind: str, window: int | None, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return CLASSES[kind](sliding_config(kind, window, **overrides)).eval()


def full_attention_twin(kind: str, model):
    """The same weights with every window removed."""
    twin = CLASSES[kind](sliding_config(kind, None)).eval()
    twin.load_state_dict(model.state_dict())
    return twin


# (kind, window, config overrides, the per-layer windows HF applies)
CASES = {
    "qwen2-all": ("qwen2", 5, {"max_window_layers": 0}, (5, 5)),
    "qwen2-max_window_layers": ("qwen2", 4, {"max_window_layers": 1}, (None, 4)),  # layer 0 full
    "qwen2-local-global": ("qwen2", 4, {"layer_types": [S, F]}, (4, None)),
    "qwen3-all": ("qwen3", 6, {"max_window_layers": 0}, (6, 6)),
    "qwen3-global-local": ("qwen3", 4, {"layer_types": [F, S]}, (None, 4)),
    "mistral": ("mistral", 4, {}, (4, 4)),
    "qwen3_moe": ("qwen3_moe", 5, {}, (5, 5)),
}

LENGTHS = [3, 17, 9, 30, 1, 12]
BUDGETS = [20, 9, 14, 18, 24, 6]


def assert_parity(model, twin, prompts, budgets, outs):
    """Greedy tokens = HF generate; log-probs = HF forward over prompt + response; and the window matters:
    HF's tokens with it differ from HF's tokens without it for some prompt."""
    differ = False
    for prompt, budget, (out,) in zip(prompts, budgets, outs):
        ref = hf_greedy(model, prompt, budget)
        assert out.token_ids == ref
        assert (torch.tensor(out.log_probs) - hf_logprobs(model, prompt, ref)).abs().max() < LOGPROB_TOL
        differ = differ or hf_greedy(twin, prompt, budget) != ref
    assert differ, "the window changes none of HF's outputs: the parity check would be vacuous"


@pytest.mark.parametrize(
    "case, max_num_seqs, compile",
    [(case, 16, False) for case in CASES]
    + [
        pytest.param("qwen2-local-global", 2, False, id="qwen2-local-global-2-slots"),
        pytest.param("mistral", 3, False, id="mistral-3-slots"),
        pytest.param("qwen3-global-local", 3, True, id="qwen3-global-local-3-slots-compiled"),
    ],
)
def test_sliding_window_greedy_and_logprobs_equal_hf(case, max_num_seqs, compile):
    """Prompts of different lengths in one batch (16 slots: all prefilled together in forced per-length attention
    groups, then decoded at different positions in forced per-length groups), or continuous batching (2-3 slots:
    requests join and leave mid-flight, slots compacted), small prefill chunks; compiled layer blocks too."""
    kind, window, overrides, windows = CASES[case]
    model = sliding_model(kind, window, **overrides)
    engine = NativeEngine(
        model,
        config=EngineConfig(
            max_num_seqs=max_num_seqs, max_model_len=64, max_prefill_tokens=40, compile=compile
        ),
    )
    assert engine.model.spec.layer_windows == windows
    engine.model.GROUP_COST_TOKENS = 0  # per-length decode groups whenever possible
    engine.model.PREFILL_GROUP_COST = 0  # per-length prefill groups
    prompts = make_prompts(LENGTHS, seed=3)
    params = [SamplingParams(temperature=0.0, max_new_tokens=b) for b in BUDGETS]
    outs = engine.generate_batch(prompts, params)
    assert_parity(model, full_attention_twin(kind, model), prompts, BUDGETS, outs)
    assert engine.stats["generated_tokens"] == sum(BUDGETS)


@pytest.mark.parametrize("case", ["qwen2-all", "qwen3-global-local"])
@pytest.mark.parametrize("max_num_seqs", [8, 2])  # 2: a prompt's requests admitted over several steps
def test_shared_prompts_with_sliding_windows(case, max_num_seqs):
    """A prompt's samples share one prefill (its keys/values copied into each sample's slot, ``copy_slot``):
    greedy tokens equal HF's, ``n`` seeded samples equal each sample run alone, their log-probs HF's forward."""
    kind, window, overrides, _ = CASES[case]
    model = sliding_model(kind, window, **overrides)
    a, b = make_prompts([11, 19], seed=7)
    prompts = [a, b, a, a, b]
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=max_num_seqs, max_model_len=64))
    greedy = engine.generate_batch(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    assert_parity(model, full_attention_twin(kind, model), prompts, [16] * 5, greedy)
    if max_num_seqs == 8:
        assert engine.stats["prefill_tokens"] == 11 + 19  # each prompt computed once, copied to the others
    params = SamplingParams(temperature=1.0, n=3, max_new_tokens=16, seed=5)
    (shared_a, shared_b) = engine.generate_batch([a, b], params)
    for prompt, samples in ((a, shared_a), (b, shared_b)):
        assert len({tuple(s.token_ids) for s in samples}) == 3  # sampled, not copied
        for i, sample in enumerate(samples):
            alone = engine.generate_batch(
                [prompt], SamplingParams(temperature=1.0, max_new_tokens=16, seed=5 + i)
            )[0][0]
            assert sample.token_ids == alone.token_ids
            ref = hf_logprobs(model, prompt, sample.token_ids)
            assert (torch.tensor(sample.log_probs) - ref).abs().max() < LOGPROB_TOL


def test_window_changes_the_engine_outputs_and_a_window_past_max_model_len_is_full_attention():
    """The engine's own outputs depend on the window (so a forward that ignored it fails the parity tests), and a
    window no position below max_model_len can exceed is dropped from the spec: the full-attention path runs."""
    model = sliding_model("qwen2", 4, max_window_layers=0)
    twin = full_attention_twin("qwen2", model)
    prompts = make_prompts([20, 7], seed=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    sliding = NativeEngine(model, config=EngineConfig(max_num_seqs=4, max_model_len=64))
    full = NativeEngine(twin, config=EngineConfig(max_num_seqs=4, max_model_len=64))
    got = [o[0] for o in sliding.generate_batch(prompts, params)]
    ref = [o[0] for o in full.generate_batch(prompts, params)]
    assert [o.token_ids for o in got] != [o.token_ids for o in ref]
    logp = hf_logprobs(twin, prompts[0], got[0].token_ids)  # the sliding engine's tokens under full attention
    assert (torch.tensor(got[0].log_probs) - logp).abs().max() > 1e-2

    assert spec_from_hf(sliding_model("qwen2", 64, max_window_layers=0), 64).layer_windows == ()
    assert spec_from_hf(sliding_model("qwen2", 63, max_window_layers=0), 64).layer_windows == (63, 63)
    assert spec_from_hf(sliding_model("mistral", 4096), 64).layer_windows == ()  # Mistral's default window
    assert spec_from_hf(sliding_model("mistral", 4096), 8192).layer_windows == (4096, 4096)
    assert spec_from_hf(twin, 64).layer_windows == ()
    wide = NativeEngine(
        sliding_model("qwen2", 64, max_window_layers=0), config=EngineConfig(max_model_len=64)
    )
    assert [o[0].token_ids for o in wide.generate_batch(prompts, params)] == [o.token_ids for o in ref]


def test_layers_marked_sliding_without_a_window_are_refused():
    """Qwen2 ``layer_types`` with sliding layers but ``use_sliding_window=False`` (so ``sliding_window`` None):
    HF's forward fails on it too; and layer types this forward does not run are refused by name."""
    base = tiny_config("qwen2").to_dict()
    no_window = transformers.Qwen2Config.from_dict({**base, "layer_types": [S, F]})
    assert no_window.sliding_window is None
    with pytest.raises(ValueError, match="sliding_window is None"):
        spec_from_hf(transformers.Qwen2ForCausalLM(no_window), 64)
    chunked = transformers.Qwen2Config.from_dict({**base, "layer_types": ["chunked_attention", F]})
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        spec_from_hf(transformers.Qwen2ForCausalLM(chunked), 64)


def _tp2_sliding(rank: int, world: int, out_dir: str) -> None:
    """One of 2 gloo ranks running a TP=2 engine (1 of the 2 kv heads each) on a local/global sliding model."""
    import torch.distributed as dist

    model = sliding_model("qwen2", 4, layer_types=[S, F])
    engine = NativeEngine(
        model, config=EngineConfig(max_num_seqs=3, max_model_len=64), tp_group=dist.group.WORLD
    )
    prompts = make_prompts(LENGTHS, seed=3)
    outs = engine.generate_batch(
        prompts, [SamplingParams(temperature=0.0, max_new_tokens=b) for b in BUDGETS]
    )
    result = {"kv_heads": engine.model.kv_shape()[2], "outs": [(o.token_ids, o.log_probs) for (o,) in outs]}
    torch.save(result, f"{out_dir}/rank{rank}.pt")


def test_tensor_parallel_sliding_window_equals_hf(tmp_path):
    """The window masks positions, not heads: each TP rank applies the same mask to its own heads."""
    from workers.distributed import run_in_processes

    run_in_processes(_tp2_sliding, 2, str(tmp_path))
    model = sliding_model("qwen2", 4, layer_types=[S, F])
    prompts = make_prompts(LENGTHS, seed=3)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["kv_heads"] == 1
        for prompt, budget, (tokens, log_probs) in zip(prompts, BUDGETS, res["outs"]):
            assert tokens == hf_greedy(model, prompt, budget), f"rank {rank}"
            assert (torch.tensor(log_probs) - hf_logprobs(model, prompt, tokens)).abs().max() < LOGPROB_TOL
