"""Engine tests: packing/partitioning units, packed-vs-padded parity, micro-batch and DP invariance of loss and
gradient (2 gloo FSDP2 ranks vs one process), skipped non-finite steps, checkpoints and HF export."""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from pathlib import Path

import engine_testlib as T
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from workers.distributed import run_in_processes
from workers.engine import (
    CheckpointError,
    FSDPEngine,
    OptimConfig,
    TrainEngine,
    export_hf,
    karmarkar_karp,
    load_checkpoint,
    pack_sequences,
    plan_micro_batches,
    save_checkpoint,
    verify_checkpoint,
)
from workers.engine.fsdp_engine import decoder_layers
from workers.engine.packing import group_rows_by_prompt, restore_order

R = 10  # response length of T.make_batch


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/workers/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return T.make_model_dir(tmp_path_factory.mktemp("tiny_qwen2"))


def _engine(model_dir, **kw):
    return FSDPEngine(T.engine_config(model_dir, **kw))


def _padded_forward(model_dir, batch, temperature=1.0, attn="sdpa"):
    """Log-probs and entropy of the responses from a plain HF forward of the padded batch, computed here
    (not through the engine's packing helpers, so an error there cannot cancel out)."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn).eval()
    with torch.no_grad():
        logits = ref(
            batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    rmask = batch["attention_mask"][:, -R:]
    # the logits at position t predict token t + 1: those of the last prompt token .. second-to-last response token
    resp_logits = logits[:, -R - 1 : -1].float() / temperature
    ids = batch["responses"]
    lp = torch.log_softmax(resp_logits, -1).gather(-1, ids[..., None]).squeeze(-1) * rmask
    p = torch.softmax(resp_logits, -1)
    ent = (torch.logsumexp(resp_logits, -1) - (p * resp_logits).sum(-1)) * rmask
    return lp, ent


# ----------------------------------------------------------------------------------------------------------------
# packing and partitioning (pure functions)
# ----------------------------------------------------------------------------------------------------------------


def test_karmarkar_karp_balances_and_covers():
    rng = random.Random(0)
    for _ in range(20):
        w = [rng.randint(1, 500) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, 6)
        parts = karmarkar_karp(w, k)
        assert len(parts) == k
        assert sorted(i for p in parts for i in p) == list(range(len(w)))
        sums = [sum(w[i] for i in p) for p in parts]
        if len(w) >= k:
            # differencing never leaves a spread larger than the largest item
            assert max(sums) - min(sums) <= max(w)
    # the textbook run of the differencing method on {8,7,6,5,4}: 8-7, 6-5, 4-1, 3-1 -> spread 2
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [14, 16]
    # 3-way: {5,5,4,3,3,2,2} splits into three groups of 8
    w = [5, 5, 4, 3, 3, 2, 2]
    assert sorted(sum(w[i] for i in p) for p in karmarkar_karp(w, 3)) == [8, 8, 8]


def test_plan_micro_batches_token_budget():
    rng = random.Random(1)
    lengths = [rng.randint(5, 60) for _ in range(23)]
    parts = plan_micro_batches(lengths, max_token_len=100)
    assert sorted(i for p in parts for i in p) == list(range(23))
    assert all(sum(lengths[i] for i in p) <= 100 for p in parts)
    assert len(parts) <= math.ceil(sum(lengths) / 100) + 2  # near the lower bound
    with pytest.raises(ValueError, match=r"longest sequence \(60 tokens\)"):
        plan_micro_batches([10, 60], max_token_len=50)
    assert plan_micro_batches(list(range(1, 8)), micro_batch_size=3) == [[0, 1, 2], [3, 4, 5], [6]]
    # DP sync can ask for more groups than rows: empty groups are returned, never dropped rows
    parts = plan_micro_batches([5, 5], max_token_len=100, min_num_micro_batches=3)
    assert len(parts) == 3 and sorted(i for p in parts for i in p) == [0, 1]


def test_restore_order_and_pack_removes_all_padding():
    parts = [[3, 0], [2], [], [1]]
    chunks = [torch.tensor([[30], [0]]), torch.tensor([[20]]), torch.tensor([[10]])]
    assert restore_order(chunks, [p for p in parts if p]).flatten().tolist() == [0, 10, 20, 30]
    b = T.make_batch(5, seed=3)
    packed = pack_sequences(b["input_ids"], b["attention_mask"], R)
    assert packed.num_tokens == int(b["attention_mask"].sum())  # zero pad tokens in the packed row
    assert packed.cu_seqlens.tolist() == [0, *b["attention_mask"].sum(1).cumsum(0).tolist()]
    assert packed.labels.tolist() == b["responses"][b["attention_mask"][:, -R:].bool()].tolist()
    # the predicting token of the first response token is the last prompt token
    assert packed.input_ids[0, packed.keep_index[0]] == b["prompts"][0, -1]


# ----------------------------------------------------------------------------------------------------------------
# forward parity
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_packed_log_probs_match_padded_forward(tmp_path, arch):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if arch == "qwen2":
        d = T.make_model_dir(tmp_path / arch)
    else:
        common = dict(
            vocab_size=T.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=arch == "qwen3", pad_token_id=0,
        )  # fmt: skip
        torch.manual_seed(0)
        if arch == "qwen3":
            model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
        else:
            model = LlamaForCausalLM(LlamaConfig(**common))
        d = str(tmp_path / arch)
        model.save_pretrained(d)
    b = T.make_batch(7, seed=4)
    eng = FSDPEngine(T.engine_config(d, optim=OptimConfig(lr=0.0)))
    for temperature in (1.0, 0.7):
        ref_lp, ref_ent = _padded_forward(d, b, temperature)
        out = eng.compute_log_prob(b, temperature=temperature, calculate_entropy=True, max_token_len=30)
        torch.testing.assert_close(out["log_probs"], ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(out["entropy"], ref_ent, atol=1e-5, rtol=0)


def test_varlen_attention_equals_hf_packed_sdpa(model_dir):
    """The per-sequence attention and HF's own block-diagonal-mask path give the same packed log-probs."""
    b = T.make_batch(6, seed=5)
    varlen = _engine(model_dir).compute_log_prob(b, micro_batch_size=6)["log_probs"]
    dense = _engine(model_dir, attn_implementation="sdpa").compute_log_prob(b, micro_batch_size=6)[
        "log_probs"
    ]
    torch.testing.assert_close(varlen, dense, atol=1e-5, rtol=0)


