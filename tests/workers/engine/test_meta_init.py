"""Sharded engines built on the meta device: each of 2 gloo FSDP2 ranks fills only its own shards, from a
random-init directory (seeded, the same weights at any DP size) or from safetensors, with the same weights,
loss and grad norm as one process, and a peak memory well under one full copy of the model."""

from __future__ import annotations

import os

import engine_testlib as T
import meta_init_testlib as M
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from workers.config import ModelConfig, RolloutConfig
from workers.distributed import run_in_processes
from workers.engine import FSDPEngine
from workers.models import load_model
from workers.models.meta_init import RandomWeights, random_init_seed, write_random_init_model
from workers.roles.rollout import build_rollout_engine

# An embedding-heavy shape (the 0.5B's vocabulary is 27% of its weights): 131072 x 64 fp32 = 32 MiB, far
# above the noise of a process's resident memory; 129 MLP rows shard unevenly (65 + 64).
SHAPE = dict(vocab_size=131072, intermediate_size=129)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("meta_init")
    random_dir = write_random_init_model(root / "random", T.tiny_config(**SHAPE), seed=5)
    load_model(random_dir).save_pretrained(root / "ckpt")  # the same weights as safetensors
    return {"random": random_dir, "ckpt": str(root / "ckpt"), "warmup": T.make_model_dir(root / "warmup")}


