"""Chaos: GRPO trained while worker processes are SIGKILLed, against the same run undisturbed (same seeds).

    python -m benchmarks.bench_chaos                          # quickstart task, disaggregated, a kill every 25 s
    python -m benchmarks.bench_chaos --every 15 --targets rollout trainer --steps 20
    python -m benchmarks.bench_chaos trainer.placement=colocated trainer.n_gpus_per_node=1 --targets trainer

One supervised warm start (recipes/quickstart.yaml's SFT), then two GRPO runs from it with the same seeds:
``calm`` and ``chaos``. In ``chaos`` a thread kills (SIGKILL) one random process of the ``--targets`` roles
(``rollout``: the rollout pool's processes, rollout engine and env; ``trainer``: the training ranks) after
every ``--every`` seconds of training (time in steps, not in recoveries or replacements), during a step only (a kill during the recovery itself ends the run by design:
``recipes/trainer/recovery.py``). The run survives by rebuilding its workers from its latest checkpoint
(``trainer.save_freq``; ``trainer.max_restarts`` raised for the benchmark). Reported per arm: steps, faults
injected, restarts, in-place replacements of the rollout pool, steps computed again, seconds lost (per fault), wall time, held-out accuracy before/after,
and the prompts each step trained on (by uid): ``same_prompts`` says every step of ``chaos`` trained exactly
the prompts of the same step of ``calm`` (none twice, none skipped), ``same_metrics`` that every step's reward,
losses, entropy and held-out accuracy equal ``calm``'s. Table + ``outputs/<name>.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import print_table, write_json
from recipes import grpo
from recipes.config import load_config
from recipes.trainer import demonstrations, start_run, warm_start
from recipes.trainer.session import Session

DEFAULTS = [
    "trainer.placement=disaggregated",
    "trainer.n_gpus_per_node=2",
    "trainer.rollout_gpus_per_node=1",
    "trainer.save_freq=2",
    "trainer.max_restarts=100",
    "trainer.val_before_train=true",  # held-out accuracy before and after (test_freq: the last step)
    "trainer.export_hf=false",
    "trainer.progress_bar=false",
    "trainer.logger=[console]",
    "trainer.plot=false",
]


class ChaosMonkey:
    """Kills one random process of the live session's ``targets`` roles after every ``every_s`` seconds spent in
    steps (``in_step``), while a step runs; the session is found through ``Session._start_workers`` (patched by ``attach``)."""

    def __init__(self, every_s: float, targets: list[str], seed: int = 0):
        self.every_s, self.targets, self.rng = every_s, targets, random.Random(seed)
        self.session: Session | None = None
        self.in_step = threading.Event()
        self.kills: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def victims(self) -> list[tuple[str, int, int]]:
        roles = self.session.roles if self.session is not None else None
        if roles is None:
            return []
        groups = {"rollout": roles.rollout, "trainer": roles.actor}
        killed = {kill["pid"] for kill in self.kills}
        out = []
        for target in self.targets:
            # a killed process stays listed until the run notices its death (and may linger as a zombie):
            # killing it again would count one fault twice
            out += [(target, rank, pid) for rank, pid in enumerate(groups[target].pids) if pid not in killed]
        return sorted(set(out))

    def mending(self) -> bool:
        """A fault is being mended in the step (a rollout pool replaced in place): no kill, no time counted."""
        faults = self.session.faults.faults if self.session is not None else []
        return bool(faults) and faults[-1].replaced is None and faults[-1].restored_step is None

    def _run(self) -> None:
        trained_s = (
            0.0  # training time since the last kill: faults are spaced in steps' time, not recoveries'
        )
        while not self._stop.wait(0.1):
            if not self.in_step.is_set() or self.mending():
                continue
            trained_s += 0.1
            victims = self.victims()
            if trained_s < self.every_s or not victims:
                continue
            assert self.session is not None  # victims() found its groups
            target, rank, pid = self.rng.choice(victims)
            step = self.session.state.step
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            trained_s = 0.0
            self.kills.append({"target": target, "rank": rank, "pid": pid, "step": step, "t": time.time()})
            print(f"[chaos] SIGKILL {target} rank {rank} (pid {pid}) during step {step}", flush=True)

    def __enter__(self) -> ChaosMonkey:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_arm(cfg, run, monkey: ChaosMonkey | None) -> dict:
    """GRPO on ``run`` (its model: the shared warm start); the prompts (uids) of each step's last attempt."""
    trained: dict[int, list[str]] = {}
    original_step, original_start = grpo.rl_step, Session._start_workers

    def step(s, batch, metrics, timings):
        trained[s.state.step] = [str(u) for u in batch.non_tensor_batch["uid"]]
        if monkey is not None:
            monkey.in_step.set()
        try:
            return original_step(s, batch, metrics, timings)
        finally:
            if monkey is not None:
                monkey.in_step.clear()

    def start_workers(self, resume_mode):
        original_start(self, resume_mode)
        if monkey is not None:
            monkey.session = self

    # patched for this run, restored below
    grpo.rl_step, Session._start_workers = step, start_workers  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        if monkey is None:
            result = grpo.train(cfg, run, recipe="calm")
        else:
            with monkey:
                result = grpo.train(cfg, run, recipe="chaos")
    finally:
        grpo.rl_step, Session._start_workers = original_step, original_start  # type: ignore[method-assign]
    wall = time.perf_counter() - t0
    val = [m.get("val/accuracy") for _, m in result["val_history"]]
    final = result["final"]
    return {
        "steps": result["step"],
        "faults_injected": len(monkey.kills) if monkey is not None else 0,
        "restarts": final.get("fault/restarts", 0.0),
        "replacements": final.get("fault/replacements", 0.0),
        "steps_lost": final.get("fault/steps_lost", 0.0),
        "seconds_lost": final.get("fault/seconds_lost", 0.0),
        "wall_s": wall,
        "val_before": val[0] if val else None,
        "val_after": val[-1] if val else None,
        "trained": trained,
        "history": {r["step"]: r for r in result["history"]},
        "kills": monkey.kills if monkey is not None else [],
    }