def test_shared_prompts_give_the_unshared_log_probs_values_and_gradients(model_dir):
    """``share_prompts`` (on by default): the samples of one prompt in a micro-batch share one forward/backward of
    it. Log-probs and entropy equal a padded HF forward, the loss and gradients equal the unshared packing's
    (whole batch, micro-batches that split a group, token budgets planned by group), and so do a critic's
    values; the packed row holds each prompt once."""
    b = T.make_group_batch(groups=3, samples=4, seed=12)
    shared, plain = _engine(model_dir), _engine(model_dir, share_prompts=False)
    assert shared.share_prompts and not plain.share_prompts
    ref_lp, ref_ent = _padded_forward(model_dir, b)
    fed = []  # the tokens the model itself was run on (an engine that stopped sharing feeds each prompt 4 times)
    hook = shared.model.get_input_embeddings().register_forward_hook(lambda m, i, o: fed.append(i[0].numel()))
    try:
        out = shared.compute_log_prob(b, calculate_entropy=True)
    finally:
        hook.remove()
    torch.testing.assert_close(out["log_probs"], ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["entropy"], ref_ent, atol=1e-5, rtol=0)
    each_prompt_once = b["attention_mask"][::4, :-R].sum() + b["attention_mask"][:, -R:].sum()
    assert sum(fed) == each_prompt_once < b["attention_mask"].sum(), (fed, each_prompt_once)
    # a budget of whole groups, and one that cuts every group (the engine plans by prompt groups; the plain
    # engine by rows)
    for kw in ({}, {"micro_batch_size": 3}, {"max_token_len": 40}, {"max_token_len": 25}):
        loss, g = T.accumulate_grads(shared, b, T.pg_loss, **kw)
        ref_loss, ref_g = T.accumulate_grads(plain, b, T.pg_loss, **kw)
        assert loss == pytest.approx(ref_loss, abs=1e-6), kw
        for k in ref_g:
            torch.testing.assert_close(
                g[k], ref_g[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k, kw=kw: f"{kw} {k}: {m}"
            )
    values = _engine(model_dir, value_head=True).compute_values(b)["values"]
    plain_values = _engine(model_dir, value_head=True, share_prompts=False).compute_values(b)["values"]
    torch.testing.assert_close(values, plain_values, atol=1e-5, rtol=0)
    packed = pack_sequences(b["input_ids"], b["attention_mask"], R, share_prompts=True)
    prompts = b["attention_mask"][::4, :-R].sum()
    assert packed.num_tokens == prompts + b["attention_mask"][:, -R:].sum()  # each prompt once
    assert len(packed.branches) == 3 and packed.branches == tuple(
        tuple(n for n in b["attention_mask"][g * 4 : g * 4 + 4, -R:].sum(1).tolist() if n) for g in range(3)
    )


def test_shared_prompts_turn_off_where_the_attention_cannot_keep_branches_apart(model_dir, tmp_path):
    """``share_prompts`` needs ``hyflow_varlen`` attention without sliding windows: with sdpa, or a model whose
    layers slide, the engine packs each row with its own prompt, and the log-probs of a GRPO batch still equal
    a padded HF forward (with branches, a sliding-window model's attention would raise)."""
    b = T.make_group_batch(groups=2, samples=3, seed=4)
    sliding = tmp_path / "sliding"
    shutil.copytree(model_dir, sliding)
    cfg = json.loads((sliding / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=6, max_window_layers=0)
    cfg["layer_types"] = ["sliding_attention"] * cfg["num_hidden_layers"]
    (sliding / "config.json").write_text(json.dumps(cfg))
    for path, kw in ((model_dir, {"attn_implementation": "sdpa"}), (sliding, {})):
        engine = _engine(path, **kw)
        assert not engine.share_prompts, (path, kw)
        ref_lp, _ = _padded_forward(path, b)
        out = engine.compute_log_prob(b, max_token_len=40)
        torch.testing.assert_close(
            out["log_probs"], ref_lp, atol=1e-5, rtol=0, msg=lambda m, p=path: f"{p}: {m}"
        )


def test_a_token_budget_keeps_prompt_groups_together():
    """``plan_micro_batches(prompt_groups=...)``, as the engine plans with shared prompts: a token budget splits a
    GRPO batch by its groups and counts each prompt once, which is what ``pack_sequences(share_prompts=True)``
    packs. Groups that fit stay whole; a group over the budget is cut into pieces that fit. Either way the
    batch needs fewer micro-batches than the row split, which counts the prompt in every row."""
    b = T.make_group_batch(groups=4, samples=8, seed=5)
    prompt_len = b["input_ids"].shape[1] - R
    lengths = b["attention_mask"].sum(dim=1).tolist()
    by_prompt = group_rows_by_prompt(b["input_ids"], b["attention_mask"], prompt_len)
    assert list(by_prompt.values()) == [list(range(g * 8, g * 8 + 8)) for g in range(4)]
    groups = [(len(prompt), rows) for prompt, rows in by_prompt.items()]

    def packed_tokens(rows):
        return pack_sequences(
            b["input_ids"][rows], b["attention_mask"][rows], R, share_prompts=True
        ).num_tokens

    whole = 2 * max(packed_tokens(rows) for _, rows in groups)  # two groups fit in a micro-batch
    cut = max(lengths) + 4  # a group does not, a row does
    assert cut < min(packed_tokens(rows) for _, rows in groups)
    for budget in (whole, cut):
        parts = plan_micro_batches(lengths, max_token_len=budget, prompt_groups=groups)
        assert sorted(i for p in parts for i in p) == list(range(32)), budget
        assert all(packed_tokens(p) <= budget for p in parts), budget
        assert len(parts) < len(plan_micro_batches(lengths, max_token_len=budget)), budget
    parts = plan_micro_batches(lengths, max_token_len=whole, prompt_groups=groups)
    assert len(parts) == 2 and all(
        set(rows) <= set(p) or not set(rows) & set(p) for _, rows in groups for p in parts
    )
    with pytest.raises(ValueError, match="each of the 32 rows exactly once"):
        plan_micro_batches(lengths, max_token_len=whole, prompt_groups=groups[1:])


def test_dataproto_meta_info_drives_temperature_and_micro_batching(model_dir):
    from dataproto import DataProto

    b = T.make_batch(5, seed=6)
    eng = _engine(model_dir)
    meta = {"temperature": 0.5, "use_dynamic_bsz": True, "max_token_len": 25}
    a = eng.compute_log_prob(DataProto.from_dict(b, meta_info=meta))
    c = eng.compute_log_prob(b, temperature=0.5, micro_batch_size=2)
    torch.testing.assert_close(a["log_probs"], c["log_probs"], atol=1e-6, rtol=0)
    with pytest.raises(KeyError, match="responses"):
        eng.compute_log_prob({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]})


# ----------------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------------


def test_micro_batching_does_not_change_loss_or_gradient(model_dir):
    b = T.make_batch(8, seed=7)
    eng = _engine(model_dir)
    ref_loss, ref_g = T.accumulate_grads(eng, b, T.pg_loss)  # one micro-batch
    for kw in (
        {"micro_batch_size": 1},
        {"micro_batch_size": 3},
        {"max_token_len": 30},
        {"max_token_len": 64},
    ):
        loss, g = T.accumulate_grads(eng, b, T.pg_loss, **kw)
        assert loss == pytest.approx(ref_loss, abs=1e-6), kw
        for k in ref_g:
            torch.testing.assert_close(
                g[k], ref_g[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k, kw=kw: f"{kw} {k}: {m}"
            )


def test_an_update_keeps_no_tokens_by_vocab_tensor_for_backward(model_dir):
    """What autograd saves during an update (saved-tensor hooks) holds nothing of [response tokens x vocab]:
    log-probs and entropy come from the chunked head (workers/engine/vocab_head.py). Before it, the fp32
    logits and their softmax were kept: at 16k tokens and a 150k vocabulary, 46 GiB on a GPU (issue 52)."""
    b = T.make_batch(8, seed=7)
    eng = _engine(model_dir)
    vocab = eng.model.config.vocab_size
    tokens = int(b["attention_mask"][:, -b["responses"].shape[1] :].sum())
    shapes: list[tuple[int, ...]] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        T.accumulate_grads(eng, b, T.pg_loss, calculate_entropy=True)
    by_vocab = [s for s in shapes if s and s[-1] == vocab and math.prod(s) >= tokens * vocab]
    assert shapes and not by_vocab, by_vocab


def test_compiled_layers_give_the_eager_loss_gradients_and_log_probs(model_dir):
    """``model.compile``: every decoder layer compiled in place (``compile_layers``). Packed micro-batches of
    three different token counts run through one dynamic graph and give the eager loss, gradients and
    log-probs within float rounding; the parameter names (checkpoints, weight sync) do not change."""
    b = T.make_batch(8, seed=7)
    eager, compiled = _engine(model_dir), _engine(model_dir, compile=True)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled.model))
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]
    loss, g = T.accumulate_grads(eager, b, T.pg_loss)
    c_loss, c_g = T.accumulate_grads(compiled, b, T.pg_loss, micro_batch_size=3)
    assert c_loss == pytest.approx(loss, abs=1e-6)
    for k in g:
        torch.testing.assert_close(c_g[k], g[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(
        compiled.compute_log_prob(b, max_token_len=30)["log_probs"],
        eager.compute_log_prob(b)["log_probs"],
        atol=1e-5,
        rtol=0,
    )


def test_train_steps_lr_schedule_and_mini_batches(model_dir):
    eng = _engine(model_dir)  # warm-up 2 steps, cosine to step 10, lr 1e-3
    b = T.make_batch(8, seed=8)
    m = eng.train_step(b, T.pg_loss, mini_batch_size=4, micro_batch_size=2, epochs=2, shuffle=True)
    assert m["global_step"] == 4 and m["skipped"] == 0 and len(m["losses"]) == 4
    assert m["lr"] == pytest.approx(1e-3 * (0.5 * (1 + math.cos(math.pi * 1 / 8))))
    assert "ratio_mean" in m and all(math.isfinite(x) for x in m["grad_norms"])
    before = eng.compute_log_prob(b)["log_probs"]
    for _ in range(3):
        eng.train_step(b, T.pg_loss)
    after = eng.compute_log_prob(b)["log_probs"]
    mask = b["response_mask"]
    # the surrogate pushes log-probs up where the advantage is positive
    assert ((after - before) * b["advantages"] * mask).sum() > 0
    with pytest.raises(ValueError, match="multiple of mini_batch_size=3"):
        eng.train_step(b, T.pg_loss, mini_batch_size=3)


def test_non_finite_grad_norm_step_is_skipped_and_counted(model_dir):
    eng = _engine(model_dir)
    b = T.make_batch(4, seed=9)
    eng.train_step(b, T.pg_loss)
    p0 = T.params(eng)
    opt0 = {k: v.clone() for k, v in eng.optimizer.state[next(iter(eng.model.parameters()))].items()}
    lr0 = eng.optimizer.param_groups[0]["lr"]

    def inf_loss(outputs, micro, ctx):
        loss, _ = T.pg_loss(outputs, micro, ctx)
        return loss * float("inf")

    m = eng.train_step(b, inf_loss, micro_batch_size=2)
    assert m["skipped"] == 1 and eng.skipped_steps == 1 and eng.global_step == 1
    assert not math.isfinite(m["grad_norms"][0])
    for k, v in T.params(eng).items():
        assert torch.equal(v, p0[k]), k
    state = eng.optimizer.state[next(iter(eng.model.parameters()))]
    assert all(torch.equal(state[k], opt0[k]) for k in opt0)
    assert eng.optimizer.param_groups[0]["lr"] == lr0 and all(p.grad is None for p in eng.model.parameters())
    m = eng.train_step(b, T.pg_loss)  # training goes on
    assert m["skipped"] == 0 and eng.global_step == 2 and eng.skipped_steps == 1


def test_forward_only_engine_and_offload_api(model_dir):
    b = T.make_batch(3, seed=12)
    eng = FSDPEngine(T.engine_config(model_dir))
    ref = FSDPEngine(type(eng.config)(model_path=model_dir, optim=None))
    assert ref.optimizer is None and not any(p.requires_grad for p in ref.model.parameters())
    torch.testing.assert_close(ref.compute_log_prob(b)["log_probs"], eng.compute_log_prob(b)["log_probs"])
    with pytest.raises(RuntimeError, match="forward-only"):
        ref.train_step(b, T.pg_loss)
    eng.offload()  # CPU: no-op that keeps the API; training refuses until reload()
    with pytest.raises(RuntimeError, match="reload"):
        eng.train_step(b, T.pg_loss)
    eng.reload()
    assert eng.train_step(b, T.pg_loss)["global_step"] == 1


def test_offload_moves_a_fused_adamw_step_counter_with_the_state(model_dir):
    """The engine's AdamW is fused, whose kernel reads the step counter on the parameters' device: offload and
    reload move it with the moments; a plain AdamW keeps it a CPU scalar (torch's rule). On CUDA a step left
    on the CPU failed the second update (the GPU check's grpo_step); the CUDA round trip is the gpu test below."""
    from workers.engine.fsdp_engine import moves_with_state

    eng = _engine(model_dir)
    eng.train_step(T.make_batch(3, seed=12), T.pg_loss)
    (group,) = eng.optimizer.param_groups
    assert group["fused"] and moves_with_state("step", group) and moves_with_state("exp_avg", group)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=False)
    assert not moves_with_state("step", plain.param_groups[0]) and moves_with_state(
        "exp_avg", plain.param_groups[0]
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_offload_and_reload_between_updates(model_dir):
    b = T.make_batch(3, seed=12)
    eng = _engine(model_dir)
    assert eng.device.type == "cuda"
    eng.train_step(b, T.pg_loss)
    eng.offload()
    assert all(v.device.type == "cpu" for s in eng.optimizer.state.values() for v in s.values())
    eng.reload()
    assert all(v.device.type == "cuda" for s in eng.optimizer.state.values() for v in s.values())
    assert eng.train_step(b, T.pg_loss)["global_step"] == 2


def test_activation_checkpointing_gives_same_gradient(model_dir):
    b = T.make_batch(4, seed=10)
    l1, g1 = T.accumulate_grads(_engine(model_dir), b, T.pg_loss, micro_batch_size=2)
    ac = _engine(model_dir, activation_checkpointing=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in ac.model.modules())
    l2, g2 = T.accumulate_grads(ac, b, T.pg_loss, micro_batch_size=2)
    assert l1 == pytest.approx(l2, abs=1e-7)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], atol=1e-7, rtol=1e-6)


