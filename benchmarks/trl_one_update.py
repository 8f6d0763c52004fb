"""One GRPO update on the same batch by TRL and by hyflow: do the two algorithms agree?

    python -m benchmarks.trl_one_update [--seeds N]

The learning race of ``benchmarks/bench_vs_trl.py`` compares whole runs, where sampling noise decides a lot; this
isolates the update. Per seed, TRL 1.16's own code (``benchmarks/trl_grpo_baseline.py`` in ``.venv-trl``:
``GRPOTrainer`` generates and scores one batch of the benchmark's work from the shared warm start, computes the
advantages, the loss, clips the gradient and takes one AdamW step) writes the batch and its updated model; hyflow's
``ActorWorker.update_actor`` (the ``recipes.grpo`` config the race runs, on one rank) takes one step on the same
token ids with TRL's advantages and exports its model. Printed per seed: both pre-clip gradient norms and how far
hyflow's weight update is from TRL's (relative L2 distance, largest element difference, cosine). JSON to
``outputs/trl_one_update.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ray
import torch
from safetensors.torch import load_file

from benchmarks.bench_vs_trl import (
    N_VAL,
    TRL_VENV,
    WORK,
    ensure_trl_venv,
    grpo_overrides,
    in_own_ray,
    trl_round,
    trl_spec,
    warm_started_model,
    write_task,
)
from benchmarks.common import print_table, update_distance, write_json
from controller import RayClassWithInitArgs, RayWorkerGroup
from dataproto import DataProto
from recipes.trainer import parse_args
from recipes.trainer.data import collate_sft_layout
from recipes.trainer.run import model_config
from resource_pools import ResourcePool
from workers.models.loading import load_tokenizer
from workers.roles import ActorWorker
from workers.roles.handles import ActorGroup, role_group

ROOT = Path(__file__).resolve().parent.parent


def batch_to_dataproto(batch: dict, pad_id: int) -> DataProto:
    """TRL's batch (unpadded prompt and completion ids, one advantage per row) in hyflow's rollout layout
    (``collate_sft_layout``: prompts left-padded, completions right-padded), the advantage on every completion
    token."""
    prompts, completions = batch["prompt_ids"], batch["completion_ids"]
    if not len(prompts) == len(completions) == len(batch["advantages"]):
        raise ValueError("the batch's prompt_ids, completion_ids and advantages must have one row each")
    data = collate_sft_layout(list(zip(prompts, completions)), pad_id)
    advantages = torch.tensor(batch["advantages"])[:, None] * data.batch["response_mask"]
    return DataProto.from_dict({**data.batch, "advantages": advantages})


def hyflow_update(model_dir: str, files: dict[str, str], batch: dict, out_dir: Path) -> dict:
    """One ``ActorWorker.update_actor`` on ``batch`` with the race's config, on one rank; the exported model's
    directory and the step's pre-clip gradient norm and policy loss."""
    cfg = parse_args("grpo", grpo_overrides(model_dir, files, out_dir / "run", WORK["seed"]))
    data = batch_to_dataproto(batch, load_tokenizer(model_dir).pad_token_id)

    def update() -> dict:
        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False)
        pool = ResourcePool([1], name="trl_one_update")
        actor = RayClassWithInitArgs(
            ActorWorker, model=model_config(cfg, model_dir), actor=cfg.actor, rollout=cfg.rollout
        )
        group = role_group(RayWorkerGroup(pool, actor, name_prefix="trl_one_update"), ActorGroup)
        try:
            group.init_model()
            metrics = group.update_actor(data).meta_info["metrics"]
            exported = group.export_hf(str(out_dir / "hyflow_model"))[0]
        finally:
            group.shutdown()
            pool.remove()
        return {
            "model_dir": exported,
            "grad_norm": metrics["actor/grad_norm"],
            "pg_loss": metrics["actor/pg_loss"],
        }

    return in_own_ray(update)


def update_difference(start_dir: str, ours_dir: str, theirs_dir: str) -> dict:
    """How far our weight update (ours - start) is from theirs: relative L2 distance, largest element
    difference, cosine; over every tensor of the start's safetensors (a tied lm_head is not saved twice)."""
    start, ours, theirs = (
        load_file(str(Path(d) / "model.safetensors")) for d in (start_dir, ours_dir, theirs_dir)
    )
    if set(ours) != set(start) or set(theirs) != set(start):
        raise ValueError(f"the three models hold different tensors: {sorted(set(ours) ^ set(theirs))[:5]}")
    d = update_distance((n, ours[n] - before, theirs[n] - before) for n, before in start.items())
    if d["update_norm_theirs"] == 0.0:
        raise ValueError(f"{theirs_dir} equals the start: TRL's step moved no weight")
    return {
        "update_norm_trl": d["update_norm_theirs"],
        "update_norm_hyflow": d["update_norm_ours"],
        **{k: d[k] for k in ("relative_distance", "max_abs_difference", "cosine")},
    }


def one_seed(python: Path, model_dir: str, files: dict[str, str], seed: int, work_dir: Path) -> dict:
    run_dir = work_dir / f"one_update_s{seed}"
    spec = trl_spec(model_dir, files, steps=1, seed=seed)
    # each seed's batch is another 4 prompts: the prompts are rotated, TRL's sampling seeded
    shift = seed * WORK["n_prompts"] % len(spec["prompts"])
    spec["prompts"] = spec["prompts"][shift:] + spec["prompts"][:shift]
    spec["one_update_dir"] = str(run_dir / "trl_model")
    theirs = trl_round(python, spec, run_dir)
    ours = hyflow_update(model_dir, files, theirs, run_dir)
    difference = update_difference(model_dir, ours["model_dir"], spec["one_update_dir"])
    return {
        "seed": seed,
        "rows": len(theirs["advantages"]),
        "rows_with_positive_advantage": sum(a > 0 for a in theirs["advantages"]),
        "grad_norm_trl": theirs["grad_norm"],
        "grad_norm_hyflow": ours["grad_norm"],
        "grad_norm_relative_difference": abs(ours["grad_norm"] - theirs["grad_norm"]) / theirs["grad_norm"],
        **difference,
        "one_minus_cosine": 1.0 - difference["cosine"],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--seeds", type=int, default=3, help="batches compared, each from its own seed and prompts"
    )
    p.add_argument(
        "--sft-steps", type=int, default=800, help="as benchmarks/bench_vs_trl.py (the same warm start)"
    )
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--tiny-size", default="tiny")
    p.add_argument("--work-dir", type=Path, default=ROOT / "outputs" / "bench_vs_trl")
    p.add_argument("--trl-venv", type=Path, default=TRL_VENV)
    args = p.parse_args(argv)
    python = ensure_trl_venv(args.trl_venv)
    files = write_task(args.work_dir / "data", args.n_train, N_VAL, args.n_train)
    model_dir = warm_started_model(args.work_dir, files, args.sft_steps, args.n_train, args.tiny_size)
    rows = [one_seed(python, model_dir, files, seed, args.work_dir) for seed in range(args.seeds)]
    print("one GRPO update on the same batch: TRL 1.16 vs hyflow (update = weights after - warm start)")
    print_table(
        rows,
        [
            "seed",
            "grad_norm_trl",
            "grad_norm_relative_difference",
            "update_norm_trl",
            "relative_distance",
            "max_abs_difference",
            "one_minus_cosine",
        ],
    )
    path = write_json("trl_one_update", {"work": WORK, "model_dir": model_dir, "seeds": rows})
    print(f"wrote {path}")
    return {"seeds": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
