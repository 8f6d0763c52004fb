"""Native rollout engine: parity with Hugging Face, continuous batching, sampling, stops.

Every reference comes from ``transformers`` itself (``generate`` for greedy tokens, a plain forward for
log-probs, the logits warpers for top-k/top-p) on tiny random-init models.
"""

import pytest
import torch
import transformers
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from workers.rollout.native import BatchSampler, EngineConfig, NativeEngine
from workers.rollout.native.sampler import greedy_sample
from workers.rollout.sampling import SamplingParams

LOGPROB_TOL = 1e-4  # fp32; observed differences are ~5e-7

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def tiny_config(kind: str = "qwen2"):
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,  # larger than the default 0.02, so greedy outputs are not one repeated token
    )
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3":  # q/k norms, explicit head_dim different from hidden/heads
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if kind == "llama":  # no biases, untied lm_head
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    raise ValueError(kind)


def tiny_model(kind: str = "qwen2", seed: int = 0):
    torch.manual_seed(seed)
    cls = {
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "llama": transformers.LlamaForCausalLM,
    }[kind]
    return cls(tiny_config(kind)).eval()


@pytest.fixture(autouse=True)
def one_thread():
    # The CI box has 2 cores shared by many processes: a second OpenMP thread that is not scheduled
    # stalls every parallel op for a time slice.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def make_prompts(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt, max_new_tokens):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model, prompt, tokens, temperature=1.0):
    """log_softmax(logits / T) of ``tokens`` from one HF forward over prompt + tokens."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


class CharTokenizer:
    """Stand-in for a HF tokenizer (the engine only calls ``decode`` and reads the special ids):
    token t decodes to two letters, so stop strings can end inside a token."""

    eos_token_id = None
    pad_token_id = 0

    @staticmethod
    def piece(t: int) -> str:
        return chr(97 + t % 16) + chr(97 + t // 16)

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.piece(t) for t in ids)


# ---- parity with HF -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_num_seqs, compile", [(1, False), (3, False), (16, False), pytest.param(3, True, id="3-compiled")]
)
def test_greedy_equals_hf_generate_batched_and_one_at_a_time(model, max_num_seqs, compile):
    """Different prompt lengths and budgets; 1 slot = strictly one at a time, 3 slots = requests joining
    and leaving mid-flight, 16 = all together. Small prefill chunks, forced attention groups. Compiled
    (``rollout.compile``): the same tokens, log-probs within the same tolerance."""
    lengths = [5, 17, 9, 30, 2, 11, 40, 1]
    budgets = [20, 7, 13, 25, 3, 18, 30, 22]
    prompts = make_prompts(lengths)
    engine = NativeEngine(
        model,
        config=EngineConfig(
            max_num_seqs=max_num_seqs, max_model_len=128, max_prefill_tokens=48, compile=compile
        ),
    )
    engine.model.GROUP_COST_TOKENS = 0  # split decode attention into per-length groups whenever possible
    params = [SamplingParams(temperature=0.0, max_new_tokens=b) for b in budgets]
    outs = engine.generate_batch(prompts, params)
    for prompt, budget, (out,) in zip(prompts, budgets, outs):
        assert out.token_ids == hf_greedy(model, prompt, budget)
        assert out.finish_reason == "length"
        err = (torch.tensor(out.log_probs) - hf_logprobs(model, prompt, out.token_ids)).abs().max()
        assert err < LOGPROB_TOL
    assert engine.stats["generated_tokens"] == sum(budgets)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "kind, compile", [("qwen3", False), ("llama", False), pytest.param("qwen3", True, id="qwen3-compiled")]
)
def test_greedy_parity_other_architectures(kind, compile):
    """Qwen3's q/k norms and head_dim, Llama's untied head and no biases; compiled too (Qwen3: the most ops)."""
    model = tiny_model(kind)
    prompts = make_prompts([7, 19, 3])
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=4, max_model_len=64, compile=compile))
    outs = engine.generate_batch(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for prompt, (out,) in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 12)
        assert (
            torch.tensor(out.log_probs) - hf_logprobs(model, prompt, out.token_ids)
        ).abs().max() < LOGPROB_TOL


def test_sampled_logprobs_match_hf_forward_at_temperature(model):
    """Rollout log-probs = log_softmax(logits / T) of the sampled tokens over the full vocabulary
    (before top-k/top-p), as the trainer recomputes them."""
    prompts = make_prompts([6, 23, 12, 3])
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=16, seed=3)
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=4, max_model_len=64))
    for prompt, (out,) in zip(prompts, engine.generate_batch(prompts, params)):
        ref = hf_logprobs(model, prompt, out.token_ids, temperature=0.7)
        assert (torch.tensor(out.log_probs) - ref).abs().max() < LOGPROB_TOL


def test_request_joining_mid_flight(model):
    a, b = make_prompts([13, 29], seed=5)
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=4, max_model_len=96))
    (req_a,) = engine.add_request(a, SamplingParams(temperature=0.0, max_new_tokens=30))
    for _ in range(6):
        engine.step()
    assert len(req_a.tokens) == 7 and engine.num_running == 1
    (req_b,) = engine.add_request(b, SamplingParams(temperature=0.0, max_new_tokens=10))
    engine.step()
    assert engine.num_running == 2  # b was prefilled and decodes in the same batch as a
    while engine.has_unfinished():
        engine.step()
    assert req_a.output().token_ids == hf_greedy(model, a, 30)
    assert req_b.output().token_ids == hf_greedy(model, b, 10)
    assert engine.stats["decode_steps"] == 29  # a's 29 decode steps covered all of b's


@pytest.mark.parametrize("max_num_seqs", [8, 2])  # 2: a prompt's requests admitted over several steps
def test_requests_of_one_prompt_share_its_prefill(model, max_num_seqs):
    """Group sampling (rollout.n samples of a prompt): a prompt's requests admitted together share one prefill,
    its keys/values copied into each request's slot. Greedy tokens equal HF; sampled tokens equal the same
    request's prefilled alone, and their log-probs HF's forward."""
    a, b = make_prompts([11, 19], seed=7)
    prompts = [a, b, a, a, b]  # interleaved, as a batch of groups may arrive
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=max_num_seqs, max_model_len=64))
    greedy = engine.generate_batch(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    assert [out.token_ids for (out,) in greedy] == [hf_greedy(model, p, 16) for p in prompts]
    assert engine.stats["prompt_tokens"] == 3 * 11 + 2 * 19
    if max_num_seqs == 8:  # all five admitted at once: each prompt computed once
        assert engine.stats["prefill_tokens"] == 11 + 19
    else:
        assert 11 + 19 < engine.stats["prefill_tokens"] < engine.stats["prompt_tokens"]
    params = [SamplingParams(temperature=1.0, max_new_tokens=16, seed=s, logprobs=True) for s in range(5)]
    shared = engine.generate_batch(prompts, params)
    for prompt, p, (out,) in zip(prompts, params, shared):
        (alone,) = engine.generate_batch([prompt], p)[0]
        assert out.token_ids == alone.token_ids
        ref = hf_logprobs(model, prompt, out.token_ids)
        assert (torch.tensor(out.log_probs) - ref).abs().max() < LOGPROB_TOL
    assert len({tuple(out.token_ids) for (out,) in shared}) == 5  # sampled, not copied


# ---- sampling -----------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    prompts = make_prompts([8, 15, 4], seed=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=1234)
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=4, max_model_len=64))
    alone = engine.generate_batch(prompts[:1], params)[0][0]
    again = engine.generate_batch(prompts[:1], params)[0][0]
    together = engine.generate_batch(prompts, params)[0][0]  # other rows in the batch
    assert alone.token_ids == again.token_ids == together.token_ids
    assert alone.log_probs == again.log_probs
    other_seed = engine.generate_batch(
        prompts[:1], SamplingParams(temperature=1.0, max_new_tokens=20, seed=9)
    )
    assert other_seed[0][0].token_ids != alone.token_ids
    greedy = engine.generate_batch(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=20))
    assert greedy[0][0].token_ids != alone.token_ids  # temperature 1 on a near-flat model really samples


def test_top_k_1_equals_greedy(model):
    prompts = make_prompts([9, 21])
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=4, max_model_len=64))
    sampled = engine.generate_batch(
        prompts, SamplingParams(temperature=1.3, top_k=1, max_new_tokens=16, seed=0)
    )
    greedy = engine.generate_batch(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    assert [o[0].token_ids for o in sampled] == [o[0].token_ids for o in greedy]


def test_n_samples_per_prompt(model):
    prompt = make_prompts([10])[0]
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=8, max_model_len=64))
    (outs,) = engine.generate_batch(
        [prompt], SamplingParams(temperature=1.0, n=4, max_new_tokens=12, seed=50)
    )
    assert len(outs) == 4 and all(len(o.token_ids) == 12 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 4
    # sample i of a request seeded s is the sample of a request seeded s + i
    (third,) = engine.generate_batch([prompt], SamplingParams(temperature=1.0, max_new_tokens=12, seed=52))
    assert third[0].token_ids == outs[2].token_ids


@pytest.mark.parametrize(
    "vocab,scale,temperature,top_k,top_p",
    [
        (256, 2.0, 0.8, 20, 1.0),  # top-k alone
        (256, 2.0, 1.0, -1, 0.7),  # top-p alone, nucleus within the first candidates
        (256, 2.0, 1.2, 30, 0.8),  # top-k then top-p
        (1000, 0.05, 1.0, -1, 0.9),  # near-flat: nucleus wider than the candidates -> full sort path
        (256, 1.0, 0.5, -1, 1.0),  # plain temperature
    ],
)
def test_sampler_distribution_matches_hf_warpers(vocab, scale, temperature, top_k, top_p):
    """Stratified uniforms make the empirical distribution exact to 1/N; compare it with softmax of the
    logits after HF's temperature, TopK and TopP warpers (HF's order)."""
    torch.manual_seed(0)
    logits = torch.randn(1, vocab) * scale
    ref = logits / temperature
    if top_k > 0:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ref_probs = torch.softmax(ref, dim=-1)[0]
    N = 20000 if vocab <= 256 else 5000  # stratified: error <= 1/N per token
    sampler = BatchSampler([temperature] * N, [top_k] * N, [top_p] * N, "cpu")
    tokens, logp = sampler.sample(logits.expand(N, vocab).contiguous(), [(i + 0.5) / N for i in range(N)])
    freq = torch.bincount(tokens, minlength=vocab).double() / N
    assert (ref_probs[freq > 0] > 0).all()  # never outside HF's kept set
    assert (freq - ref_probs.double()).abs().max() < 2.0 / N
    full = torch.log_softmax(logits[0] / temperature, dim=-1)  # reported: before truncation
    assert torch.allclose(logp, full[tokens], atol=1e-6)


def test_sampler_rows_are_independent_of_each_other():
    """Greedy, top-k, top-p-only (full-sort path) and plain rows in one batch give what each gives alone."""
    torch.manual_seed(1)
    V = 600
    logits = torch.randn(4, V) * torch.tensor([[3.0], [2.0], [0.02], [1.0]])
    settings = [(0.0, -1, 1.0), (0.9, 15, 1.0), (1.0, -1, 0.95), (1.1, 50, 0.8)]
    u = [0.3, 0.77, 0.51, 0.999999999]
    batch = BatchSampler(*map(list, zip(*settings)), "cpu")
    tokens, logp = batch.sample(logits, u)
    for i, (t, k, p) in enumerate(settings):
        single = BatchSampler([t], [k], [p], "cpu")
        tok_i, lp_i = single.sample(logits[i : i + 1], [u[i]])
        assert tok_i.item() == tokens[i].item() and torch.allclose(lp_i, logp[i : i + 1])
    assert tokens[0].item() == logits[0].argmax().item()


def test_greedy_sample_equals_argmax_and_log_softmax():
    """The all-greedy fast path (max + one exp pass) picks argmax's token, the first on ties, and reports
    the log_softmax of it."""
    torch.manual_seed(2)
    logits = torch.randn(6, 500) * torch.tensor([[4.0], [1.0], [0.01], [8.0], [1.0], [2.0]])
    logits[4, 17] = logits[4, 300] = logits[4].max() + 1.0  # a tie: the lower index wins
    logits[5] = 0.5  # all equal
    tokens, logp = greedy_sample(logits)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens[4].item() == 17 and tokens[5].item() == 0
    ref = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None])[:, 0]
    assert (logp.double() - ref).abs().max() < 1e-6


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_prefill_attention_groups_equal_one_group(kind):
    """Prefill attention split into per-length groups (forced: no group cost) gives the logits and KV cache
    of one padded group, and the greedy tokens of HF."""
    model = tiny_model(kind)
    prompts = make_prompts([40, 33, 21, 20, 9, 5, 2, 1])
    split = NativeEngine(model, config=EngineConfig(max_num_seqs=8, max_model_len=64))
    whole = NativeEngine(model, config=EngineConfig(max_num_seqs=8, max_model_len=64))
    split.model.PREFILL_GROUP_COST = 0
    whole.model.PREFILL_GROUP_COST = 10**9
    lengths = [len(p) for p in prompts]
    assert len(split.model._row_groups(lengths, 0, split.model.MIN_PREFILL_GROUP_ROWS, squared=True)) > 1
    with torch.inference_mode():
        for engine in (split, whole):
            engine.model.allocate_kv()
        a, b = split.model.prefill(prompts, 0), whole.model.prefill(prompts, 0)
    assert torch.allclose(a, b, atol=1e-5, rtol=0)
    for i, n in enumerate(lengths):
        assert torch.allclose(split.model.k_cache[:, i, :, :n], whole.model.k_cache[:, i, :, :n], atol=1e-5)
    outs = split.generate_batch(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    for prompt, (out,) in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 8)


# ---- stopping -----------------------------------------------------------------------------------------


def test_stop_token_ids_and_generation_config_eos(model):
    prompt = make_prompts([12], seed=7)[0]
    ref = hf_greedy(model, prompt, 30)
    stop = ref[9]
    first = ref.index(stop)
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=2, max_model_len=64))
    (out,) = engine.generate_batch(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[stop])
    )[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"  # stop token kept
    # EOS comes from the model's generation config unless the engine is told otherwise
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [stop]
    try:
        eos_engine = NativeEngine(model, config=EngineConfig(max_num_seqs=2, max_model_len=64))
        no_eos = NativeEngine(model, config=EngineConfig(max_num_seqs=2, max_model_len=64, eos_token_ids=[]))
    finally:
        model.generation_config.eos_token_id = old
    assert eos_engine.eos_token_ids == [stop]
    assert eos_engine.generate_batch([prompt], GREEDY)[0][0].token_ids == ref[: first + 1]
    long = no_eos.generate_batch([prompt], SamplingParams(temperature=0.0, max_new_tokens=30))[0][0]
    assert long.token_ids == ref and long.finish_reason == "length"


def test_stop_strings_cut_text_and_drop_later_tokens(model):
    tok = CharTokenizer()
    prompt = make_prompts([11], seed=4)[0]
    ref = hf_greedy(model, prompt, 30)
    # a stop string that starts inside token 5 and ends inside token 6
    stop = tok.piece(ref[5])[1] + tok.piece(ref[6])[0]
    for k in range(len(ref)):
        text = tok.decode(ref[: k + 1])
        if stop in text:
            expected_tokens, expected_text = ref[: k + 1], text[: text.index(stop) + len(stop)]
            break
    engine = NativeEngine(model, tokenizer=tok, config=EngineConfig(max_num_seqs=2, max_model_len=64))
    params = SamplingParams(temperature=0.0, max_new_tokens=30, stop=["zzzz", stop])
    (out,) = engine.generate_batch([prompt], params)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == expected_tokens
    assert out.text == expected_text and out.text.endswith(stop)
    plain = engine.generate_batch([prompt], SamplingParams(temperature=0.0, max_new_tokens=5))[0][0]
    assert plain.text == tok.decode(ref[:5])  # text filled when a tokenizer is present
    with pytest.raises(ValueError, match="tokenizer"):
        NativeEngine(model, config=EngineConfig(max_model_len=64)).add_request(prompt, params)


def test_max_new_tokens_and_max_model_len(model):
    prompt = make_prompts([20])[0]
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=2, max_model_len=32))
    (out,) = engine.generate_batch([prompt], SamplingParams(temperature=0.0, max_new_tokens=100))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"  # 20 + 12 = max_model_len
    assert out.token_ids == hf_greedy(model, prompt, 12)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(32)), GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
