"""SGLangRollout end to end on a real ``sglang.Engine``: generate, weight updates, release/resume.

Needs the sglang package and a CUDA GPU; skipped with a reason naming what is missing otherwise
(sglang installs only on CUDA machines). Uses the locally built tiny Qwen2 model (head_dim 32, so the
triton attention backend; bf16 weights; CUDA graphs off for a fast start).
"""

import asyncio
import importlib.util

import pytest
import torch

from dataproto import DataProto
from workers.rollout.sampling import SamplingParams


def _missing() -> list[str]:
    missing = []
    if importlib.util.find_spec("sglang") is None:
        missing.append("the sglang package (pip install hyflow[sglang] on a CUDA machine)")
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU")
    return missing


pytestmark = [
    pytest.mark.sglang,
    pytest.mark.gpu,
    pytest.mark.skipif(bool(_missing()), reason="needs " + " and ".join(_missing())),
]

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("sglang") / "tiny", size="tiny", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    return path, tokenizer, model


@pytest.fixture(scope="module")
def rollout(tiny):
    from workers.rollout.sglang import SGLangRollout, SGLangRolloutConfig

    path, tokenizer, _ = tiny
    config = SGLangRolloutConfig(
        model_path=path,
        mem_fraction_static=0.3,
        dtype="bfloat16",
        attention_backend="triton",
        bucket_mb=0.25,  # a few hundred KiB: the ~2 MB bf16 model goes in several buckets
        pad_token_id=tokenizer.pad_token_id,
        response_length=MAX_NEW_TOKENS,
        sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0),
        engine_kwargs={"disable_cuda_graph": True},
    )
    engine = SGLangRollout(config)
    yield engine
    engine.shutdown()


def _prompts(tokenizer):
    texts = ["Compute 3+4*2.", "Say hello.", "def f(x):", "What is 12-5?"]
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True
        )
        for t in texts
    ]
    ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    prompts = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return DataProto.from_dict(
        tensors={"input_ids": prompts, "attention_mask": mask}, meta_info={"pad_token_id": pad}
    )


def _hf_weights(model, scale_noise: float = 0.0, seed: int = 0):
    from workers.weight_sync import hf_named_tensors

    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, tensor in hf_named_tensors(model.named_parameters(), tie_word_embeddings=True):
        if scale_noise:
            tensor = tensor + scale_noise * torch.randn(tensor.shape, generator=gen)
        out.append((name, tensor.to("cuda", torch.bfloat16)))
    return out


def test_generate_update_release_resume(rollout, tiny):
    _, tokenizer, model = tiny
    data = _prompts(tokenizer)

    first = rollout.generate_sequences(data)
    b = len(data)
    assert first.batch["responses"].shape == (b, MAX_NEW_TOKENS)
    assert first.batch["input_ids"].shape == (b, data.batch["input_ids"].shape[1] + MAX_NEW_TOKENS)
    assert set(first.meta_info["eos_token_id"]) >= {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    mask = first.batch["response_mask"].bool()
    assert mask.sum(1).min() >= 1
    lp = first.batch["rollout_log_probs"][mask]
    assert torch.isfinite(lp).all() and (lp <= 1e-4).all()
    assert set(first.non_tensor_batch["finish_reason"]) <= {"stop", "length"}
    again = rollout.generate_sequences(data)
    assert torch.equal(again.batch["responses"], first.batch["responses"])  # greedy is repeatable

    stats = rollout.update_weights(_hf_weights(model, scale_noise=0.05))
    assert stats["buckets"] > 1
    perturbed = rollout.generate_sequences(data)
    assert not torch.equal(perturbed.batch["responses"], first.batch["responses"])

    rollout.update_weights(_hf_weights(model))  # the checkpoint's own weights again
    restored = rollout.generate_sequences(data)
    assert torch.equal(restored.batch["responses"], first.batch["responses"])

    # colocated cycle: free weights + KV cache; weights back, refill them, then the KV cache
    rollout.release_memory(weights=True)
    rollout.resume_memory(kv_cache=False)
    rollout.update_weights(_hf_weights(model))
    rollout.resume_memory()
    after = rollout.generate_sequences(data)
    assert torch.equal(after.batch["responses"], first.batch["responses"])

    prompt0 = data.batch["input_ids"][0][data.batch["attention_mask"][0].bool()].tolist()
    loop = asyncio.get_event_loop()  # the loop sglang.Engine set up; its handle loop lives there
    single = loop.run_until_complete(rollout.generate(prompt0))
    n0 = int(first.batch["response_mask"][0].sum())
    assert single.token_ids == first.batch["responses"][0, :n0].tolist()
