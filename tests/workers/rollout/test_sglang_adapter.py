"""SGLang adapter without SGLang: the pure conversions, and the adapter against a recording stand-in.

SGLang installs only on CUDA machines, so these tests never import it. The response dicts below and
``RecordingSGLangEngine`` stand in for ``sglang.Engine`` as of the sglang 0.5.7 source
(``python/sglang/srt/entrypoints/engine.py``, ``managers/tokenizer_manager.py::_handle_batch_output``,
``managers/schedule_batch.py`` finish reasons, ``sampling/sampling_params.py`` fields); the real
engine is exercised by ``test_sglang_integration.py`` where sglang and a GPU exist.
"""

import asyncio
import dataclasses
import pickle
import sys
import types
import uuid

import numpy as np
import pytest
import torch

from dataproto import DataProto
from workers.rollout.base import RolloutEngine
from workers.rollout.sampling import GenerationOutput, SamplingParams, sampling_from_meta
from workers.rollout.sglang import (
    SGLangRollout,
    SGLangRolloutConfig,
    build_rollout_batch,
    config_from_dict,
    expand_requests,
    output_to_generation,
    parse_finish_reason,
    prompt_id_lists,
    to_sglang_sampling_params,
)
from workers.rollout.sglang import rollout as rollout_module

PAD = 0
EOS = 2
VOCAB = 50

# The API-facing fields of sglang/srt/sampling/sampling_params.py::SamplingParams (msgspec Struct:
# an unknown keyword is an error there, so the stand-in rejects unknown keys too).
SGLANG_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}  # fmt: skip


def sglang_output(output_ids, logprobs, finish_reason, prompt_len, text="", with_logprobs=True):
    """One response dict in the shape sglang 0.5.7's TokenizerManager returns from Engine.generate."""
    meta = {
        "id": uuid.uuid4().hex,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_len,
        "weight_version": "default",
        "total_retractions": 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "e2e_latency": 0.01,
    }
    if with_logprobs:
        meta["input_token_logprobs"] = [(None, 5, None)] + [(-1.0, 5, None)] * (prompt_len - 1)
        meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(logprobs, output_ids)]
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


