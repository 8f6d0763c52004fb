"""MoE support (workers/engine/moe.py) on the tiny Qwen3-MoE model (4 experts, top-2) and tiny Qwen2-MoE,
Mixtral and OLMoE models: recorded routes against each router run by hand, routing replay (R3) with the
model's own routes reproducing the plain forward's log-probs and gradients, other routes changing them and
reaching the router weight, -1 rows falling back, bad routes refused by name, hooks removed, the auxiliary
losses and the routing metrics on hand-built cases."""

import math

import pytest
import torch
from torch import nn

from workers.engine.moe import (
    expert_load,
    is_moe,
    load_balancing_loss,
    moe_routers,
    record_routes,
    route_mismatch,
    router_z_loss,
    routing_replay,
)
from workers.models.tiny import tiny_config

B, S, E, K = 2, 8, 4, 2


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(tiny_config("nano", arch="moe")).float()
    m(_ids())  # Hugging Face installs its output-capturing hooks on the first forward
    return m


def _ids(seed: int = 1, vocab: int = 1024) -> torch.Tensor:
    return torch.randint(vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def _log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    lp = _log_probs(model, ids)
    weights = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape)  # gradients of both signs
    (lp * weights).sum().backward()
    return lp.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _own_routes(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    return rec.routes()


def test_routers_found_in_layer_order_and_dense_model_has_none(model):
    from transformers import Qwen2ForCausalLM

    routers = moe_routers(model)
    assert routers == [layer.mlp.gate for layer in model.model.layers]
    assert [type(r).__name__ for r in routers] == ["Qwen3MoeTopKRouter"] * 2
    assert is_moe(model)
    dense = Qwen2ForCausalLM(tiny_config("nano"))
    assert moe_routers(dense) == [] and not is_moe(dense)


def test_recorded_routes_are_each_routers_top_k_by_hand(model):
    inputs: dict[int, torch.Tensor] = {}
    handles = [
        r.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach()))
        for i, r in enumerate(moe_routers(model))
    ]
    try:
        with torch.no_grad(), record_routes(model) as rec:
            model(_ids())
    finally:
        for h in handles:
            h.remove()
    routes = rec.routes()
    assert routes.shape == (B * S, 2, K) and routes.dtype == torch.long
    for i, router in enumerate(moe_routers(model)):
        logits = inputs[i].reshape(-1, router.weight.shape[1]) @ router.weight.T
        expected = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(K, dim=-1).indices
        assert torch.equal(routes[:, i], expected)
        torch.testing.assert_close(rec.router_logits()[i], logits, atol=1e-6, rtol=0)
    assert len({tuple(sorted(r)) for r in routes[:, 0].tolist()}) > 1  # not a degenerate routing

    with torch.no_grad(), record_routes(model) as rec:  # two forwards: the routes are the last one's
        model(_ids(seed=2))
        model(_ids())
    assert torch.equal(rec.routes(), routes) and not torch.equal(_own_routes(model, _ids(seed=2)), routes)


def test_replaying_own_routes_gives_the_plain_log_probs_and_gradients(model):
    ids = _ids()
    routes = _own_routes(model, ids)
    lp_plain, g_plain = _loss_and_grads(model, ids)
    with routing_replay(model, routes):
        lp_replay, g_replay = _loss_and_grads(model, ids)
    torch.testing.assert_close(lp_replay, lp_plain, atol=1e-6, rtol=0)
    assert g_plain.keys() == g_replay.keys()
    for name, g in g_plain.items():
        if g is None:  # an expert no token chose: no gradient either way
            assert g_replay[name] is None, name
        else:
            torch.testing.assert_close(g_replay[name], g, atol=1e-6, rtol=0, msg=name)
    for i in range(2):
        assert g_replay[f"model.layers.{i}.mlp.gate.weight"].abs().sum() > 1e-6


