"""SGLang with its own tensor parallelism (tp_size=2) fed by hyflow's weight stream.

On CPU, SGLang's TP ranks talk over gloo; each rank is bound to its own core
(``SGLANG_CPU_OMP_THREADS_BIND``, set by ``prepare_cpu_engine``: without it SGLang allows one rank per
NUMA node). On a machine with two or more GPUs the same tests run with CUDA.

What SGLang's TP needs from the resharder: ``Engine.update_weights_from_tensor`` hands every TP rank the
same named tensors and each rank's ``weight_loader`` (``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding``) narrows the FULL HF tensor to its own slice. So the
resharder's generation shards (``M / tp_g`` per rank) cannot be loaded as they are: SGLang needs the full
tensors (``M`` per rank, the resharder's ``tp_g=1`` output). ``test_sglang_tp_needs_full_tensors_per_rank``
measures those bytes with the resharder's own plan. On GPU the full tensors travel as CUDA IPC handles
(no copy per rank); each rank copies only its slice into its weights.
"""

import os

import pytest
import torch
from test_sglang_integration import (
    DEVICE,
    MAX_NEW_TOKENS,
    TEXTS,
    _batch,
    _hf_greedy,
    _hf_weights,
    _prompt_ids,
    _responses,
    make_config,
)

from tests.skips import skip_or_fail
from workers.rollout.sampling import SamplingParams

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]
if DEVICE == "cuda":
    pytestmark.append(pytest.mark.gpu)


@pytest.fixture(scope="module", autouse=True)
def sglang_tp_available(sglang_module):
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("SGLang tp_size=2 on CUDA needs two GPUs")
    if DEVICE == "cpu" and len(os.sched_getaffinity(0)) < 2:
        skip_or_fail("SGLang tp_size=2 on CPU needs two cores")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("sglang_tp") / "tiny", size="tiny", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, tokenizer, model


@pytest.fixture(scope="module")
def rollout_tp2(tiny):
    from workers.rollout.sglang import SGLangRollout

    path, tokenizer, _ = tiny
    engine = SGLangRollout(make_config(path, tokenizer, tp_size=2))
    yield engine
    engine.shutdown()


def test_tp2_greedy_equals_hf_and_follows_weight_updates(rollout_tp2, tiny):
    _, tokenizer, model = tiny
    data = _batch(tokenizer)
    first = _responses(rollout_tp2.generate_sequences(data))
    eos = set(rollout_tp2.generate_sequences(data).meta_info["eos_token_id"])
    for row, ids in enumerate(_prompt_ids(tokenizer, TEXTS)):
        assert first[row] == _hf_greedy(model, ids, eos, tokenizer.pad_token_id), f"row {row}"

    rollout_tp2.update_weights(_hf_weights(model, noise=0.05))
    assert _responses(rollout_tp2.generate_sequences(data)) != first
    rollout_tp2.update_weights(_hf_weights(model))
    assert _responses(rollout_tp2.generate_sequences(data)) == first

    ids = _prompt_ids(tokenizer, TEXTS[:1])[0]
    out = rollout_tp2.engine.loop.run_until_complete(
        rollout_tp2.generate(ids, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0))
    )
    assert out.token_ids == first[0]


def test_sglang_tp_needs_full_tensors_per_rank(rollout_tp2, tiny):
    """Bytes each SGLang TP rank is handed (full tensors) vs the resharder's generation shard for tp_g=2."""
    from workers.weight_sync.reshard_plan import GenLayout, ReshardPlan, TrainLayout, hf_param_specs

    _, _, model = tiny
    weights = _hf_weights(model)
    full_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    cfg = model.config
    specs = hf_param_specs(
        [(n, t.shape, t.dtype) for n, t in weights],
        num_layers=cfg.num_hidden_layers,
        pp=1,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
    )
    plan = ReshardPlan(specs, TrainLayout(tp=2), GenLayout(tp_g=2))
    shard_bytes = [plan.gen_shard_bytes(rank) for rank in range(2)]

    stats = rollout_tp2.update_weights(weights)
    assert stats["bytes"] == full_bytes  # one full copy, serialized for each of the 2 ranks by SGLang
    # a generation shard is half of every split tensor plus every replicated one (norms)
    assert all(full_bytes / 2 <= b < full_bytes for b in shard_bytes)
    print(
        f"SGLang TP=2: {full_bytes} B handed to each rank; resharder generation shard {shard_bytes} B per rank"
    )