def test_critic_values_match_padded_and_value_loss_decreases(model_dir):
    b = T.make_batch(6, seed=11)
    eng = _engine(model_dir, value_head=True)
    v = eng.compute_values(b, max_token_len=30)["values"]
    # padded reference with the same weights (value head included)
    ref = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1).eval()
    missing, unexpected = ref.load_state_dict(dict(eng.full_state_dict_iter()), strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        out = ref(b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits[
            ..., 0
        ]
    torch.testing.assert_close(v, out[:, -R - 1 : -1] * b["attention_mask"][:, -R:], atol=1e-5, rtol=0)
    losses = [eng.train_step(b, T.value_loss, micro_batch_size=3)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    with pytest.raises(TypeError, match="compute_values"):
        eng.compute_log_prob(b)


# ----------------------------------------------------------------------------------------------------------------
# checkpoints and export (single process)
# ----------------------------------------------------------------------------------------------------------------


def test_checkpoint_resume_gives_same_losses(model_dir, tmp_path):
    batches = [T.make_batch(6, seed=20 + i) for i in range(4)]
    run = dict(micro_batch_size=3, mini_batch_size=3, shuffle=True)
    a = _engine(model_dir)
    full = [a.train_step(b, T.pg_loss, **run)["losses"] for b in batches]

    b_eng = _engine(model_dir)
    for b in batches[:2]:
        b_eng.train_step(b, T.pg_loss, **run)
    path = save_checkpoint(b_eng, str(tmp_path / "ckpt"), extra={"data_pos": 2, "epoch": 0})
    assert path.endswith("step_4") and [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_4"]
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(7)
    expected_rng = (torch.rand(3), np.random.rand(), random.random())

    c = _engine(model_dir)
    torch.manual_seed(999)
    np.random.seed(999)
    random.seed(999)
    torch.manual_seed(123)  # RNG restore must not depend on the state at load time
    extra = load_checkpoint(c, path)
    assert extra == {"data_pos": 2, "epoch": 0} and c.global_step == 4
    resumed = [c.train_step(b, T.pg_loss, **run)["losses"] for b in batches[2:]]
    assert resumed == full[2:]  # bit-identical on one process
    for k, v in T.params(c).items():
        torch.testing.assert_close(v, T.params(a)[k], atol=0, rtol=0)
    # RNG states were saved with the checkpoint: reloading restores them
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(7)
    save_checkpoint(b_eng, str(tmp_path / "rng"))
    torch.rand(10)
    np.random.rand(10)
    random.random()
    load_checkpoint(c, str(tmp_path / "rng" / "step_4"))
    got = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(got[0], expected_rng[0]) and got[1:] == expected_rng[1:]


def test_fsdp_engines_are_train_engines(model_dir):
    """Role workers and checkpointing program against the `TrainEngine` protocol (the Megatron engine's
    check is in test_megatron.py)."""
    assert isinstance(_engine(model_dir), TrainEngine)
    assert isinstance(_engine(model_dir, value_head=True), TrainEngine)
    assert not isinstance(object(), TrainEngine)


def test_engine_state_round_trips_step_counters_and_lr_schedule(model_dir, tmp_path):
    """The counters and the LR schedule travel in ``state_dict()`` (through DCP), not beside it."""
    cfg = T.engine_config(model_dir)
    cfg.optim = OptimConfig(lr=1e-3, warmup_steps=5)
    eng = FSDPEngine(cfg)
    for i in range(2):
        eng.train_step(T.make_batch(4, seed=50 + i), T.pg_loss)
    eng.skipped_steps = 3
    assert eng.state_dict()["train"]["global_step"] == 2
    path = save_checkpoint(eng, str(tmp_path / "ck"))
    fresh = FSDPEngine(cfg)
    load_checkpoint(fresh, path)
    assert (fresh.global_step, fresh.skipped_steps) == (2, 3)
    assert fresh.lr_scheduler.state_dict() == eng.lr_scheduler.state_dict()
    assert fresh.optimizer.param_groups[0]["lr"] == eng.optimizer.param_groups[0]["lr"] < 1e-3  # in warm-up


def test_checkpoint_of_an_older_format_is_refused_with_its_version(model_dir, tmp_path):
    eng = _engine(model_dir)
    path = Path(save_checkpoint(eng, str(tmp_path / "ck")))
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 2}))
    with pytest.raises(CheckpointError, match="older hyflow \\(checkpoint format 2"):
        load_checkpoint(_engine(model_dir), str(path))


def test_truncated_or_incomplete_checkpoint_errors_name_the_file(model_dir, tmp_path):
    eng = _engine(model_dir)
    eng.train_step(T.make_batch(4, seed=30), T.pg_loss)
    path = tmp_path / "ck" / "step_1"
    save_checkpoint(eng, str(tmp_path / "ck"))
    shard = next((path / "model_optim").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"truncated checkpoint file .*{shard.name}"):
        load_checkpoint(eng, str(path))
    shard.write_bytes(data)
    (path / "engine_state.pt").unlink()
    with pytest.raises(CheckpointError, match="missing file .*engine_state.pt"):
        load_checkpoint(eng, str(path))
    # an interrupted save leaves only step_N.tmp, which is never loaded
    shutil.copytree(path, tmp_path / "ck2" / "step_2.tmp")
    (tmp_path / "ck2" / "step_2.tmp" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"step_2 does not exist \(an unfinished save"):
        load_checkpoint(eng, str(tmp_path / "ck2" / "step_2"))
    with pytest.raises(CheckpointError, match="missing file .*manifest.json"):
        load_checkpoint(eng, str(tmp_path / "ck2" / "step_2.tmp"))


def test_altered_checkpoint_file_fails_to_load_naming_file_and_step(model_dir, tmp_path):
    """4 KiB overwritten inside a shard without changing its size (bit rot, a bad copy) is caught by the
    content hash recorded at save: the load names the file and the step and changes nothing."""
    eng = _engine(model_dir)
    eng.train_step(T.make_batch(4, seed=30), T.pg_loss)
    path = Path(save_checkpoint(eng, str(tmp_path / "ck")))
    shard = path / "model_optim" / "__0_0.distcp"
    size = shard.stat().st_size
    # inside the largest tensor's bytes: without the hash this loads silently and trains on NaN (issue 14)
    item = max(
        FileSystemReader(str(shard.parent)).read_metadata().storage_data.values(), key=lambda i: i.length
    )
    with open(shard, "r+b") as f:
        f.seek(item.offset + item.length // 2 - 2048)
        f.write(b"\xff" * 4096)
    assert shard.stat().st_size == size
    fresh = _engine(model_dir)
    before = T.params(fresh)
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint step_1 \(step 1\) is damaged: {re.escape(str(shard))} changed after",
    ):
        load_checkpoint(fresh, str(path))
    assert fresh.global_step == 0
    for k, v in T.params(fresh).items():
        assert torch.equal(v, before[k]), k
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert set(files) == {
        "engine_state.pt", "rng_rank0.pt", "model_optim/.metadata", "model_optim/__0_0.distcp"
    }  # fmt: skip
    assert all(len(entry["xxh3_128"]) == 32 for entry in files.values())


def _fill(disk: Path, leave: int) -> None:
    """Leave ``leave`` bytes free on ``disk`` (whole pages)."""
    free = shutil.disk_usage(disk).free
    with open(disk / f"filler{len(list(disk.glob('filler*')))}", "wb") as f:
        f.write(bytes(max(0, free - leave) // 4096 * 4096))


def test_full_disk_save_names_path_and_bytes_and_keeps_previous_checkpoint(model_dir, small_disk):
    disk = small_disk("4m")
    eng = _engine(model_dir)
    eng.train_step(T.make_batch(4, seed=30), T.pg_loss)
    root = disk / "ck"
    step1 = Path(save_checkpoint(eng, str(root)))
    manifest = (step1 / "manifest.json").read_text()
    eng.train_step(T.make_batch(4, seed=31), T.pg_loss)
    needed = sum(t.numel() * t.element_size() for t in _tensors(eng.state_dict()))

    # too little space for the tensors alone: refused before anything is written
    _fill(disk, leave=needed // 2)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(eng, str(root))
    msg = str(err.value)
    assert f"no space left on device for checkpoint {root}/step_2.tmp: it needs about {needed} bytes" in msg
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]

    # room for the tensors but not for the whole checkpoint: the real ENOSPC mid-save, reported the same way
    (disk / "filler0").unlink()
    _fill(disk, leave=needed + 4096)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(eng, str(root))
    assert f"no space left on device for checkpoint {root}/step_2.tmp: it needs about {needed} bytes" in str(
        err.value
    )
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]  # the partial step_2.tmp is gone
    assert (step1 / "manifest.json").read_text() == manifest
    verify_checkpoint(step1)  # the previous checkpoint is intact and loads
    assert load_checkpoint(_engine(model_dir), str(step1)) == {}


def _tensors(state):
    if isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, torch.Tensor):
        yield state


def test_export_hf_loads_with_equal_logits(model_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eng = _engine(model_dir)
    b = T.make_batch(4, seed=40)
    eng.train_step(b, T.pg_loss)
    tok_model = Tokenizer(models.WordLevel({f"w{i}": i for i in range(T.VOCAB)}, unk_token="w3"))
    tok_model.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok_model, eos_token="w1", pad_token="w0")
    out = export_hf(eng, str(tmp_path / "hf"), tokenizer=tok)
    cfg = (tmp_path / "hf" / "config.json").read_text()
    assert "hyflow" not in cfg and "Qwen2ForCausalLM" in cfg
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids, mask = b["input_ids"], b["attention_mask"]
    with torch.no_grad():
        ref = loaded(ids, attention_mask=mask, position_ids=b["position_ids"]).logits
        eng.model.eval()
        mine = eng.model(ids, attention_mask=mask, position_ids=b["position_ids"]).logits
    torch.testing.assert_close(ref, mine, atol=1e-6, rtol=0)
    # the export is the trained model, not the initial one
    init = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        assert (init(ids, attention_mask=mask).logits - ref).abs().max() > 1e-4
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).pad_token == "w0"


