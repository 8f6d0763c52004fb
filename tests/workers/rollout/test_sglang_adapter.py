"""SGLang adapter without an engine: the pure conversions, the config, and the weight-update session.

The real engine (``sglang.Engine`` 0.5.20 on CPU, or on a GPU) is exercised in
``test_sglang_integration.py``. The response dicts below have the shape sglang's
``TokenizerManager._handle_batch_output`` returns (checked against the real 0.5.20 engine there).
``SessionEngine`` stands in for sglang >= 0.5.21's weight API only, which cannot be installed beside
0.5.20: it enforces the rule its scheduler enforces (``update_weights_from_tensor`` outside
``begin_weight_update()`` ... ``end_weight_update()`` returns ``(False, "... must run between ...")``,
``python/sglang/srt/managers/scheduler_components/weight_updater.py`` in the 0.5.21 wheel).
"""

import sys
import uuid

import pytest
import torch

from workers.rollout.batch import build_rollout_batch as build_rows
from workers.rollout.batch import prompt_id_lists, rows_from_outputs
from workers.rollout.sampling import GenerationOutput, SamplingParams, sampling_from_meta
from workers.rollout.sglang import (
    SGLangRollout,
    SGLangRolloutConfig,
    config_from_dict,
    expand_requests,
    output_to_generation,
    parse_finish_reason,
    to_sglang_sampling_params,
)

PAD = 0
EOS = 2

# The API-facing fields of sglang/srt/sampling/sampling_params.py::SamplingParams (msgspec Struct:
# an unknown keyword is an error there).
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

    def build_rollout_batch(prompts, mask, outputs, pad_token_id, response_length=None):  # the one builder
        rows = rows_from_outputs(prompt_id_lists(prompts, mask), outputs)
        return build_rows(
            rows, pad_token_id=pad_token_id, prompt_length=prompts.shape[1], response_length=response_length
        )

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


# ================================================================================= config


def test_config_validation_and_server_kwargs():
    cfg = SGLangRolloutConfig(model_path="/m", tp_size=2, mem_fraction_static=0.4, dtype="bfloat16", seed=7,
                              deterministic=True, attention_backend="triton",
                              engine_kwargs={"disable_cuda_graph": True})  # fmt: skip
    assert cfg.server_kwargs() == {
        "model_path": "/m", "device": "cuda", "tp_size": 2, "mem_fraction_static": 0.4, "dtype": "bfloat16",
        "random_seed": 7, "enable_memory_saver": True, "base_gpu_id": 0, "log_level": "error",
        "trust_remote_code": False, "enable_deterministic_inference": True, "attention_backend": "triton",
        "disable_cuda_graph": True,
    }  # fmt: skip
    cpu = SGLangRolloutConfig(model_path="/m", device="cpu").server_kwargs()
    assert (
        cpu["device"],
        cpu["attention_backend"],
        cpu["enable_memory_saver"],
        cpu["disable_cuda_graph"],
        cpu["sleep_on_idle"],  # else the idle scheduler spins a core
    ) == (
        "cpu",
        "torch_native",
        False,
        True,
        True,
    )
    with pytest.raises(ValueError, match="enable_memory_saver=True needs CUDA"):
        SGLangRolloutConfig(model_path="/m", device="cpu", enable_memory_saver=True)
    with pytest.raises(ValueError, match="device must be"):
        SGLangRolloutConfig(model_path="/m", device="tpu")
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


def test_missing_sglang_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` raise ImportError
    with pytest.raises(ImportError, match=r"make sglang-cpu"):
        SGLangRollout(SGLangRolloutConfig(model_path="/m"))


# ================================================================================= weight-update session


class SessionEngine:
    """Stands in for sglang >= 0.5.21's ``Engine`` weight API (see the module docstring); records calls."""

    def __init__(self, fail_bucket: int | None = None):
        self.calls: list[str] = []
        self.session = False
        self.loaded: dict[str, torch.Tensor] = {}
        self.fail_bucket = fail_bucket

    def begin_weight_update(self, selector="all"):
        self.calls.append("begin")
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append("end")
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append("update")
        if not self.session:
            return (
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
        if self.calls.count("update") - 1 == self.fail_bucket:
            return False, "boom"
        self.loaded.update(dict(named_tensors))
        return True, "Success"

    def flush_cache(self):
        self.calls.append("flush")
        return True


def _weights():
    return [(f"model.layers.{i}.mlp.up_proj.weight", torch.full((64, 64), float(i))) for i in range(4)]


def test_newer_sglang_gets_one_weight_update_session_around_all_buckets():
    engine = SessionEngine()
    rollout = SGLangRollout(SGLangRolloutConfig(model_path="/m", bucket_mb=0.02), engine=engine)
    stats = rollout.update_weights(_weights())  # 16 KiB tensors, 20 KiB buckets: one tensor per bucket
    assert stats["buckets"] == 4
    assert engine.calls == ["begin", "update", "update", "update", "update", "end", "flush"]
    assert sorted(engine.loaded) == sorted(name for name, _ in _weights())


def test_failed_bucket_closes_the_session_and_names_the_call():
    engine = SessionEngine(fail_bucket=1)
    rollout = SGLangRollout(SGLangRolloutConfig(model_path="/m", bucket_mb=0.02), engine=engine)
    with pytest.raises(RuntimeError, match="update_weights_from_tensor failed: boom"):
        rollout.update_weights(_weights())
    assert engine.calls == ["begin", "update", "update", "end"]
    assert not engine.session  # the next update can open a new session
    rollout.update_weights(_weights())
    assert engine.calls[-2:] == ["end", "flush"]


class SessionlessEngine:
    """Stands in for sglang <= 0.5.20's weight API: no session methods, tensors load directly."""

    def __init__(self):
        self.calls: list[str] = []
        self.loaded: dict[str, torch.Tensor] = {}

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append("update")
        self.loaded.update(dict(named_tensors))
        return True, "Success"

    def flush_cache(self):
        self.calls.append("flush")
        return True


def test_older_sglang_without_the_session_api_gets_the_buckets_directly():
    """The adapter opens a session only where the engine has one (0.5.20, installed here and run for real in
    test_sglang_integration.py, has none; a session call there would raise AttributeError)."""
    engine = SessionlessEngine()
    rollout = SGLangRollout(SGLangRolloutConfig(model_path="/m", bucket_mb=0.02), engine=engine)
    stats = rollout.update_weights(_weights())
    assert stats["buckets"] == 4
    assert engine.calls == ["update", "update", "update", "update", "flush"]
    assert sorted(engine.loaded) == sorted(name for name, _ in _weights())