class RecordingSGLangEngine:
    """Stand-in for ``sglang.Engine`` (a CUDA-only library): same method names, signatures and return
    shapes as sglang 0.5.7, plus a record of every call. Its "model" is a toy rule over a small state
    dict, so a weight update visibly changes the generated tokens."""

    def __init__(self, **server_kwargs):
        self.server_kwargs = server_kwargs
        self.tp_size = server_kwargs.get("tp_size", 1)
        self.calls: list[tuple[str, dict]] = []
        self.state = {
            "model.embed_tokens.weight": torch.zeros(VOCAB, 4),
            "model.layers.0.self_attn.qkv_bias": torch.zeros(12, dtype=torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4),
            "model.norm.weight": torch.ones(4),
            "model.rotary.step": torch.zeros(1, dtype=torch.int64),
        }
        self.released: set[str] = set()
        self.fail_updates = False
        self.busy = False

    # ----- toy model: next = (3 * last + shift + step) % VOCAB, shift from the weights
    def _shift(self):
        return int(self.state["model.norm.weight"].sum().item()) + int(self.state["model.rotary.step"].item())

    def _run(self, ids, sp, return_logprob):
        unknown = set(sp) - SGLANG_SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword(s) {sorted(unknown)}")
        if "kv_cache" in self.released or "weights" in self.released:
            raise RuntimeError("generate called while GPU memory is released")
        stops = {EOS, *sp.get("stop_token_ids", [])}
        tokens, last = [], ids[-1]
        finish = None
        for step in range(sp.get("max_new_tokens", 128)):
            tok = (3 * last + self._shift() + step) % VOCAB
            tokens.append(tok)
            if tok in stops:
                finish = {"type": "stop", "matched": tok}
                break
            last = tok
        if finish is None:
            finish = {"type": "length", "length": len(tokens)}
        logprobs = [-0.25 - 0.01 * i for i in range(len(tokens))]
        return sglang_output(
            tokens, logprobs, finish, len(ids), text=f"<{len(tokens)} tokens>", with_logprobs=return_logprob
        )

    def _generate(self, input_ids, sampling_params, return_logprob):
        single = isinstance(input_ids[0], int)
        batch = [input_ids] if single else input_ids
        params = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(batch)
        )
        outs = []
        for ids, sp in zip(batch, params):
            for _ in range(sp.get("n", 1)):  # SGLang expands n in place: a, a, b, b
                outs.append(self._run(ids, sp, return_logprob))
        return outs[0] if single and len(outs) == 1 else outs

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, stream=False, **kwargs):  # fmt: skip
        self.calls.append(
            (
                "generate",
                dict(input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob),
            )
        )
        return self._generate(input_ids, sampling_params, return_logprob)

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=None, stream=False, **kwargs):  # fmt: skip
        self.calls.append(
            (
                "async_generate",
                dict(input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob),
            )
        )
        await asyncio.sleep(0)
        return self._generate(input_ids, sampling_params, return_logprob)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if load_format == "flattened_bucket":
            assert len(named_tensors) == self.tp_size, "one serialized payload per TP rank"
            payloads = [pickle.loads(p) for p in named_tensors]
            flat, metas = payloads[0]["flattened_tensor"], payloads[0]["metadata"]
            # what sglang's FlattenedTensorBucket.reconstruct_tensors does with the metadata
            named = [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metas]
        else:
            assert load_format is None
            named = list(named_tensors)
            pickle.dumps(named)  # Engine serializes the list once per TP rank; it must be picklable
        self.calls.append(("update_weights_from_tensor", dict(
            names=[n for n, _ in named],
            nbytes=sum(t.numel() * t.element_size() for _, t in named),
            sizes=[t.numel() * t.element_size() for _, t in named],
            dtypes={t.dtype for _, t in named},
            load_format=load_format,
            flush_cache=flush_cache,
        )))  # fmt: skip
        if self.fail_updates:
            return False, "Failed to update weights: boom"
        if "weights" in self.released:
            raise RuntimeError("update_weights_from_tensor into released weight memory")
        for name, tensor in named:
            if name not in self.state:  # sglang's load_weights: params_dict[name] -> KeyError
                raise KeyError(name)
            target = self.state[name]
            assert target.shape == tensor.shape and target.dtype == tensor.dtype, name
            target.copy_(tensor)
        return True, "Success"

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", dict(tags=tags)))
        self.released.update(tags or ["kv_cache", "weights", "cuda_graph"])

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", dict(tags=tags)))
        self.released.difference_update(tags or ["kv_cache", "weights", "cuda_graph"])

    def flush_cache(self):
        self.calls.append(("flush_cache", {}))
        # FlushCacheReqOutput(success=...): SGLang refuses to flush while requests are running
        return types.SimpleNamespace(success=not self.busy)

    def shutdown(self):
        self.calls.append(("shutdown", {}))

    def methods(self):
        return [name for name, _ in self.calls]


def expected_tokens(engine, ids, max_new_tokens, stops=(EOS,)):
    """The stand-in's rule, written out independently of the adapter."""
    shift = engine._shift()
    out, last = [], ids[-1]
    for step in range(max_new_tokens):
        tok = (3 * last + shift + step) % VOCAB
        out.append(tok)
        if tok in stops:
            break
        last = tok
    return out


def make_rollout(**overrides):
    cfg = dict(
        model_path="/models/tiny",
        bucket_mb=1.0,
        eos_token_ids=[EOS],
        sampling=SamplingParams(max_new_tokens=6, temperature=1.0),
    )
    cfg.update(overrides)
    config = SGLangRolloutConfig(**cfg)
    engine = RecordingSGLangEngine(**config.server_kwargs())
    return SGLangRollout(config, engine=engine), engine