def test_export_writes_a_generation_config_that_serving_engines_accept(model_dir, tmp_path):
    """A checkpoint whose generation_config.json says ``top_k: 0`` (HF reads it as "no top-k"; hyflow's tiny model
    wrote it before FORMAT_VERSION 2) is exported without it: SGLang's server takes the exported file as its
    sampling defaults and refuses every request while it says 0 ("top_k must be -1 (disable) or at least 1").
    Every other field is kept."""
    import shutil

    from transformers import GenerationConfig

    source = tmp_path / "source"
    shutil.copytree(model_dir, source)
    given = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=0, eos_token_id=1)
    given.save_pretrained(source)
    assert json.loads((source / "generation_config.json").read_text())["top_k"] == 0
    out = export_hf(_engine(source), str(tmp_path / "hf"))
    written = json.loads((Path(out) / "generation_config.json").read_text())
    assert written.get("top_k") in (None, -1) or written["top_k"] >= 1, written
    kept = GenerationConfig.from_pretrained(out)
    assert (kept.do_sample, kept.temperature, kept.top_p, kept.eos_token_id) == (True, 0.7, 0.9, 1)


# ----------------------------------------------------------------------------------------------------------------
# two gloo FSDP2 ranks vs one process
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist_results(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run_in_processes(T.dist_scenarios, 2, model_dir, str(out))
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_dp2_fsdp_matches_single_process_over_three_steps(model_dir, dist_results):
    _, res = dist_results
    batches = [T.make_batch(8, seed=100 + s) for s in range(3)]
    eng = _engine(model_dir)
    assert not eng.use_fsdp
    single = []
    for b in batches:
        m = eng.train_step(b, T.pg_loss, micro_batch_size=2, calculate_entropy=True)
        single.append(m["loss"])
    for r in range(2):
        assert res[r]["num_params"] == eng.num_params
        np.testing.assert_allclose(res[r]["losses"], single, rtol=1e-6, atol=1e-7)
    ref = T.params(eng)
    for r in range(2):
        assert set(res[r]["params"]) == set(ref)
        for k, v in ref.items():
            torch.testing.assert_close(
                res[r]["params"][k], v, atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}"
            )