def same_metrics(a: dict[int, dict], b: dict[int, dict], rel: float = 1e-4) -> bool:
    """Every step of both runs has the same reward, losses and entropy (within ``rel``): the recovered run
    computed what the undisturbed one did."""
    keys = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "response_length/mean", "val/accuracy")
    if sorted(a) != sorted(b):
        return False
    for step in a:
        for key in keys:
            x, y = a[step].get(key), b[step].get(key)
            if (x is None) != (y is None):
                return False
            if x is not None and y is not None and abs(x - y) > rel * max(abs(x), abs(y), 1e-6):
                return False
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--every", type=float, default=25.0, help="seconds of training between two kills")
    parser.add_argument("--targets", nargs="+", default=["rollout"], choices=["rollout", "trainer"])
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps of each arm")
    parser.add_argument(
        "--sft-steps", type=int, default=None, help="warm-start steps (quickstart.yaml's if unset)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the chaos thread's choice of victims")
    parser.add_argument(
        "--sft-model", default=None, help="an earlier run's warm start (<dir>/calm/sft_model)"
    )
    parser.add_argument("--dir", default=None, help="work directory (default: a new temporary one)")
    parser.add_argument("--name", default="bench_chaos", help="JSON record: outputs/<name>.json")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="quickstart config overrides")
    args = parser.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_chaos_"))
    steps = [f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.steps}"]
    common = [*DEFAULTS, *steps, *args.overrides]
    if args.sft_steps is not None:
        common.append(f"sft.total_steps={args.sft_steps}")
    arms, sft_model = {}, args.sft_model
    for arm in ("calm", "chaos"):
        cfg = load_config(
            "quickstart", [*common, f"trainer.default_local_dir={work / arm}", "trainer.overwrite=true"]
        )
        run = start_run(cfg, "quickstart")
        sft_model = sft_model or warm_start(cfg, run, demonstrations)  # one warm start for both arms
        run.model_path = sft_model
        monkey = ChaosMonkey(args.every, args.targets, args.seed) if arm == "chaos" else None
        arms[arm] = run_arm(cfg, run, monkey)
    calm, chaos = arms["calm"]["trained"], arms["chaos"]["trained"]
    uids = [u for s in sorted(chaos) for u in chaos[s]]
    rows = []
    for arm, r in arms.items():
        faults = r["restarts"] + r["replacements"]
        rows.append(
            {
                "arm": arm,
                **{k: v for k, v in r.items() if k not in ("trained", "history", "kills")},
                "s_lost_per_fault": r["seconds_lost"] / faults if faults else 0.0,
                "prompts": sum(len(v) for v in r["trained"].values()),
                "load": os.getloadavg()[0],
            }
        )
    rows[-1]["prompts_twice"] = len(uids) - len(set(uids))
    rows[-1]["same_prompts"] = sorted(calm) == sorted(chaos) and all(calm[s] == chaos[s] for s in calm)
    rows[-1]["same_metrics"] = same_metrics(arms["calm"]["history"], arms["chaos"]["history"])
    columns = ["arm", "steps", "faults_injected", "restarts", "replacements", "steps_lost", "seconds_lost", "s_lost_per_fault",
               "wall_s", "val_before", "val_after", "prompts", "prompts_twice", "same_prompts", "same_metrics", "load"]  # fmt: skip
    print_table(rows, columns)
    payload = {"rows": rows, "kills": arms["chaos"]["kills"], "args": vars(args), "overrides": common}
    path = write_json(args.name, payload)
    print(f"wrote {path}")
    return {"rows": rows, "path": path}


if __name__ == "__main__":
    main()