def test_replaying_other_routes_changes_logits_uses_gathered_scores_and_trains_the_router(model):
    ids = _ids()
    own = _own_routes(model, ids)
    rolled = (own + 1) % E  # a different expert set for every (token, layer)
    expert_args: dict[int, tuple] = {}
    handles = [
        layer.mlp.experts.register_forward_pre_hook(lambda m, args, i=i: expert_args.__setitem__(i, args))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            plain = model(ids).logits
            with routing_replay(model, rolled), record_routes(model) as rec:
                replayed = model(ids).logits
                again = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    assert (replayed - plain).abs().max() > 1e-3
    assert torch.equal(replayed, again)  # deterministic
    assert torch.equal(rec.routes(), rolled)  # a recorder sees the routes the experts used
    for i, logits in enumerate(rec.router_logits()):
        _, top_k_index, top_k_weights = expert_args[i]
        assert torch.equal(top_k_index, rolled[:, i])
        p = torch.softmax(logits, dim=-1).gather(1, rolled[:, i])
        torch.testing.assert_close(top_k_weights, p / p.sum(-1, keepdim=True), atol=1e-6, rtol=0)

    model.zero_grad(set_to_none=True)
    with routing_replay(model, rolled):
        model(ids).logits.float().logsumexp(-1).sum().backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 1e-6


def test_rows_without_a_route_keep_the_routers_own_choice(model):
    ids = _ids()
    own = _own_routes(model, ids)
    routes = (own + 1) % E
    routes[S:] = -1  # the second sequence has no recorded route
    with torch.no_grad():
        plain = model(ids).logits
        # the recorder entered first still sees the replayed routes (the replay hook runs before it)
        with record_routes(model) as rec, routing_replay(model, routes):
            replayed = model(ids).logits
    assert torch.equal(rec.routes()[S:], own[S:]) and torch.equal(rec.routes()[:S], routes[:S])
    torch.testing.assert_close(replayed[1], plain[1], atol=1e-6, rtol=0)  # sequences do not mix
    assert (replayed[0] - plain[0]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            torch.zeros(B * S, 3, K, dtype=torch.long),
            r"expected shape \(n_tokens, 2, 2\).*given \(16, 3, 2\)",
        ),
        (torch.zeros(B * S, 2, 3, dtype=torch.long), r"layer 0 routes top_k=2.*given \(16, 2, 3\)"),
        (torch.zeros(B * S, 2, K), r"integer tensor"),
        (
            torch.tensor([[0, 0], [2, 3]]).repeat(B * S, 1, 1),
            r"layer 0, token 0: an expert repeats in \[0, 0\]",
        ),
    ],
)
def test_bad_routes_are_refused_on_entry(model, bad, match):
    with pytest.raises(ValueError, match=match), routing_replay(model, bad):
        pytest.fail("entered")


def test_out_of_range_partial_and_wrong_token_count_routes_are_refused(model):
    good = _own_routes(model, _ids())
    bad = good.clone()
    bad[5, 1, 0] = E
    with pytest.raises(ValueError, match=r"layer 1, token 5: expert id out of range \[0, 4\)"):
        with routing_replay(model, bad):
            pass
    bad = good.clone()
    bad[3, 0, 1] = -1
    with pytest.raises(ValueError, match=r"layer 0, token 3: -1 must fill a whole row"):
        with routing_replay(model, bad):
            pass
    with pytest.raises(
        ValueError, match=r"layer 0 routes 16 tokens: expected shape \(16, 2, 2\), given \(15, 2, 2\)"
    ):
        with torch.no_grad(), routing_replay(model, good[1:]):
            model(_ids())


def _hooks(model):
    return [(dict(r._forward_hooks), dict(r._forward_pre_hooks)) for r in moe_routers(model)]