def test_dp2_gradient_equals_full_batch_gradient(model_dir, dist_results):
    """DP=2 with SUM reduction, any micro-batching, equals the one-process gradient of the full batch."""
    _, res = dist_results
    b = T.make_batch(8, seed=100)
    ref_loss, ref_g = T.accumulate_grads(_engine(model_dir), b, T.pg_loss)
    for r in range(2):
        for key in ("1", "2"):
            assert res[r][f"loss_g{key}"] == pytest.approx(ref_loss, abs=1e-6)
            for k, g in ref_g.items():
                torch.testing.assert_close(res[r][f"grads_g{key}"][k], g, atol=1e-6, rtol=1e-5)


def test_dp2_log_probs_match_padded_forward(model_dir, dist_results):
    _, res = dist_results
    b = T.make_batch(8, seed=100)
    ref, _ = _padded_forward(model_dir, b)
    got = torch.cat([res[0]["log_probs"], res[1]["log_probs"]])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_dp2_checkpoint_resume_and_export(model_dir, dist_results):
    out, res = dist_results
    names = {k for k, _ in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    for r in range(2):
        assert res[r]["resume_extra"] == {"data_pos": 3} and res[r]["resume_step"] == 3
        assert (
            f"checkpoint step_3 (step 3) is damaged: {res[r]['ckpt_path']}/model_optim/__0_0.distcp"
            in (res[r]["damaged_error"])
        )
        np.testing.assert_allclose(res[r]["resume_losses"], res[r]["cont_losses"], rtol=1e-12, atol=0)
        # the resumed engine has every parameter of the one that went on (and no other), each bit-identical
        assert set(res[r]["resume_params"]) == set(res[r]["cont_params"]) == names, r
        for k, v in res[r]["cont_params"].items():
            torch.testing.assert_close(res[r]["resume_params"][k], v, atol=0, rtol=0)
    assert sorted(p.name for p in (out / "ckpt" / "step_3" / "model_optim").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    # the export holds exactly the resumed engine's tensors (the tied lm_head once, as its embedding) ...
    exported = load_file(out / "hf" / "model.safetensors")
    assert set(exported) == names
    for k, v in exported.items():
        torch.testing.assert_close(v, res[0]["resume_params"][k], atol=0, rtol=0)
    # ... and HF loads every weight from it: nothing missing (which HF would fill with a fresh random init)
    loaded, info = AutoModelForCausalLM.from_pretrained(
        out / "hf", local_files_only=True, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert set(dict(loaded.named_parameters())) == names
    for k, v in loaded.named_parameters():
        torch.testing.assert_close(v.detach(), res[0]["resume_params"][k], atol=0, rtol=0)


def test_dp2_uneven_shards_run_dummy_micro_batches(model_dir, dist_results):
    """Ranks with fewer micro-batches run zero-loss dummy passes; the result is still the full-batch one."""
    _, res = dist_results
    ub = T.uneven_batch()
    budget = int(ub["attention_mask"].sum(1).max())
    assert len(plan_micro_batches(ub["attention_mask"][:4].sum(1).tolist(), max_token_len=budget)) == 4
    ref_lp, _ = _padded_forward(model_dir, ub)
    torch.testing.assert_close(
        torch.cat([res[0]["uneven_log_probs"], res[1]["uneven_log_probs"]]), ref_lp, atol=1e-5, rtol=0
    )
    ref_loss, ref_g = T.accumulate_grads(_engine(model_dir), ub, T.pg_loss)
    for r in range(2):
        assert res[r]["uneven_loss"] == pytest.approx(ref_loss, abs=1e-6)
        for k, g in ref_g.items():
            torch.testing.assert_close(res[r]["uneven_grads"][k], g, atol=1e-6, rtol=1e-5)
