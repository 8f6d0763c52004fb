"""workers/models/memory.py against what the code really allocates: the parameter count of the HF model, the
native engine's KV cache, the train-state bytes of the engine's AdamW; and workers/device_memory.py on CPU
(the CUDA peaks are checked by the GPU check: benchmarks/bench_grpo_step.py, BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch
import transformers

from workers.device_memory import PeakDeviceMemory
from workers.models.memory import chunk_tokens, estimate_colocated_step, kv_bytes, num_params
from workers.rollout.native import EngineConfig, NativeEngine


def _config(tie: bool = True):
    return transformers.Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie,
    )  # fmt: skip


def test_parameter_count_equals_the_models_own():
    for tie in (True, False):
        model = transformers.Qwen2ForCausalLM(_config(tie))
        assert num_params(_config(tie)) == sum(p.numel() for p in model.parameters())


def test_kv_cache_equals_the_native_engines_allocation():
    config = _config()
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    engine = NativeEngine(model, config=EngineConfig(max_num_seqs=6, max_model_len=40, eos_token_ids=[]))
    engine.generate_batch([[1, 2, 3]], None)  # the cache exists once the engine has generated
    cache = engine.model.k_cache
    assert cache is not None
    allocated = 2 * cache.numel() * cache.element_size()  # k and v
    assert kv_bytes(config, 6, 40, torch.bfloat16) == allocated


def test_train_state_is_sixteen_bytes_per_fp32_parameter_sharded_and_stages_add_up():
    config = _config()
    p = num_params(config)
    one = estimate_colocated_step(config, max_num_seqs=4, max_model_len=32, micro_batch_tokens=64,
                                  micro_batch_response_tokens=32)  # fmt: skip
    two = estimate_colocated_step(config, fsdp_world=2, max_num_seqs=4, max_model_len=32, micro_batch_tokens=64,
                                  micro_batch_response_tokens=32)  # fmt: skip
    assert one.train_state == 16 * p and two.train_state == 8 * p
    assert one.fsdp_gather == 0 and two.fsdp_gather > 0  # one fp32 rank gathers nothing
    assert one.gen == one.rollout_weights + one.kv_cache + one.sampling_logits  # trainer offloaded
    resident = estimate_colocated_step(config, max_num_seqs=4, max_model_len=32, micro_batch_tokens=64,
                                       micro_batch_response_tokens=32, trainer_offloaded_in_gen=False)  # fmt: skip
    assert resident.gen == one.gen + one.train_state
    assert one.update_actor == one.train_state + one.rollout_weights + one.activations
    # the chunked vocabulary head: three fp32 [chunk, V] buffers (here the 32 response tokens fit one chunk) and
    # the fp32 gradient of the head, whatever the entropy; the rest grows with the micro-batch's tokens
    layers = config.num_hidden_layers * (6 * config.hidden_size + 3 * config.intermediate_size)
    v, h = config.vocab_size, config.hidden_size
    assert chunk_tokens(v) > 32 and one.activations == 4 * 64 * layers + 3 * 4 * 32 * v + 4 * v * h
    long = estimate_colocated_step(config, max_num_seqs=4, max_model_len=32, micro_batch_tokens=64 + chunk_tokens(v),
                                   micro_batch_response_tokens=32 + chunk_tokens(v))  # fmt: skip
    assert (
        long.activations - one.activations
        == 4 * chunk_tokens(v) * layers + 3 * 4 * (chunk_tokens(v) - 32) * v
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_peak_device_memory_reports_nothing_without_cuda():
    with PeakDeviceMemory("gen") as peak:
        torch.zeros(1000)
    assert peak.metrics == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_peak_device_memory_is_the_stages_own_peak():
    torch.zeros(1 << 28, device="cuda")  # 1 GiB before the stage, freed: not the stage's peak
    with PeakDeviceMemory("gen") as peak:
        x = torch.zeros(1 << 26, device="cuda")  # 256 MiB
    assert 0.25 <= peak.metrics["perf/max_memory_allocated_gib/gen"] < 0.9, peak.metrics
    del x