def test_hooks_are_removed_on_exit_and_on_error(model):
    ids = _ids()
    before = _hooks(model)
    with torch.no_grad():
        plain = model(ids).logits
        routes = (_own_routes(model, ids) + 1) % E
        with routing_replay(model, routes), record_routes(model):
            assert [len(h) for h, _ in _hooks(model)] == [len(h) + 2 for h, _ in before]
        with pytest.raises(RuntimeError, match="boom"), routing_replay(model, routes), record_routes(model):
            model(ids)
            raise RuntimeError("boom")
        with pytest.raises(ValueError, match="layer 0 routes 16 tokens"), routing_replay(model, routes[:-1]):
            model(ids)  # the error raised inside a router's hook
        after = model(ids).logits
    assert _hooks(model) == before
    for router in moe_routers(model):
        assert "forward" not in vars(router) and router.forward.__func__ is type(router).forward
    assert torch.equal(after, plain)


class SigmoidTopKRouter(nn.Module):
    """A DeepSeek-style router: the right output shapes, but sigmoid scores."""

    def __init__(self, returns_two: bool = False):
        super().__init__()
        self.top_k, self.num_experts, self.returns_two = K, E, returns_two
        self.weight = nn.Parameter(torch.randn(E, 8))

    def forward(self, hidden):
        logits = hidden.reshape(-1, 8) @ self.weight.T
        scores, indices = logits.sigmoid().topk(self.top_k, dim=-1)
        return (scores, logits) if self.returns_two else (logits, scores, indices)


def test_a_router_outside_the_contract_is_refused_by_name():
    holder = nn.ModuleList([SigmoidTopKRouter()])
    assert moe_routers(holder) == [holder[0]]
    with pytest.raises(NotImplementedError, match=r"layer 0 \(SigmoidTopKRouter\) does not score experts"):
        with routing_replay(holder, torch.tensor([[[0, 1]]] * 3)):
            holder[0](torch.randn(3, 8))
    two = nn.ModuleList([SigmoidTopKRouter(returns_two=True)])
    with pytest.raises(
        NotImplementedError, match=r"layer 0 \(SigmoidTopKRouter\) returned \[\(3, 2\), \(3, 4\)\]"
    ):
        with record_routes(two):
            two[0](torch.randn(3, 8))


def _other_moe(kind: str) -> nn.Module:
    import transformers as tf

    common = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    if kind == "qwen2_moe":  # only layer 1 is sparse (decoder_sparse_step=2): one router
        config = tf.Qwen2MoeConfig(
            **common, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16, intermediate_size=32,
            shared_expert_intermediate_size=32, decoder_sparse_step=2, norm_topk_prob=True,
        )  # fmt: skip
        return tf.Qwen2MoeForCausalLM(config)
    if kind == "mixtral":  # no norm_topk_prob attribute, always renormalises, fp32 scores
        config = tf.MixtralConfig(**common, num_local_experts=E, num_experts_per_tok=K, intermediate_size=16)
        return tf.MixtralForCausalLM(config)
    config = tf.OlmoeConfig(
        **common, num_experts=E, num_experts_per_tok=K, intermediate_size=16, norm_topk_prob=False
    )
    return tf.OlmoeForCausalLM(config)


@pytest.mark.parametrize("kind, n_routers", [("qwen2_moe", 1), ("mixtral", 2), ("olmoe", 2)])
def test_other_hugging_face_moe_routers_replay(kind, n_routers):
    torch.manual_seed(0)
    m = _other_moe(kind).float().eval()
    ids = _ids(vocab=64)
    with torch.no_grad():
        plain = m(ids).logits
        own = _own_routes(m, ids)
        assert own.shape == (B * S, n_routers, K)
        with routing_replay(m, own):
            torch.testing.assert_close(m(ids).logits, plain, atol=1e-6, rtol=0)
        with routing_replay(m, (own + 1) % E):
            assert (m(ids).logits - plain).abs().max() > 1e-4


def _cyclic_logits(a: float = 30.0) -> torch.Tensor:
    """Token i strongly prefers experts i and i+1 (mod 4): every expert chosen twice, mean probability 1/4."""
    logits = torch.zeros(E, E)
    for i in range(E):
        logits[i, i] = logits[i, (i + 1) % E] = a
    return logits


