"""Shared pieces of the engine tests: a tiny random Qwen2 on disk, synthetic RL batches, simple losses, and
the body that spawned gloo ranks run (module-level, so `torch.multiprocessing` spawn can import it)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB = 256
PAD = 0


def tiny_config(**overrides):
    from transformers import Qwen2Config

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=1,
        bos_token_id=2,
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def make_model_dir(path: str | os.PathLike, seed: int = 0, **overrides) -> str:
    """Save a random-init tiny Qwen2ForCausalLM to ``path``."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(**overrides))
    model.save_pretrained(path)
    return str(path)


def make_batch(n: int, prompt_len: int = 12, resp_len: int = 10, seed: int = 0, min_len: int = 2) -> dict:
    """A batch in the BATCH_LAYOUT.md layout with random prompt/response lengths (left/right padding)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.full((n, prompt_len), PAD, dtype=torch.long)
    responses = torch.full((n, resp_len), PAD, dtype=torch.long)
    p_mask = torch.zeros(n, prompt_len, dtype=torch.long)
    r_mask = torch.zeros(n, resp_len, dtype=torch.long)
    for i in range(n):
        pl = int(torch.randint(min_len, prompt_len + 1, (1,), generator=g))
        rl = int(torch.randint(1, resp_len + 1, (1,), generator=g))
        prompts[i, prompt_len - pl :] = torch.randint(3, VOCAB, (pl,), generator=g)
        responses[i, :rl] = torch.randint(3, VOCAB, (rl,), generator=g)
        p_mask[i, prompt_len - pl :] = 1
        r_mask[i, :rl] = 1
    attention_mask = torch.cat([p_mask, r_mask], dim=1)
    response_mask = r_mask.float()
    # a "multi-turn" hole: an observation token in the middle of one response is not trained on
    if resp_len >= 4 and n > 0:
        response_mask[0, 1] = 0.0
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "advantages": torch.randn(n, resp_len, generator=g) * response_mask,
        "old_log_probs": (-torch.rand(n, resp_len, generator=g) * 5) * response_mask,
        "returns": torch.randn(n, resp_len, generator=g) * response_mask,
    }


def make_group_batch(
    groups: int, samples: int, prompt_len: int = 12, resp_len: int = 10, seed: int = 0
) -> dict:
    """``make_batch``'s layout with GRPO's rows: ``samples`` consecutive rows per prompt, each with its own
    response (random lengths; one row's response is empty)."""
    batch = make_batch(groups * samples, prompt_len, resp_len, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for group in range(groups):
        rows = slice(group * samples, (group + 1) * samples)
        batch["prompts"][rows] = batch["prompts"][group * samples]
        batch["attention_mask"][rows, :prompt_len] = batch["attention_mask"][group * samples, :prompt_len]
    empty = int(torch.randint(0, groups * samples, (1,), generator=g))
    batch["responses"][empty] = PAD
    batch["attention_mask"][empty, prompt_len:] = 0
    batch["response_mask"][empty] = 0.0
    batch["advantages"][empty] = 0.0
    batch["input_ids"] = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    batch["position_ids"] = (batch["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)
    return batch


def pg_loss(outputs, micro, ctx):
    """Token-mean PPO-style surrogate (no clipping) + a small entropy bonus when entropy is present;
    normalised by the global token count, as the engine's contract asks."""
    mask = micro["response_mask"]
    ratio = torch.exp(outputs["log_probs"] - micro["old_log_probs"])
    per_token = -micro["advantages"] * ratio
    if "entropy" in outputs:
        per_token = per_token - 0.01 * outputs["entropy"]
    loss = (per_token * mask).sum() / ctx.global_num_tokens
    return loss, {"ratio_mean": (ratio.detach() * mask).sum() / mask.sum().clamp(min=1)}


def value_loss(outputs, micro, ctx):
    mask = micro["response_mask"]
    return 0.5 * (((outputs["values"] - micro["returns"]) ** 2) * mask).sum() / ctx.global_num_tokens


def engine_config(model_dir: str, lr: float = 1e-3, **kw):
    from workers.engine import EngineConfig, OptimConfig

    optim = kw.pop("optim", None) or OptimConfig(
        lr=lr, grad_clip=1.0, warmup_steps=2, lr_schedule="cosine", total_steps=10
    )
    return EngineConfig(model_path=model_dir, optim=optim, **kw)


def params(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict_iter()}


def grads(engine) -> dict[str, torch.Tensor]:
    """Full gradients (gathering DTensor shards), by parameter name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in engine.model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = g.detach().clone()
    return out


def accumulate_grads(engine, batch, loss_fn, **micro_kw) -> tuple[float, dict]:
    """Forward/backward of the whole batch through the engine's micro-batching without stepping:
    uses a loss_fn wrapper and inspects the gradients before the optimizer runs."""
    captured = {}

    def capture_and_skip(outputs, micro, ctx):
        return loss_fn(outputs, micro, ctx)

    orig = engine._clip_and_step

    def fake_step():
        captured["grads"] = grads(engine)
        engine.optimizer.zero_grad(set_to_none=True)
        return 0.0, False

    engine._clip_and_step = fake_step
    try:
        m = engine.train_step(batch, capture_and_skip, **micro_kw)
    finally:
        engine._clip_and_step = orig
    return m["loss"], captured["grads"]


def shard_rows(batch: dict, rank: int, world: int) -> dict:
    n = next(iter(batch.values())).shape[0]
    per = n // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------------------------
# what each spawned gloo rank runs
# ---------------------------------------------------------------------------------------------------------------


def dist_scenarios(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    """All multi-process checks in one spawn (process start-up dominates the cost). Results go to
    ``out_dir/rank<r>.pt``; the test compares them with single-process runs."""
    from workers.engine import CheckpointError, FSDPEngine, export_hf, load_checkpoint, save_checkpoint

    out = Path(out_dir)
    res: dict = {}
    batches = [make_batch(8, seed=100 + s) for s in range(3)]

    eng = FSDPEngine(engine_config(model_dir))
    assert eng.use_fsdp and eng.dp_size == world
    res["num_params"] = eng.num_params
    # log-probs (dynamic token budget) of this rank's rows
    res["log_probs"] = eng.compute_log_prob(shard_rows(batches[0], rank, world), max_token_len=40)[
        "log_probs"
    ]
    # gradient of one mini-batch, two different micro-batch layouts
    res["loss_g1"], res["grads_g1"] = accumulate_grads(
        eng, shard_rows(batches[0], rank, world), pg_loss, micro_batch_size=1
    )
    res["loss_g2"], res["grads_g2"] = accumulate_grads(
        eng, shard_rows(batches[0], rank, world), pg_loss, max_token_len=45
    )
    # 3 optimizer steps
    res["losses"] = []
    res["grad_norms"] = []
    for b in batches:
        m = eng.train_step(shard_rows(b, rank, world), pg_loss, micro_batch_size=2, calculate_entropy=True)
        res["losses"].append(m["loss"])
        res["grad_norms"].append(m["grad_norms"][0])
    res["params"] = params(eng)
    # checkpoint: save after 3 steps, two more steps, then a fresh engine resumes and repeats them
    ckpt = save_checkpoint(eng, str(out / "ckpt"), extra={"data_pos": 3})
    more = [make_batch(8, seed=200 + s) for s in range(2)]
    res["cont_losses"] = [
        eng.train_step(shard_rows(b, rank, world), pg_loss, micro_batch_size=2)["loss"] for b in more
    ]
    res["cont_params"] = params(eng)
    eng2 = FSDPEngine(engine_config(model_dir))
    extra = load_checkpoint(eng2, ckpt)
    res["resume_extra"] = extra
    res["resume_step"] = eng2.global_step
    res["resume_losses"] = [
        eng2.train_step(shard_rows(b, rank, world), pg_loss, micro_batch_size=2)["loss"] for b in more
    ]
    res["resume_params"] = params(eng2)
    res["ckpt_path"] = ckpt
    # 4 KiB of one shard overwritten in place (size unchanged): every rank refuses to load, naming the file
    if rank == world - 1:
        with open(Path(ckpt) / "model_optim" / "__0_0.distcp", "r+b") as f:
            f.seek(1024)
            f.write(b"\xff" * 4096)
    torch.distributed.barrier()
    try:
        load_checkpoint(eng2, ckpt)
        res["damaged_error"] = None
    except CheckpointError as e:
        res["damaged_error"] = str(e)
    export_hf(eng2, str(out / "hf"))

    # uneven shards: rank 0 has 4 long rows, rank 1 two rows. Under a token budget that fits one long row,
    # rank 0 runs 4 micro-batches and rank 1 must run 2 dummy passes to stay in step with FSDP's collectives.
    ub = uneven_batch()
    mine = {k: v[:4] for k, v in ub.items()} if rank == 0 else {k: v[4:] for k, v in ub.items()}
    budget = int(ub["attention_mask"].sum(1).max())
    eng3 = FSDPEngine(engine_config(model_dir))
    res["uneven_log_probs"] = eng3.compute_log_prob(mine, max_token_len=budget)["log_probs"]
    res["uneven_loss"], res["uneven_grads"] = accumulate_grads(eng3, mine, pg_loss, max_token_len=budget)
    torch.save(res, out / f"rank{rank}.pt")


def uneven_batch() -> dict:
    """6 rows: the first 4 at full prompt+response length, the last 2 short."""
    b = make_batch(6, seed=300, min_len=12)
    r = b["responses"].shape[1]
    for i in range(4):
        b["attention_mask"][i] = 1
        b["input_ids"][i, b["input_ids"][i] == PAD] = 5
    b["prompts"], b["responses"] = b["input_ids"][:, :-r], b["input_ids"][:, -r:]
    b["position_ids"] = (b["attention_mask"].cumsum(1) - 1).clamp(min=0)
    b["response_mask"] = b["attention_mask"][:, -r:].float()
    return b


def lora_config():
    from workers.engine import LoRAConfig

    return LoRAConfig(rank=4, alpha=8.0, target_modules=["all-linear"])


def lora_dist_body(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    """LoRA under FSDP2 on ``world`` ranks: one mini-batch's adapter gradients, then two optimizer steps, a
    checkpoint and a resumed engine repeating the second step. Results to ``out_dir/rank<r>.pt``."""
    from workers.engine import FSDPEngine, load_checkpoint, save_checkpoint

    out = Path(out_dir)
    batches = [make_batch(8, seed=300 + s) for s in range(2)]
    eng = FSDPEngine(engine_config(model_dir, lora=lora_config()))
    res: dict = {"use_fsdp": eng.use_fsdp}
    res["loss_g"], res["grads_g"] = accumulate_grads(eng, shard_rows(batches[0], rank, world), pg_loss)
    res["losses"] = [eng.train_step(shard_rows(batches[0], rank, world), pg_loss)["loss"]]
    ckpt = save_checkpoint(eng, str(out / "ckpt"))
    res["losses"].append(eng.train_step(shard_rows(batches[1], rank, world), pg_loss)["loss"])
    res["adapter"] = dict(eng.adapter_state_iter())
    eng2 = FSDPEngine(engine_config(model_dir, lora=lora_config()))
    load_checkpoint(eng2, ckpt)
    res["resumed_loss"] = eng2.train_step(shard_rows(batches[1], rank, world), pg_loss)["loss"]
    res["resumed_adapter"] = dict(eng2.adapter_state_iter())
    res["ckpt"] = ckpt
    torch.save(res, out / f"rank{rank}.pt")
