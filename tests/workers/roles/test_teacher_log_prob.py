"""The reference as a hint-conditioned teacher (``RefWorker.compute_teacher_log_prob``): with no hint it IS
the reference (bit-exact); with a hint its log-probs are those of the same response tokens after
[prompt + hint], aligned by position with ``responses`` -- checked against a plain Hugging Face forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from controller import RayClassWithInitArgs, RayWorkerGroup
from dataproto import DataProto
from resource_pools import ResourcePool
from workers.config import ModelConfig, RolloutConfig
from workers.roles import RefWorker
from workers.roles.reference import build_teacher_inputs

pytestmark = pytest.mark.timeout(180)
P, R = 8, 6


@pytest.fixture(scope="module")
def model_dir():
    from workers.models.tiny import ensure_tiny_model

    return ensure_tiny_model("nano")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from workers.models import load_tokenizer

    return load_tokenizer(model_dir)


def make_batch(tokenizer) -> DataProto:
    """Three rows: left-padded prompts of different lengths, right-padded responses (one shorter)."""
    pad = tokenizer.pad_token_id
    texts = [("Compute 12+30.", "<python>print(42)"), ("Hi", "\\boxed{7} ok"), ("What is 5*5 then", "25")]
    prompts = torch.full((3, P), pad)
    responses = torch.full((3, R), pad)
    mask = torch.zeros(3, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(texts):
        p_ids = tokenizer.encode(p, add_special_tokens=False)[-P:]
        r_ids = tokenizer.encode(r, add_special_tokens=False)[:R]
        prompts[i, P - len(p_ids) :] = torch.tensor(p_ids)
        responses[i, : len(r_ids)] = torch.tensor(r_ids)
        mask[i, P - len(p_ids) : P] = 1
        mask[i, P : P + len(r_ids)] = 1
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        },
        meta_info={"temperature": 1.0},
    )


def test_build_teacher_inputs_alignment(tokenizer):
    data = make_batch(tokenizer)
    b = data.batch
    hints = [[101, 102, 103], [], [104]]
    out = build_teacher_inputs(b["prompts"], b["responses"], b["attention_mask"], hints, pad_token_id=3)
    H = 3
    assert out["input_ids"].shape == (3, P + H + R)
    assert torch.equal(out["input_ids"][:, P + H :], b["responses"])  # responses at the same columns
    assert torch.equal(out["attention_mask"][:, P + H :], b["attention_mask"][:, P:])
    for i, h in enumerate(hints):
        real = b["prompts"][i][b["attention_mask"][i, :P].bool()].tolist()
        kept = out["input_ids"][i, : P + H][out["attention_mask"][i, : P + H].bool()].tolist()
        assert kept == real + h  # the hint follows the real prompt, padding stays on the left
    empty = build_teacher_inputs(b["prompts"], b["responses"], b["attention_mask"], [[], [], []], 3)
    assert torch.equal(empty["input_ids"], b["input_ids"]) and torch.equal(
        empty["attention_mask"], b["attention_mask"]
    )


@pytest.fixture(scope="module")
def ref_group(ray_session, model_dir):
    pool = ResourcePool([1], name="teacher_ref1")
    wg = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(RefWorker, model=ModelConfig(path=model_dir), rollout=RolloutConfig()),
        name_prefix="teacher_ref",
    )
    wg.init_model()
    yield wg
    wg.shutdown()
    pool.remove()


def test_teacher_equals_reference_without_hint(ref_group, tokenizer):
    data = make_batch(tokenizer)
    ref = ref_group.compute_ref_log_prob(data).batch["ref_log_prob"]
    data.non_tensor_batch["teacher_hint"] = np.array(["", "", ""], dtype=object)
    teacher = ref_group.compute_teacher_log_prob(data).batch["teacher_log_prob"]
    assert torch.equal(teacher, ref)
    del data.non_tensor_batch["teacher_hint"]  # a batch without the column: no hints either
    assert torch.equal(ref_group.compute_teacher_log_prob(data).batch["teacher_log_prob"], ref)


def test_teacher_with_hint_matches_hf_forward_at_response_positions(ref_group, tokenizer, model_dir):
    from transformers import AutoModelForCausalLM

    data = make_batch(tokenizer)
    hints = ["Hint: use python.\n", "", "Hint: 25\n"]
    data.non_tensor_batch["teacher_hint"] = np.array(hints, dtype=object)
    out = ref_group.compute_teacher_log_prob(data)
    teacher = out.batch["teacher_log_prob"]
    assert out.meta_info["metrics"]["teacher/rows_with_hint"] == 2.0
    ref = ref_group.compute_ref_log_prob(data).batch["ref_log_prob"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    b = data.batch
    for i, h in enumerate(hints):
        real_p = b["prompts"][i][b["attention_mask"][i, :P].bool()].tolist()
        n_resp = int(b["attention_mask"][i, P:].sum())
        resp = b["responses"][i, :n_resp].tolist()
        h_ids = tokenizer.encode(h, add_special_tokens=False) if h else []
        ids = torch.tensor([real_p + h_ids + resp])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        start = len(real_p) + len(h_ids)
        lp = torch.log_softmax(logits[start - 1 : start - 1 + n_resp], -1).gather(
            1, torch.tensor(resp)[:, None]
        )[:, 0]
        assert torch.allclose(teacher[i, :n_resp], lp, atol=1e-4), i
        assert torch.all(teacher[i, n_resp:] == 0)  # response padding
        if h:
            assert not torch.allclose(teacher[i, :n_resp], ref[i, :n_resp], atol=1e-4)  # the hint matters
        else:
            assert torch.allclose(teacher[i], ref[i], atol=1e-5)