def left_padded_prompts():
    prompts = torch.tensor([[PAD, PAD, 7, 8, 9], [11, 12, 13, PAD, 14], [PAD, PAD, PAD, PAD, 21]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    return prompts, mask


# ================================================================================= pure conversions


def test_sampling_params_map_to_sglang_keys():
    sp = SamplingParams(
        max_new_tokens=32, temperature=0.7, top_p=0.9, top_k=20, stop=["\n\n"], stop_token_ids=[5], seed=3
    )
    assert to_sglang_sampling_params(sp) == {
        "max_new_tokens": 32, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop": ["\n\n"],
        "stop_token_ids": [5], "sampling_seed": 3, "n": 1,
    }  # fmt: skip
    greedy = to_sglang_sampling_params(SamplingParams(temperature=0.0, top_k=-1))
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == -1  # SGLang: T < 1e-6 -> top_k = 1
    assert "stop" not in greedy and "stop_token_ids" not in greedy and "sampling_seed" not in greedy
    assert set(to_sglang_sampling_params(sp)) <= SGLANG_SAMPLING_FIELDS
    assert to_sglang_sampling_params(sp, seed=11)["sampling_seed"] == 11


def test_sampling_from_meta_follows_the_native_contract():
    default = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=50, stop_token_ids=[7])
    params, width = sampling_from_meta({}, default)
    assert (params.max_new_tokens, params.temperature, params.top_k, params.n, width) == (8, 0.9, 50, 1, None)
    meta = {"temperature": 0.5, "top_p": 0.8, "n": 4, "seed": 3, "stop": ["\n"], "stop_token_ids": [9, 7]}
    params, _ = sampling_from_meta({**meta, "eos_token_id": [2, 9]}, default)
    assert (params.temperature, params.top_p, params.n, params.seed, params.stop) == (0.5, 0.8, 4, 3, ["\n"])
    assert params.stop_token_ids == [7, 9, 2]  # configured + meta stop ids + eos ids, deduplicated
    greedy, _ = sampling_from_meta({**meta, "do_sample": False}, default)
    assert (greedy.temperature, greedy.top_p, greedy.top_k, greedy.n) == (0.0, 1.0, -1, 1)
    assert sampling_from_meta({"validate": True}, default)[0].temperature == 0.0
    assert sampling_from_meta({"validate": True, "do_sample": True}, default)[0].temperature == 0.9
    # response_length pads and caps; max_new_tokens defaults to it
    assert sampling_from_meta({"response_length": 5}, default)[0].max_new_tokens == 5
    params, width = sampling_from_meta({"response_length": 5, "max_new_tokens": 9}, default)
    assert (params.max_new_tokens, width) == (5, 5)
    params, width = sampling_from_meta({"max_new_tokens": 3}, default, response_length=6)
    assert (params.max_new_tokens, width) == (3, 6)
    with pytest.raises(ValueError, match="top_p"):
        sampling_from_meta({"top_p": 0.0}, default)  # SamplingParams validation


def test_prompt_id_lists_strip_left_padding():
    prompts, mask = left_padded_prompts()
    assert prompt_id_lists(prompts, mask) == [[7, 8, 9], [11, 12, 13, PAD, 14], [21]]  # pad inside kept
    wide_mask = torch.cat([mask, torch.ones(3, 4, dtype=torch.long)], dim=1)  # [B, P + R] also works
    assert prompt_id_lists(prompts, wide_mask) == prompt_id_lists(prompts, mask)
    assert prompt_id_lists(prompts, pad_token_id=PAD) == [[7, 8, 9], [11, 12, 13, PAD, 14], [21]]
    with pytest.raises(ValueError, match="no tokens"):
        prompt_id_lists(torch.tensor([[PAD, PAD]]), torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="attention_mask or a pad_token_id"):
        prompt_id_lists(prompts)


def test_expand_requests_interleaves_and_seeds_each_row():
    ids, params, source = expand_requests([[1, 2], [3]], SamplingParams(n=3, seed=100))
    assert ids == [[1, 2]] * 3 + [[3]] * 3
    assert source == [0, 0, 0, 1, 1, 1]
    assert [p["sampling_seed"] for p in params] == [100, 101, 102, 103, 104, 105]
    assert all(p["n"] == 1 for p in params)
    _, unseeded, _ = expand_requests([[1]], SamplingParams(n=2))
    assert all("sampling_seed" not in p for p in unseeded)


def test_parse_finish_reason_shapes():
    assert parse_finish_reason({"type": "stop", "matched": 2}) == "stop"  # FINISH_MATCHED_TOKEN
    assert parse_finish_reason({"type": "stop", "matched": "\n\n"}) == "stop"  # FINISH_MATCHED_STR
    assert parse_finish_reason({"type": "length", "length": 8}) == "length"  # FINISH_LENGTH
    assert (
        parse_finish_reason({"type": "abort", "message": "x", "status_code": 400, "err_type": None})
        == "abort"
    )
    assert parse_finish_reason(None) == "abort"
    assert parse_finish_reason("length") == "length"
    with pytest.raises(ValueError, match="unknown"):
        parse_finish_reason({"type": "eos"})


def test_output_to_generation_from_sglang_response():
    """Input stands in for sglang.Engine.generate output, version 0.5.7."""
    raw = sglang_output(
        [4, 9, 2], [-0.5, -1.25, -0.01], {"type": "stop", "matched": 2}, prompt_len=3, text="ab"
    )
    gen = output_to_generation(raw)
    assert gen == GenerationOutput(
        token_ids=[4, 9, 2], log_probs=[-0.5, -1.25, -0.01], finish_reason="stop", text="ab"
    )
    assert output_to_generation(raw, want_log_probs=False).log_probs is None
    no_ids = {"meta_info": raw["meta_info"]}  # ids can be recovered from the log-prob tuples
    assert output_to_generation(no_ids).token_ids == [4, 9, 2]
    bad = sglang_output([4, 9], [-0.5, -1.0], {"type": "length", "length": 2}, 3)
    bad["meta_info"]["output_token_logprobs"][1] = (-1.0, 8, None)
    with pytest.raises(ValueError, match="differ"):
        output_to_generation(bad)
    short = sglang_output([4, 9], [-0.5], {"type": "length", "length": 2}, 3)
    short["meta_info"]["output_token_logprobs"] = short["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(ValueError, match="1 output log-probs for 2"):
        output_to_generation(short)
    plain = sglang_output([4], [], {"type": "length", "length": 1}, 3, with_logprobs=False)
    with pytest.raises(KeyError, match="return_logprob"):
        output_to_generation(plain)


def test_build_rollout_batch_layout():
    prompts, mask = left_padded_prompts()
    outputs = [
        GenerationOutput([30, 31, EOS], [-0.1, -0.2, -0.3], "stop"),
        GenerationOutput([40, 41, 42, 43], [-1.0, -1.0, -1.0, -1.0], "length"),
        GenerationOutput([], [], "abort"),
    ]
    t = build_rollout_batch(prompts, mask, outputs, pad_token_id=PAD, response_length=4)
    assert t["responses"].tolist() == [[30, 31, EOS, PAD], [40, 41, 42, 43], [PAD] * 4]
    assert t["responses"].dtype == torch.int64 and t["response_mask"].dtype == torch.float32
    assert t["response_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert t["rollout_log_probs"].dtype == torch.float32
    assert torch.allclose(t["rollout_log_probs"][0], torch.tensor([-0.1, -0.2, -0.3, 0.0]))
    assert torch.equal(t["input_ids"], torch.cat([prompts, t["responses"]], dim=1))
    assert t["attention_mask"].tolist()[0] == [0, 0, 1, 1, 1, 1, 1, 1, 0]
    assert t["position_ids"].tolist()[0] == [0, 0, 0, 1, 2, 3, 4, 5, 5]
    assert t["position_ids"].tolist()[2] == [0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert torch.equal(t["prompts"], prompts)
    longest = build_rollout_batch(prompts, mask, outputs, pad_token_id=PAD)  # no width: the longest
    assert longest["responses"].shape == (3, 4)
    no_lp = build_rollout_batch(prompts[:1], mask[:1], [GenerationOutput([1], None, "length")], PAD, 2)
    assert "rollout_log_probs" not in no_lp
    with pytest.raises(ValueError, match="more than response_length"):
        build_rollout_batch(prompts[:1], mask[:1], [outputs[1]], PAD, 3)


def test_config_validation_and_server_kwargs():
    cfg = SGLangRolloutConfig(model_path="/m", tp_size=2, mem_fraction_static=0.4, dtype="bfloat16", seed=7,
                              deterministic=True, attention_backend="triton",
                              engine_kwargs={"disable_cuda_graph": True})  # fmt: skip
    assert cfg.server_kwargs() == {
        "model_path": "/m", "tp_size": 2, "mem_fraction_static": 0.4, "dtype": "bfloat16", "random_seed": 7,
        "enable_memory_saver": True, "base_gpu_id": 0, "log_level": "error", "trust_remote_code": False,
        "enable_deterministic_inference": True, "attention_backend": "triton", "disable_cuda_graph": True,
    }  # fmt: skip
    with pytest.raises(ValueError, match="own config entries"):
        SGLangRolloutConfig(model_path="/m", engine_kwargs={"tp_size": 2}).server_kwargs()
    with pytest.raises(ValueError, match="weight_load_format"):
        SGLangRolloutConfig(model_path="/m", weight_load_format="disk")
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangRolloutConfig(model_path="/m", mem_fraction_static=1.5)
    with pytest.raises(KeyError, match="tp"):
        config_from_dict({"model_path": "/m", "tp": 2})
    assert (
        config_from_dict({"model_path": "/m", "sampling": {"max_new_tokens": 9}}).sampling.max_new_tokens == 9
    )


# ================================================================================= adapter + stand-in


def test_missing_sglang_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` raise ImportError
    with pytest.raises(ImportError, match=r"pip install hyflow\[sglang\] on a CUDA machine"):
        SGLangRollout(SGLangRolloutConfig(model_path="/m"))


def test_engine_is_built_from_server_args(monkeypatch):
    fake = types.ModuleType("sglang")
    fake.Engine = RecordingSGLangEngine
    monkeypatch.setitem(sys.modules, "sglang", fake)
    config = SGLangRolloutConfig(model_path="/models/q", tp_size=2, seed=5)
    rollout = SGLangRollout(config)
    assert isinstance(rollout.engine, RecordingSGLangEngine)
    assert rollout.engine.server_kwargs == config.server_kwargs()


def test_generate_sequences_matches_batch_layout_and_engine_outputs():
    rollout, engine = make_rollout()
    assert isinstance(rollout, RolloutEngine)
    prompts, mask = left_padded_prompts()
    data = DataProto.from_dict(
        tensors={
            "input_ids": prompts,
            "attention_mask": mask,
            "position_ids": torch.clamp(mask.cumsum(1) - 1, min=0),
            "row_tag": torch.tensor([10, 20, 30]),
        },
        non_tensors={"uid": np.array(["a", "b", "c"], dtype=object)},
        meta_info={"pad_token_id": PAD, "n": 2, "max_new_tokens": 6, "response_length": 8, "step": 3},
    )
    out = rollout.generate_sequences(data)

    name, call = engine.calls[-1]
    assert name == "generate" and call["return_logprob"] is True
    assert call["input_ids"] == [[7, 8, 9]] * 2 + [[11, 12, 13, PAD, 14]] * 2 + [[21]] * 2
    assert all(sp == {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 1}
               for sp in call["sampling_params"])  # fmt: skip

    assert len(out) == 6
    assert out.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "b", "c", "c"]
    assert out.batch["row_tag"].tolist() == [10, 10, 20, 20, 30, 30]  # other tensors repeated too
    assert out.batch["prompts"].shape == (6, 5) and out.batch["responses"].shape == (6, 8)
    assert torch.equal(out.batch["prompts"], prompts.repeat_interleave(2, dim=0))
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert out.batch[key].shape == (6, 13)
    for row, ids in enumerate(call["input_ids"]):
        want = expected_tokens(engine, ids, 6)
        got = out.batch["responses"][row]
        assert got[: len(want)].tolist() == want
        assert (got[len(want) :] == PAD).all()
        assert out.batch["response_mask"][row].sum().item() == len(want)
        assert torch.allclose(
            out.batch["rollout_log_probs"][row],
            torch.tensor([-0.25 - 0.01 * i if i < len(want) else 0.0 for i in range(8)]),
        )
    assert out.batch["response_mask"].dtype == torch.float32
    mask_full = out.batch["attention_mask"]
    assert torch.equal(mask_full[:, 5:].float(), out.batch["response_mask"])
    assert torch.equal(out.batch["position_ids"], torch.clamp(mask_full.cumsum(1) - 1, min=0))
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], out.batch["responses"]], 1))
    assert out.meta_info["pad_token_id"] == PAD and out.meta_info["eos_token_id"] == [EOS]
    assert out.meta_info["step"] == 3 and out.meta_info["timing_s/gen"] >= 0
    assert out.meta_info["rollout/generated_tokens"] == int(out.batch["response_mask"].sum())

    greedy = rollout.generate_sequences(DataProto.from_dict(
        tensors={"input_ids": prompts, "attention_mask": mask}, meta_info={"pad_token_id": PAD, "do_sample": False, "n": 4}
    ))  # fmt: skip
    assert len(greedy) == 3  # greedy: n = 1
    assert all(sp["temperature"] == 0.0 for sp in engine.calls[-1][1]["sampling_params"])
    longest = max(len(expected_tokens(engine, ids, 6)) for ids in prompt_id_lists(prompts, mask))
    assert greedy.batch["responses"].shape == (3, longest)  # no response_length: pad to the longest


def test_pad_token_from_engine_tokenizer():
    rollout, engine = make_rollout()
    engine.tokenizer_manager = types.SimpleNamespace(
        tokenizer=types.SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    )
    prompts, _ = left_padded_prompts()
    out = rollout.generate_sequences(DataProto.from_dict(tensors={"input_ids": prompts}))
    assert engine.calls[-1][1]["input_ids"] == [[7, 8, 9], [11, 12, 13, 14], [21]]  # no mask: pads dropped
    assert out.meta_info["pad_token_id"] == PAD


def test_async_generate_one_request():
    rollout, engine = make_rollout()
    out = asyncio.run(rollout.generate([5, 6], SamplingParams(max_new_tokens=4, stop_token_ids=[17])))
    name, call = engine.calls[-1]
    assert name == "async_generate" and call["input_ids"] == [5, 6]
    assert call["sampling_params"]["stop_token_ids"] == [17]
    assert out.token_ids == expected_tokens(engine, [5, 6], 4, stops=(EOS, 17))
    assert out.finish_reason in ("stop", "length") and len(out.log_probs) == len(out.token_ids)

    many = asyncio.run(rollout.generate([5], SamplingParams(n=3, seed=10, max_new_tokens=2)))
    assert isinstance(many, list) and len(many) == 3
    call = engine.calls[-1][1]
    assert call["input_ids"] == [[5]] * 3
    assert [sp["sampling_seed"] for sp in call["sampling_params"]] == [10, 11, 12]
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(rollout.generate([]))


def _new_weights(engine, scale=1.0):
    return [
        (name, torch.full_like(t, scale) if t.is_floating_point() else t + 1)
        for name, t in engine.state.items()
    ]


def test_update_weights_in_bounded_buckets_changes_outputs():
    rollout, engine = make_rollout(bucket_mb=150 / 2**20)  # a 150-byte bound
    before = asyncio.run(rollout.generate([5, 6], SamplingParams(max_new_tokens=5)))
    new = _new_weights(engine, scale=2.0)
    stats = rollout.update_weights(iter(new))

    updates = [c for n, c in engine.calls if n == "update_weights_from_tensor"]
    assert [name for c in updates for name in c["names"]] == [n for n, _ in new]  # order kept
    assert len(updates) >= 3
    for c in updates:
        assert c["nbytes"] <= 150 or len(c["names"]) == 1  # the 800-byte embedding travels alone
    assert all(c["flush_cache"] is False for c in updates)
    assert engine.methods()[-1] == "flush_cache"  # one flush, after the last bucket
    assert engine.methods().count("flush_cache") == 1
    assert stats["buckets"] == len(updates) and stats["tensors"] == len(new)
    assert stats["bytes"] == sum(t.numel() * t.element_size() for _, t in new)
    for name, tensor in new:
        assert torch.equal(engine.state[name], tensor)
    after = asyncio.run(rollout.generate([5, 6], SamplingParams(max_new_tokens=5)))
    assert after.token_ids != before.token_ids

    n_calls = len(engine.calls)
    rollout.update_weights([], flush_cache=True)  # nothing to send: no engine call
    assert len(engine.calls) == n_calls


def test_update_weights_raises_on_engine_failure():
    rollout, engine = make_rollout()
    engine.fail_updates = True
    with pytest.raises(RuntimeError, match="boom"):
        rollout.update_weights(_new_weights(engine))
    engine.fail_updates, engine.busy = False, True
    with pytest.raises(RuntimeError, match="running requests"):
        rollout.update_weights(_new_weights(engine))


def test_release_resume_tags_and_refill_order():
    rollout, engine = make_rollout()
    rollout.release_memory()
    assert engine.calls[-1] == ("release_memory_occupation", {"tags": ["kv_cache"]})
    rollout.release_memory(weights=True)  # kv_cache already released: only weights now
    assert engine.calls[-1] == ("release_memory_occupation", {"tags": ["weights"]})
    rollout.release_memory(weights=True)  # nothing left to release
    assert engine.methods().count("release_memory_occupation") == 2

    with pytest.raises(RuntimeError, match="resume_memory"):
        rollout.update_weights(_new_weights(engine))  # same rule as the native engine

    engine.calls.clear()  # colocated order: weights back, refill them, then the KV cache
    rollout.resume_memory(kv_cache=False)
    rollout.update_weights(_new_weights(engine, scale=3.0))
    assert engine.calls[0] == ("resume_memory_occupation", {"tags": ["weights"]})
    assert engine.calls[1][0] == "update_weights_from_tensor"
    assert engine.released == {"kv_cache"}
    rollout.resume_memory()
    assert engine.calls[-1] == ("resume_memory_occupation", {"tags": ["kv_cache"]})
    assert engine.released == set() and rollout.released_tags == set()

    rollout.release_memory(weights=True)
    assert engine.calls[-1] == ("release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    rollout.resume_memory()
    assert engine.calls[-1] == ("resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    n_calls = len(engine.calls)
    rollout.resume_memory()  # nothing released: no call
    assert len(engine.calls) == n_calls
    rollout.flush_cache()
    rollout.shutdown()
    assert engine.methods()[-2:] == ["flush_cache", "shutdown"]

    graph_rollout, graph_engine = make_rollout(release_cuda_graph=True)
    graph_rollout.release_memory()
    assert graph_engine.calls[-1] == ("release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    graph_rollout.resume_memory()
    assert graph_engine.calls[-1] == ("resume_memory_occupation", {"tags": ["cuda_graph", "kv_cache"]})


@dataclasses.dataclass
class FakeFlattenedTensorMetadata:
    """Same fields as sglang/srt/weight_sync/tensor_bucket.py::FlattenedTensorMetadata."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@pytest.mark.parametrize("multi_dtype", [True, False])
def test_flattened_bucket_updates(monkeypatch, multi_dtype):
    """load_format='flattened_bucket': one serialized {flattened_tensor, metadata} per TP rank per bucket
    (pickle stands in for sglang's MultiprocessingSerializer)."""
    monkeypatch.setattr(
        rollout_module,
        "_flattened_bucket_api",
        lambda: (FakeFlattenedTensorMetadata, pickle.dumps, multi_dtype),
    )
    rollout, engine = make_rollout(weight_load_format="flattened_bucket", tp_size=2)
    new = _new_weights(engine, scale=-1.5)
    rollout.update_weights(new)
    updates = [c for n, c in engine.calls if n == "update_weights_from_tensor"]
    assert all(c["load_format"] == "flattened_bucket" for c in updates)
    assert all(c["flush_cache"] is False for c in updates) and engine.methods()[-1] == "flush_cache"
    if multi_dtype:
        assert len(updates) == 1  # 976 bytes fit one 1 MiB bucket
    else:
        assert all(len(c["dtypes"]) == 1 for c in updates) and len(updates) == 3  # fp32, bf16, int64
    for name, tensor in new:
        assert torch.equal(engine.state[name], tensor), name


def test_seed_without_deterministic_engine_warns_once(caplog):
    rollout, _ = make_rollout()
    prompts, mask = left_padded_prompts()
    data = DataProto.from_dict(
        tensors={"input_ids": prompts, "attention_mask": mask},
        meta_info={"pad_token_id": PAD, "seed": 1},
    )
    with caplog.at_level("WARNING"):
        rollout.generate_sequences(data)
        rollout.generate_sequences(data)
    assert sum("enable_deterministic_inference" in r.message for r in caplog.records) == 1