def test_load_balancing_loss_uniform_masked_and_against_hugging_face():
    uniform = _cyclic_logits()
    assert load_balancing_loss([uniform], top_k=K).item() == pytest.approx(1.0, abs=1e-6)
    # Two padding rows on experts {0, 1}: f = P = [1/3, 1/3, 1/6, 1/6] -> 4 * (2/9 + 2/36) = 10/9 ...
    padded = torch.cat([uniform, _cyclic_logits()[:1], _cyclic_logits()[:1]])
    assert load_balancing_loss([padded], top_k=K).item() == pytest.approx(10 / 9, abs=1e-6)
    # ... and 1.0 once the mask drops them; layers are averaged.
    mask = torch.tensor([1, 1, 1, 1, 0, 0])
    assert load_balancing_loss([padded], top_k=K, mask=mask).item() == pytest.approx(1.0, abs=1e-6)
    assert load_balancing_loss([padded, uniform], top_k=K).item() == pytest.approx((10 / 9 + 1) / 2, abs=1e-6)

    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = torch.randn(B * S, E, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(B, S)
    mask[1, 5:] = 0
    for m in (None, mask):  # per layer, HF's value counts a token once per chosen expert: top_k times ours
        hf = load_balancing_loss_func((logits,), num_experts=E, top_k=K, attention_mask=m)
        torch.testing.assert_close(K * load_balancing_loss([logits], top_k=K, mask=m), hf, atol=1e-6, rtol=0)


def test_router_z_loss_by_hand():
    ln2 = math.log(2.0)
    layer0 = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # logsumexp: ln 2, ln 4
    layer1 = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # 1 + ln 2, ln 2
    assert router_z_loss([layer0]).item() == pytest.approx((ln2**2 + (2 * ln2) ** 2) / 2, rel=1e-6)
    assert router_z_loss([layer0], mask=torch.tensor([1, 0])).item() == pytest.approx(ln2**2, rel=1e-6)
    both = ((ln2**2 + (2 * ln2) ** 2) / 2 + ((1 + ln2) ** 2 + ln2**2) / 2) / 2
    assert router_z_loss([layer0, layer1]).item() == pytest.approx(both, rel=1e-6)


def test_route_mismatch_counts_expert_sets_per_layer_and_respects_the_mask():
    a = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]]])  # [3 tokens, 2 layers, k=2]
    same_sets = a.flip(-1)
    assert set(route_mismatch(a, same_sets).values()) == {0.0}
    b = a.clone()
    b[0, 1] = torch.tensor([2, 1])  # token 0 differs at layer 1 only
    got = route_mismatch(a, b)
    assert got == pytest.approx(
        {
            "moe/route_mismatch/layer_0": 0.0,
            "moe/route_mismatch/layer_1": 1 / 3,
            "moe/route_mismatch": 1 / 6,
            "moe/route_mismatch_any_layer": 1 / 3,
        }
    )
    assert set(route_mismatch(a, b, mask=torch.tensor([0, 1, 1])).values()) == {0.0}
    b[1] = -1  # a row without a route is not compared
    assert route_mismatch(a, b)["moe/route_mismatch/layer_1"] == pytest.approx(1 / 2)


def test_expert_load_max_over_mean():
    balanced = torch.tensor([[[0, 1]], [[2, 3]]])  # 1 layer: every expert once
    assert expert_load(balanced, E)["moe/expert_load_max_over_mean"] == pytest.approx(1.0)
    skewed = torch.tensor([[[0, 1]], [[0, 2]], [[0, 3]], [[1, 2]]])  # counts 3, 2, 2, 1: max 3 over mean 2
    got = expert_load(skewed, E)
    assert got["moe/expert_load_max_over_mean"] == pytest.approx(1.5)
    assert got["moe/expert_load_max_over_mean/layer_0"] == pytest.approx(1.5)
    # masking the last row leaves counts 3, 1, 1, 1: 3 / 1.5
    assert expert_load(skewed, E, mask=torch.tensor([1, 1, 1, 0]))[
        "moe/expert_load_max_over_mean"
    ] == pytest.approx(2.0)
