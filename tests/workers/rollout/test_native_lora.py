"""LoRA adapters in the native engine (``load_adapter``): greedy tokens and log-probs equal peft's own model
with the same adapter, and the next adapter goes on the kept base (an exact unmerge: bit-equal to a fresh
engine given only that adapter). The reference is ``peft`` on ``transformers``, not our code."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from test_native_engine import LOGPROB_TOL, hf_greedy, hf_logprobs, make_prompts, tiny_model

from workers.rollout.native import EngineConfig, NativeEngine
from workers.rollout.sampling import SamplingParams

RANK, ALPHA = 4, 8.0


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def adapted(base, seed: int, targets="all-linear"):
    """peft's model over a copy of ``base`` with a random adapter (B non-zero, so it changes the outputs)."""
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def adapter_of(model):
    return list(get_peft_model_state_dict(model).items())


def test_greedy_tokens_and_log_probs_equal_peft_after_an_adapter_load():
    base = tiny_model()
    peft_model = adapted(base, seed=1)
    engine = NativeEngine(copy.deepcopy(base), config=EngineConfig(max_num_seqs=4, max_model_len=96))
    engine.load_adapter(adapter_of(peft_model), scaling=ALPHA / RANK, version=3)
    assert engine.weight_version == 3
    prompts = make_prompts([5, 17, 9])
    outs = engine.generate_batch(prompts, [SamplingParams(temperature=0.0, max_new_tokens=20)] * 3)
    differs = 0
    for prompt, (out,) in zip(prompts, outs):
        assert out.token_ids == hf_greedy(peft_model, prompt, 20)
        err = (torch.tensor(out.log_probs) - hf_logprobs(peft_model, prompt, out.token_ids)).abs().max()
        assert err < LOGPROB_TOL
        differs += out.token_ids != hf_greedy(base, prompt, 20)
    assert differs  # the adapter changed what the model says


def test_the_next_adapter_goes_on_the_base_exactly_and_a_new_base_resets_it():
    base = tiny_model()
    first, second = adapted(base, seed=1), adapted(base, seed=2, targets=["q_proj", "v_proj"])
    cfg = EngineConfig(max_num_seqs=2, max_model_len=64)
    engine = NativeEngine(copy.deepcopy(base), config=cfg)
    engine.load_adapter(adapter_of(first), scaling=ALPHA / RANK)
    engine.load_adapter(adapter_of(second), scaling=ALPHA / RANK)
    fresh = NativeEngine(copy.deepcopy(base), config=cfg)
    fresh.load_adapter(adapter_of(second), scaling=ALPHA / RANK)
    got, want = dict(engine.named_weights()), dict(fresh.named_weights())
    for name in want:  # first's o/gate/up/down deltas are gone too, not just overwritten where second adapts
        assert torch.equal(got[name], want[name]), name
    # update_weights sets a new base: the adapter then goes on it
    other = tiny_model(seed=5)
    engine.update_weights(other.state_dict().items())
    engine.load_adapter(adapter_of(second), scaling=ALPHA / RANK)
    on_other = NativeEngine(copy.deepcopy(other), config=cfg)
    on_other.load_adapter(adapter_of(second), scaling=ALPHA / RANK)
    assert all(torch.equal(t, dict(on_other.named_weights())[n]) for n, t in engine.named_weights())


def test_an_adapter_with_foreign_or_half_names_is_refused_by_name():
    engine = NativeEngine(tiny_model(), config=EngineConfig(max_num_seqs=2, max_model_len=64))
    a = torch.zeros(RANK, 64)
    with pytest.raises(KeyError, match="not a LoRA A/B weight"):
        engine.load_adapter([("model.layers.0.self_attn.q_proj.weight", a)], scaling=2.0)
    with pytest.raises(KeyError, match="A/B missing"):
        engine.load_adapter(
            [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", a)], scaling=2.0
        )
    with pytest.raises(KeyError, match="unknown weights"):
        engine.load_adapter(
            [
                ("base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight", a),
                ("base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight", a.T),
            ],
            scaling=2.0,
        )
