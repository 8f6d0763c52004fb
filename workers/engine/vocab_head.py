"""Log-probs and entropy of the response tokens from the last hidden states and the output embedding, a chunk
of tokens at a time: no [tokens x vocab] tensor is ever held whole, in fp32 or otherwise.

At a 150k-token vocabulary the obvious path (``lm_head`` over every response token, then ``.float()``,
``/ temperature``, ``log_softmax`` and the entropy's ``softmax``, each kept for backward) holds about five fp32
[tokens x vocab] buffers: 46 GiB of a 73.6 GiB update at 16k tokens on a 0.5B model (BENCHMARKS.md, "On a GPU").
Here the forward computes each chunk's logits, keeps only its log-sum-exp, the labels' log-probs and the
entropy ([tokens] each), and drops the chunk; the backward recomputes each chunk's logits from the saved hidden
states and weight and turns them straight into the chunk's gradients. Peak memory beyond the hidden states is a
few [chunk x vocab] fp32 buffers (``workers.models.memory.CHUNK_BYTES``), and, with a trainable head, an fp32 accumulator of the
head's gradient.

Gradients (``z`` the chunk's logits over the temperature, ``p = softmax(z)``, ``lse = logsumexp(z)``, ``H`` the
entropy): ``d logp[label] / dz = onehot(label) - p`` and ``dH / dz = -p * (z - lse + H)``; both are divided by
the temperature on the way to the logits. ``tests/workers/engine/test_vocab_head.py`` holds them, and the
values, to the unfused path (``workers.engine.packing.log_probs_from_logits`` / ``entropy_from_logits``, kept as
the tests' reference only), and shows log-probs never positive.

Every log-prob the FSDP engine computes goes through :func:`head_computes_log_probs` (the update, old
log-probs, the reference and the OPD teacher, LoRA's adapter-off reference, shared-prompt packing); so does
the hybrid recipe's ``hint_gap``. The Megatron engine computes its own from full-vocab logits (``docs/megatron.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from workers.models.memory import chunk_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    z = nn.functional.linear(hidden, weight, bias).float()
    return z / temperature if temperature != 1.0 else z


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # the backward recomputes under the forward's autocast state
    def forward(ctx, hidden, weight, bias, labels, temperature: float, with_entropy: bool, chunk: int):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
        for s in range(0, n, chunk):
            z = _logits(hidden[s : s + chunk], weight, bias, temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk] = lse_c
            logp[s : s + chunk] = z.gather(1, labels[s : s + chunk, None]).squeeze(1) - lse_c
            if with_entropy:  # sum p * (lse - z): every term >= 0, no cancellation of large logits
                neg_logp = z.neg_().add_(lse_c[:, None])
                entropy[s : s + chunk] = (neg_logp.neg().exp_() * neg_logp).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        return logp, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if want_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        use_entropy = ctx.with_entropy and grad_entropy is not None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = _logits(h, weight, bias, t)
            lse_c = lse[s : s + chunk, None]
            p = (z - lse_c).exp_()
            g_lp = grad_logp[s : s + chunk, None] if grad_logp is not None else None
            grad_z = -p * g_lp if g_lp is not None else torch.zeros_like(z)
            if g_lp is not None:
                grad_z.scatter_add_(1, labels[s : s + chunk, None], g_lp)
            if use_entropy:  # dH/dz = -p * (z - lse + H)
                z.sub_(lse_c).add_(entropy[s : s + chunk, None]).mul_(p).mul_(
                    grad_entropy[s : s + chunk, None]
                )
                grad_z.sub_(z)
            del p, z
            if t != 1.0:
                grad_z.div_(t)
            if grad_hidden is not None:  # i.e. want_h
                grad_hidden[s : s + chunk] = grad_z.to(weight.dtype) @ weight
            if grad_weight is not None:  # want_w
                grad_weight.addmm_(grad_z.t(), h.float())
            if grad_bias is not None:  # want_b
                grad_bias.add_(grad_z.sum(dim=0))
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def response_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    bias: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log-probs [n] of ``labels`` [n] and, with ``with_entropy``, entropies [n], from the last hidden states
    [n, H] and the output embedding ``weight`` [V, H] (+ ``bias`` [V]), the logits divided by ``temperature``;
    ``chunk`` tokens at a time (default: ``chunk_tokens(V)``), recomputed in backward."""
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [n, H] and labels [n]; got {tuple(hidden.shape)} and {tuple(labels.shape)}"
        )
    chunk = chunk or chunk_tokens(weight.shape[0])
    logp, entropy = _ChunkedHead.apply(hidden, weight, bias, labels, float(temperature), with_entropy, chunk)
    return logp, (entropy if with_entropy else None)


def output_head(model: nn.Module) -> nn.Linear:
    """The model's output embedding (``lm_head``, tied or not), checked to be what the chunked head computes: a
    plain linear layer and no logit transform after it."""
    # torch types a Module's attributes as Tensor | Module; the model is an HF one (or peft's wrapper of one)
    head = cast("PreTrainedModel", model).get_output_embeddings()
    config = getattr(model, "config", None)
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(config, key, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"the model's config sets {key}={value}: the logits are transformed after lm_head, which hyflow's "
                "chunked vocabulary head (workers/engine/vocab_head.py) does not do"
            )
    if type(head) is not nn.Linear:
        raise ValueError(
            f"the model's output embedding is a {type(head).__name__}, not a plain nn.Linear (e.g. LoRA on lm_head): "
            "hyflow's chunked vocabulary head (workers/engine/vocab_head.py) computes from its weight directly"
        )
    return head


@contextlib.contextmanager
def head_computes_log_probs(
    model: nn.Module, labels: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> Iterator[None]:
    """Within this block the model's forward returns, in place of ``logits`` [1, n, V], a [1, n, 2] tensor: the
    log-probs of ``labels`` [n] and the entropies (zeros without ``with_entropy``) at the positions its
    ``logits_to_keep`` selects, from :func:`response_log_probs`. The head runs inside the model's own forward, so
    the weight it reads is the one FSDP has gathered for that forward (and gathers again for backward)."""
    head = output_head(model)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        logp, entropy = response_log_probs(
            flat, head.weight, labels, temperature, with_entropy=with_entropy, bias=head.bias
        )
        out = torch.stack([logp, entropy if entropy is not None else torch.zeros_like(logp)], dim=-1)
        return out.reshape(*hidden.shape[:-1], 2)

    # an instance attribute: nn.Module.__call__ finds it before the class's forward
    head.forward = forward  # type: ignore[method-assign, assignment]  # deliberately shadows the method
    try:
        yield
    finally:
        del head.forward
