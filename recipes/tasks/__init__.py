"""Procedural, seeded task generators that write verl-format parquet datasets.

Each row has the columns verl's RL datasets use::

    data_source   "hyflow/arithmetic" | "hyflow/countdown"   (its rule scorer's key in ``workers.reward``)
    prompt        [{"role": "user", "content": "Compute 3+4*2-1."}]
    ability       "math"
    reward_model  {"ground_truth": ..., "style": "rule"}
    extra_info    {"split", "index", "question", "solution" (text for the SFT warm start), "demo_kind"}

Tasks (``TASKS``): ``arithmetic`` (clean step-by-step demonstrations), ``arith_mixed`` (problems where
precedence matters, every intermediate value <= 20 so the arithmetic is easy for a 1M-parameter
model, 60% of the training demonstrations written left to right ignoring precedence -- the
quickstart task where RL visibly beats imitation; about 2,300 distinct problems exist), ``countdown`` (target reaching, a search problem),
``tool_math`` (multi-digit sums/products for the tool-use env: multi-turn ``reference_turns`` demonstrations).

    from recipes.tasks import generate_splits, make_dataset
    paths = make_dataset("arith_mixed", "data/arith", n_train=400, n_val=200, n_sft=1600, seed=0)

Long-context RLM tasks (``LONG_CONTEXT_TASKS``, ``recipes.tasks.long_context``): ``sniah``,
``oolong``, ``oolong_pairs`` -- ability ``long_context``, the prompt is the query alone and the
context travels in ``extra_info["context"]``. ``ALL_TASKS`` holds both kinds; ``generate_splits`` /
``make_dataset`` / ``task_config`` take any of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from recipes.tasks import arithmetic, countdown, long_context, tool_math
from workers.reward.arithmetic import ARITHMETIC, COUNTDOWN

__all__ = [
    "ALL_TASKS",
    "LONG_CONTEXT_TASKS",
    "TASKS",
    "DATA_SOURCES",
    "TaskSpec",
    "generate_splits",
    "make_dataset",
    "task_config",
    "write_parquet",
]

SPLITS = ("train", "val", "sft")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    config_cls: type
    sample_problem: Callable[[random.Random, Any], dict | None]
    make_row: Callable[[dict, str, int, random.Random, Any], dict]
    data_sources: tuple[str, ...]
    defaults: dict = field(default_factory=dict)  # preset knob values on top of the config defaults


TASKS: dict[str, TaskSpec] = {
    "arithmetic": TaskSpec(
        "arithmetic",
        arithmetic.ArithmeticConfig,
        arithmetic.sample_problem,
        arithmetic.make_row,
        (ARITHMETIC,),
    ),
    "arith_mixed": TaskSpec(
        "arith_mixed",
        arithmetic.ArithmeticConfig,
        arithmetic.sample_problem,
        arithmetic.make_row,
        (ARITHMETIC,),
        defaults={"demo_noise": 0.6, "precedence_trap": 1.0, "max_abs_value": 20},
    ),
    "countdown": TaskSpec(
        "countdown", countdown.CountdownConfig, countdown.sample_problem, countdown.make_row, (COUNTDOWN,)
    ),
    # multi-digit sums/products solved with a sandboxed Python tool (recipes/hybrid_rl.py)
    "tool_math": TaskSpec(
        "tool_math", tool_math.ToolMathConfig, tool_math.sample_problem, tool_math.make_row, (ARITHMETIC,)
    ),
}


# RLM long-context tasks: kept apart from TASKS (a different ability and prompt shape)
LONG_CONTEXT_TASKS: dict[str, TaskSpec] = {
    name: TaskSpec(name, config_cls, sample, make_row, (source,))
    for name, (config_cls, sample, make_row, source) in long_context.GENERATORS.items()
}
ALL_TASKS: dict[str, TaskSpec] = {**TASKS, **LONG_CONTEXT_TASKS}
# every data source the generators write, each scored by its rule in workers.reward
DATA_SOURCES: tuple[str, ...] = tuple(
    dict.fromkeys(s for spec in ALL_TASKS.values() for s in spec.data_sources)
)


def task_config(task: str, **knobs):
    """The task's config dataclass with preset defaults and ``knobs`` applied, validated."""
    spec = _spec(task)
    names = {f.name for f in dataclasses.fields(spec.config_cls)}
    unknown = set(knobs) - names
    if unknown:
        raise ValueError(f"unknown knob(s) {sorted(unknown)} for task {task!r}; known: {sorted(names)}")
    cfg = spec.config_cls(**{**spec.defaults, **knobs})
    cfg.validate()
    return cfg


def _spec(task: str) -> TaskSpec:
    try:
        return ALL_TASKS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(ALL_TASKS)}") from None


def _sub_seed(seed: int, tag: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{tag}".encode()).digest()[:8], "little")


def generate_splits(
    task: str,
    n_train: int,
    n_val: int,
    seed: int = 0,
    n_sft: int = 0,
    max_tries_factor: int = 200,
    **knobs,
) -> dict[str, list[dict]]:
    """Rows for the ``train`` and ``val`` splits (and ``sft`` when ``n_sft > 0``).

    Deterministic in ``seed``; no problem appears in two splits. Problems are drawn from one seeded
    stream (validation first, then train, then sft) and deduplicated by their canonical key across
    splits, so asking for more rows of a later split leaves the earlier splits unchanged.
    Demonstration noise uses a separate stream, so knobs that only change demonstrations leave the
    problems unchanged.

    The optional ``sft`` split holds problems for the supervised warm start only, so that the RL
    prompts (``train``) are not ones whose demonstrations the warm-started model has memorised --
    memorised prompts give every sample of a group the same answer and no GRPO signal.
    """
    spec = _spec(task)
    cfg = task_config(task, **knobs)
    rng = random.Random(_sub_seed(seed, "problems"))
    demo_rng = random.Random(_sub_seed(seed, "demos"))
    seen: set = set()
    out: dict[str, list[dict]] = {}
    for split, n in (("val", n_val), ("train", n_train), ("sft", n_sft)):
        if split == "sft" and n == 0:
            continue
        rows: list[dict] = []
        tries = 0
        while len(rows) < n:
            tries += 1
            if tries > max_tries_factor * max(n, 1):
                raise ValueError(
                    f"task {task!r}: found only {len(rows)} of {n} distinct {split} problems with knobs "
                    f"{dataclasses.asdict(cfg)}; loosen the difficulty knobs or ask for fewer"
                )
            prob = spec.sample_problem(rng, cfg)
            if prob is None or prob["key"] in seen:
                continue
            seen.add(prob["key"])
            rows.append(spec.make_row(prob, split, len(rows), demo_rng, cfg))
        out[split] = rows
    return out


def write_parquet(rows: list[dict], path: str | os.PathLike) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)
    return path


def make_dataset(
    task: str, out_dir: str | os.PathLike, n_train: int, n_val: int, seed: int = 0, n_sft: int = 0, **knobs
) -> dict[str, str]:
    """Write ``out_dir/{train,val}.parquet`` (and ``sft.parquet`` when ``n_sft > 0``); return the paths."""
    splits = generate_splits(task, n_train, n_val, seed=seed, n_sft=n_sft, **knobs)
    return {
        s: write_parquet(rows, os.path.join(os.fspath(out_dir), f"{s}.parquet")) for s, rows in splits.items()
    }
