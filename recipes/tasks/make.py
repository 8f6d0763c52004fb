"""Write a task dataset as verl-format parquet.

    python -m recipes.tasks.make --task arithmetic --out data/arith --train 2000 --val 200 --seed 0 \\
        [--sft 1600] [--knob max_operands=5 --knob paren_prob=0.3 ...]
    python -m recipes.tasks.make --task sniah --lengths 8000,64000,1M --out data/sniah --train 200 --val 50
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from recipes.tasks import ALL_TASKS, make_dataset


def _parse_knobs(task: str, items: list[str]) -> dict:
    fields = {f.name: f for f in dataclasses.fields(ALL_TASKS[task].config_cls)}
    knobs = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--knob expects key=value, got {item!r}")
        if key not in fields:
            raise SystemExit(f"unknown knob {key!r} for task {task!r}; known: {sorted(fields)}")
        default = fields[key].default
        assert default is not dataclasses.MISSING  # every task knob has a plain default (int, str, ...)
        kind = type(default)
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise SystemExit(f"knob {key} expects true/false, got {raw!r}")
            knobs[key] = raw.lower() in ("true", "1")
        else:
            try:
                knobs[key] = kind(raw)
            except ValueError:
                raise SystemExit(f"knob {key} expects {kind.__name__}, got {raw!r}") from None
    return knobs


def main(argv: list[str] | None = None) -> dict[str, str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, choices=sorted(ALL_TASKS))
    p.add_argument("--out", required=True, help="output directory (train.parquet, val.parquet)")
    p.add_argument("--train", type=int, default=2000, help="training rows")
    p.add_argument("--val", type=int, default=200, help="validation rows")
    p.add_argument("--sft", type=int, default=0, help="rows of a separate SFT warm-start split (sft.parquet)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE", help="difficulty knob")
    p.add_argument("--lengths", help="long-context tasks: context lengths in characters, e.g. 8000,64000,1M")
    args = p.parse_args(argv)
    knobs = _parse_knobs(args.task, args.knob + ([f"lengths={args.lengths}"] if args.lengths else []))
    try:
        paths = make_dataset(
            args.task, args.out, args.train, args.val, seed=args.seed, n_sft=args.sft, **knobs
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    for split, path in paths.items():
        print(f"{split}: {path}")
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