@pytest.fixture(scope="module")
def dist_results(dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("meta_init_dist")
    measured = {k: dirs[k] for k in ("random", "ckpt")}
    # glibc's dynamic mmap threshold would serve large buffers from the heap after the first free, hiding
    # allocations in reused memory; a fixed threshold maps and unmaps them, so resident memory tells them
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        run_in_processes(M.meta_init_scenarios, 2, dirs["warmup"], measured, str(out))
    finally:
        if threshold is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = threshold
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_random_init_is_seeded_and_independent_of_the_pieces_asked_for(dirs):
    assert random_init_seed(dirs["random"]) == 5 and random_init_seed(dirs["ckpt"]) is None
    model = load_model(dirs["random"])
    embed = model.model.embed_tokens.weight.detach()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # ties survive materialisation
    assert embed.std().item() == pytest.approx(0.02, rel=0.02)
    assert torch.equal(model.model.norm.weight.detach(), torch.ones(64))
    piece = torch.empty(1000, 64)
    RandomWeights(5, std=0.02).fill("model.embed_tokens.weight", (131072, 64), (16000, 0), piece)
    assert torch.equal(piece, embed[16000:17000])
    other = write_random_init_model(dirs["random"] + "_seed6", T.tiny_config(**SHAPE), seed=6)
    assert not torch.equal(load_model(other).model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("key", ["random", "ckpt"])
def test_two_ranks_fill_their_shards_with_the_single_process_weights(dirs, dist_results, key):
    _, res = dist_results
    ref = {k: v.detach() for k, v in load_model(dirs[key]).named_parameters()}
    total = sum(v.numel() for v in ref.values())
    for r in range(2):
        assert set(res[r][f"{key}/params"]) == set(ref)
        for name, v in ref.items():
            assert torch.equal(res[r][f"{key}/params"][name], v), name
        assert total // 2 - 200 <= res[r][f"{key}/local_numel"] <= total // 2 + 200


@pytest.mark.parametrize("key", ["random", "ckpt"])
def test_building_a_sharded_engine_never_holds_the_whole_model(dist_results, key):
    """Peak resident growth of the engine build: this rank's half plus one random-init block (4 MiB), well
    under one fp32 copy of the model (loading it whole and then sharding, as before, grew by the full copy)."""
    _, res = dist_results
    full_kib = sum(v.numel() for v in res[0][f"{key}/params"].values()) * 4 // 1024
    for r in range(2):
        assert res[r][f"{key}/growth_kib"] < 0.8 * full_kib, (res[r][f"{key}/growth_kib"], full_kib)


@pytest.fixture(scope="module")
def one_process_step(dirs):
    """The step the two ranks take, in one process: ``key -> (metrics, weights after the step)`` (each
    directory's engine built and stepped once, when a test first asks for it)."""
    done: dict = {}

    def step(key: str):
        if key not in done:
            engine = FSDPEngine(T.engine_config(dirs[key], lr=1e-3))
            metrics = engine.train_step(T.make_batch(8, seed=7), T.pg_loss, micro_batch_size=2)
            done[key] = metrics, T.params(engine)
        return done[key]

    return step


@pytest.mark.parametrize("key", ["random", "ckpt"])
def test_two_rank_step_matches_one_process(dist_results, one_process_step, key):
    _, res = dist_results
    metrics, _ = one_process_step(key)
    for r in range(2):
        assert res[r][f"{key}/loss"] == pytest.approx(metrics["loss"], abs=1e-6)
        assert res[r][f"{key}/grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)


def test_export_is_written_by_rank_zero_and_loads_the_trained_weights(dist_results, one_process_step):
    """Rank 0 writes the random-init engine after its step: every tensor (names, shapes, values) is the weight
    the same step gives in one process, not the initial one, and HF loads all of them."""
    out, res = dist_results
    assert res[0]["export"] == str(out / "hf") and res[1]["export"] is None
    _, trained = one_process_step("random")
    initial = res[0]["random/params"]  # the two-rank engine's weights before its step
    assert set(trained) == set(initial)
    exported = load_file(out / "hf" / "model.safetensors")
    assert set(exported) == set(trained)  # the tied lm_head once, as the embedding
    moved = 0.0
    for name, weight in trained.items():
        assert exported[name].shape == weight.shape and exported[name].dtype == weight.dtype, name
        torch.testing.assert_close(
            exported[name], weight, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
        moved = max(moved, float((exported[name] - initial[name]).abs().max()))
    assert moved > 1e-4  # the step moved the weights (lr 5e-4 in the first warm-up step): the trained ones
    loaded, info = AutoModelForCausalLM.from_pretrained(
        out / "hf", local_files_only=True, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert set(dict(loaded.named_parameters())) == set(trained)
    for name, weight in loaded.named_parameters():
        assert torch.equal(weight.detach(), exported[name]), name


@pytest.mark.parametrize("key", ["random", "ckpt"])
def test_native_rollout_engine_holds_the_directory_weights(dirs, key):
    """The rollout engine is built from a model without weights and then reads them in one tensor at a time:
    the same weights as the model loaded whole (a random-init directory: the trainer's)."""
    engine = build_rollout_engine(
        ModelConfig(path=dirs[key]), RolloutConfig(prompt_length=16, response_length=4), tokenizer=None
    )
    ref = dict(load_model(dirs["random"]).named_parameters(remove_duplicate=False))
    got = dict(engine.named_weights())
    assert set(got) == set(ref)
    for name, tensor in got.items():
        assert torch.equal(tensor, ref[name].detach()), name


def test_rollout_dtype_auto_keeps_the_training_dtype_on_cpu_and_a_named_dtype_wins(dirs):
    """``rollout.dtype``: auto is the model's dtype on the CPU (bf16 on CUDA: the GPU check's grpo_step); a named
    dtype builds the engine's weights in it, rounded from the same directory; a bad name is refused by name."""
    from workers.models import resolve_dtype
    from workers.rollout.base import rollout_dtype

    model = ModelConfig(path=dirs["random"])
    assert resolve_dtype(rollout_dtype(model, RolloutConfig())) == torch.float32
    engine = build_rollout_engine(
        model, RolloutConfig(prompt_length=16, response_length=4, dtype="bfloat16"), tokenizer=None
    )
    ref = dict(load_model(dirs["random"]).named_parameters(remove_duplicate=False))
    for name, tensor in engine.named_weights():
        assert tensor.dtype == torch.bfloat16 and torch.equal(
            tensor, ref[name].detach().to(torch.bfloat16)
        ), name
    with pytest.raises(
        ValueError, match=r"dtype must be one of \['auto', 'float32', 'bfloat16', 'float16'\]"
    ):
        RolloutConfig(dtype="int8")


def test_native_engine_from_config_takes_rollout_cuda_graphs(tmp_path):
    """``rollout.cuda_graphs`` reaches ``EngineConfig.cuda_graphs`` (auto -> None): false and auto build no graphs
    on the CPU (auto: graphs with a CUDA device), true asks for them by name and is refused on the CPU."""
    from workers.rollout.native import NativeEngine

    model = ModelConfig(path=T.make_model_dir(tmp_path / "m"))
    on_cuda = torch.cuda.is_available()

    def build(value):
        return NativeEngine.from_config(
            model, RolloutConfig(prompt_length=16, response_length=4, cuda_graphs=value), tokenizer=None
        )

    off, auto = build(False), build("auto")
    assert off.config.cuda_graphs is False and off.graphs is None
    assert auto.config.cuda_graphs is None and (auto.graphs is not None) == on_cuda
    if on_cuda:
        assert build(True).graphs is not None
    else:
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
            build(True)
