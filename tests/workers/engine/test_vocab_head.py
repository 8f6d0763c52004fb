"""The chunked vocabulary head (workers/engine/vocab_head.py) against the unfused path it replaces: the same
log-probs, entropies and gradients (hidden states, weight, bias) at any chunk size and temperature, never a
positive log-prob, no [tokens x vocab] tensor kept for backward, and the same numbers through a real Hugging
Face model's forward."""

import pytest
import torch

from workers.engine.packing import entropy_from_logits, log_probs_from_logits, padded_response_log_probs
from workers.engine.vocab_head import head_computes_log_probs, output_head, response_log_probs
from workers.models.memory import chunk_tokens
from workers.models.tiny import tiny_config

N, H, V = 37, 16, 211


def _tiny_model(num_layers: int = 2):
    from transformers import Qwen2ForCausalLM

    config = tiny_config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers)
    return Qwen2ForCausalLM(config).float()


def _inputs(seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(V, (N,), generator=g)
    w_lp, w_ent = (
        torch.randn(N, generator=g, dtype=torch.float64),
        torch.randn(N, generator=g, dtype=torch.float64),
    )
    return hidden, weight, b, labels, w_lp, w_ent


def _unfused(hidden, weight, bias, labels, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    return log_probs_from_logits(logits, labels), entropy_from_logits(logits)


@pytest.mark.parametrize("chunk", [1, 5, N, 4 * N])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_equal_the_unfused_path(chunk, temperature, bias):
    hidden, weight, b, labels, w_lp, w_ent = _inputs(0, bias)
    params = [hidden, weight] + ([b] if bias else [])
    logp, ent = response_log_probs(
        hidden, weight, labels, temperature, with_entropy=True, bias=b, chunk=chunk
    )
    ours = torch.autograd.grad((logp * w_lp).sum() + (ent * w_ent).sum(), params)
    ref_lp, ref_ent = _unfused(hidden, weight, b, labels, temperature)
    theirs = torch.autograd.grad((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum(), params)
    torch.testing.assert_close(logp, ref_lp.float())
    torch.testing.assert_close(ent, ref_ent.float())
    for name, a, r in zip(["hidden", "weight", "bias"], ours, theirs):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=f"grad of {name}")  # fp32 inside


def test_log_probs_alone_and_a_frozen_head():
    """Without entropy, and with the weight frozen (LoRA): only the hidden states' gradient, the same."""
    hidden, weight, _, labels, w_lp, _ = _inputs(1, False)
    weight = weight.detach()
    logp, ent = response_log_probs(hidden, weight, labels, 1.3, chunk=4)
    assert ent is None
    (ours,) = torch.autograd.grad((logp * w_lp).sum(), [hidden])
    ref_lp, _ = _unfused(hidden, weight, None, labels, 1.3)
    (theirs,) = torch.autograd.grad((ref_lp * w_lp).sum(), [hidden])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_log_probs_are_never_positive_and_entropies_never_negative():
    """A fused path that returned positive log-probs collapsed training in another framework."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(64, H, generator=g) * 30  # peaked distributions: log-probs near 0
    weight = torch.randn(V, H, generator=g)
    labels = torch.nn.functional.linear(hidden, weight).argmax(-1)
    logp, ent = response_log_probs(hidden, weight, labels, with_entropy=True, chunk=7)
    assert (logp <= 0).all() and (ent >= 0).all()
    assert logp.max() > -1e-3  # the argmax labels are near-certain: the test reaches the edge


def test_no_tokens_by_vocab_tensor_is_kept_for_backward():
    """What autograd saves for backward, counted: the unfused path keeps [n, V] tensors, the chunked head keeps
    the hidden states, the weight and [n] vectors only."""
    hidden, weight, _, labels, _, _ = _inputs(3, False)

    def saved_sizes(fn) -> list[int]:
        sizes: list[int] = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sizes

    unfused = saved_sizes(lambda: _unfused(hidden, weight, None, labels, 0.7))
    chunked = saved_sizes(lambda: response_log_probs(hidden, weight, labels, 0.7, with_entropy=True, chunk=8))
    assert max(unfused) >= N * V
    assert max(chunked) == V * H and sorted(chunked)[-2] == N * H  # the weight, the hidden states


def test_chunk_size_bounds_one_fp32_buffer():
    assert chunk_tokens(151_936) == (256 << 20) // (4 * 151_936) == 441
    assert chunk_tokens(10, chunk_bytes=8) == 1


def test_through_a_hugging_face_model_equal_a_padded_forward():
    """The model's own forward with logits_to_keep, the head swapped in: the log-probs of a padded HF forward,
    and the parameters' gradients of the unfused path (tied embeddings: the head's gradient adds to the
    embedding's)."""
    torch.manual_seed(0)
    model = _tiny_model()
    assert model.config.tie_word_embeddings
    ids = torch.randint(97, (1, 12))
    keep = torch.arange(5, 11)  # positions predicting tokens 6..11
    labels = ids[0, 6:12]
    with head_computes_log_probs(model, labels, 0.8, with_entropy=True):
        pair = model(input_ids=ids, logits_to_keep=keep).logits[0]
    assert pair.shape == (6, 2)
    (pair[:, 0].sum() + 0.3 * pair[:, 1].sum()).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    logits = model(input_ids=ids).logits
    ref = padded_response_log_probs(logits, labels[None], 0.8)[0]
    ref_ent = entropy_from_logits(logits[0, 5:11] / 0.8)
    torch.testing.assert_close(pair[:, 0].detach(), ref.detach())
    (ref.sum() + 0.3 * ref_ent.sum()).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert "forward" not in vars(model.get_output_embeddings())  # the swap is undone


def test_a_model_that_transforms_its_logits_is_refused_by_name():
    model = _tiny_model(1)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        output_head(model)
