"""The GRPO quickstart on the native rollout engine and on SGLang, from the same warm start, in one run.

    python -m benchmarks.bench_sglang_vs_native                       # recipes/quickstart.yaml as is
    python -m benchmarks.bench_sglang_vs_native trainer.total_training_steps=10 sft.total_steps=300

One supervised warm start (``recipes.trainer.warm_start``), then ``recipes.grpo.train`` twice from that
model with the same config and seeds, once with ``rollout.name=native`` and once with ``rollout.name=sglang``
(colocated: FSDP2 actor + rollout engine in one worker, weights streamed into the engine after every update).
Any ``key=value`` argument overrides the quickstart config for both. SGLang's sampling is not seeded
(``sampling_seed`` needs ``enable_deterministic_inference``), so the two runs draw different samples: the
comparison is learning (held-out greedy accuracy before/after) and speed, not identical trajectories.

Reported per engine: held-out accuracy before and after GRPO, median step time, median generation time,
median weight-sync time, generation tokens/s (generated tokens / generation time, summed over steps), max
``training/rollout_logprob_diff_max`` (engine vs trainer log-probs of the sampled tokens), wall time, and the
load average before and after (the CI-class machine is 2 shared cores). Prints a table and writes
``outputs/bench_sglang_vs_native.json``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from benchmarks.common import print_table, write_json
from recipes import grpo
from recipes.config import load_config
from recipes.trainer import demonstrations, start_run, warm_start


def _summary(engine: str, result: dict, wall_s: float, load: tuple) -> dict:
    history = result["history"]
    steps = [r for r in history if "timing_s/step" in r]
    vals = [r["val/accuracy"] for r in history if "val/accuracy" in r]
    gen_tokens = sum(r["rollout/generated_tokens"] for r in steps)
    gen_s = sum(r["timing_s/gen"] for r in steps)
    return {
        "engine": engine,
        "val_before": vals[0] if vals else float("nan"),
        "val_after": vals[-1] if vals else float("nan"),
        "steps": len(steps),
        "step_s": statistics.median(r["timing_s/step"] for r in steps),
        "gen_s": statistics.median(r["timing_s/gen"] for r in steps),
        "update_weights_s": statistics.median(r["timing_s/update_weights"] for r in steps),
        "gen_tok_s": gen_tokens / gen_s if gen_s else float("nan"),
        "logprob_diff_max": max(r.get("training/rollout_logprob_diff_max", float("nan")) for r in steps),
        "wall_s": wall_s,
        "load_before": load[0],
        "load_after": load[1],
        "val_history": [(r["step"], r["val/accuracy"]) for r in history if "val/accuracy" in r],
    }


def main(argv: list[str]) -> dict:
    out_dir = "outputs/bench_sglang_vs_native"
    base = load_config(
        "quickstart", [*argv, f"trainer.default_local_dir={out_dir}/sft", "trainer.overwrite=true"]
    )
    run = start_run(base, "quickstart")  # tiny model, task data, Ray
    t0 = time.perf_counter()
    sft_model = warm_start(base, run, demonstrations)
    sft_s = time.perf_counter() - t0
    rows = []
    for engine in ("native", "sglang"):
        cfg = load_config(
            "quickstart",
            [
                *argv,
                f"rollout.name={engine}",
                f"trainer.default_local_dir={out_dir}/{engine}",
                "trainer.overwrite=true",
            ],
        )
        engine_run = start_run(cfg, "quickstart", start_ray=False)
        engine_run.model_path = sft_model  # both start from the same warm start
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        result = grpo.train(cfg, engine_run, recipe="quickstart")
        rows.append(_summary(engine, result, time.perf_counter() - t0, (load0, os.getloadavg()[0])))
    native, sglang = rows
    ratio = {k: sglang[k] / native[k] for k in ("step_s", "gen_s", "update_weights_s", "wall_s")}
    print(
        f"\nGRPO quickstart from one warm start ({base.sft.total_steps} SFT steps, {sft_s:.0f}s), "
        f"{native['steps']} GRPO steps per engine, colocated, load average {rows[0]['load_before']:.1f} at start"
    )
    print_table(
        rows,
        [
            "engine",
            "val_before",
            "val_after",
            "step_s",
            "gen_s",
            "update_weights_s",
            "gen_tok_s",
            "logprob_diff_max",
            "wall_s",
            "load_before",
            "load_after",
        ],
    )
    print("sglang / native: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    record = {
        "overrides": argv,
        "sft_steps": base.sft.total_steps,
        "sft_s": sft_s,
        "rows": rows,
        "ratio": ratio,
    }
    print(f"wrote {write_json('bench_sglang_vs_native', record)}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
