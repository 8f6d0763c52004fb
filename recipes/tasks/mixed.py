"""One parquet, three environments: S-NIAH for the RLM REPL, tool math and the word-count example, each row naming
its environment in an ``env_name`` column (``recipes/rlm_mixed.yaml``, ``workers.agents.mixed``).

    python -m recipes.tasks.mixed                          # runs/mixed/data/{train,val}.parquet
    python -m recipes.tasks.mixed --out DIR --train 64 --val 8 --lengths 2000,4000
    python -m recipes.rlm --config recipes/rlm_mixed.yaml

The rows are those of the three tasks (``recipes.tasks.long_context`` S-NIAH, ``recipes.tasks.tool_math``,
``workers.agents.examples.word_count``): verl's columns (``data_source``, ``prompt``, ``ability``,
``reward_model``, ``extra_info`` with each task's ``question`` and ``reference_turns``, so the warm start replays
every row through its own environment) plus ``env_name`` (``ENV_NAMES``). Each environment keeps its own
``data_source`` (``hyflow/sniah``, ``hyflow/arithmetic``, ``word_count``), so validation's
``val-core/<data_source>/acc`` separates them too. ``n_train`` / ``n_val`` rows per environment, interleaved
(rlm, tool_math, word_count, rlm, ...) so that any three consecutive rows hold one of each.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from recipes.tasks import generate_splits, write_parquet

__all__ = ["ENV_NAMES", "mixed_splits", "write_dataset"]

# env_name -> the task that makes its rows (the names are the keys of env.envs in recipes/rlm_mixed.yaml)
ENV_NAMES = ("rlm", "tool_math", "word_count")
# the S-NIAH knobs of recipes/rlm.yaml: a needle and one decoy, the careful search program as the reference
SNIAH_KNOBS: dict[str, Any] = {"search": "pattern", "n_decoys": 1}  # generate_splits' **knobs


def _word_count_splits(n_train: int, n_val: int, seed: int) -> dict[str, list[dict]]:
    import pyarrow.parquet as pq

    from workers.agents.examples.word_count import write_dataset as write_word_count

    with tempfile.TemporaryDirectory() as tmp:
        paths = write_word_count(tmp, n_train=n_train, n_val=n_val, seed=seed)
        return {split: pq.read_table(path).to_pylist() for split, path in paths.items()}


def mixed_splits(
    n_train: int, n_val: int, seed: int = 0, lengths: str = "2000,4000", sloppy_frac: float = 0.0
) -> dict[str, list[dict]]:
    """``train`` and ``val`` rows: ``n_train`` / ``n_val`` per environment, interleaved (module docstring).
    ``lengths``: the S-NIAH context lengths (characters); ``sloppy_frac``: S-NIAH demonstrations that take the
    "first seven-digit number" shortcut (``recipes/rlm.yaml`` uses 0.8 to give RL something to find)."""
    by_env = {
        "rlm": generate_splits(
            "sniah", n_train, n_val, seed=seed, lengths=lengths, sloppy_frac=sloppy_frac, **SNIAH_KNOBS
        ),
        "tool_math": generate_splits("tool_math", n_train, n_val, seed=seed),
        "word_count": _word_count_splits(n_train, n_val, seed),
    }
    out = {}
    for split, n in (("train", n_train), ("val", n_val)):
        out[split] = [{**by_env[env][split][i], "env_name": env} for i in range(n) for env in ENV_NAMES]
    return out


def write_dataset(
    out_dir: str | os.PathLike,
    n_train: int = 64,
    n_val: int = 8,
    seed: int = 0,
    lengths: str = "2000,4000",
    sloppy_frac: float = 0.0,
) -> dict[str, str]:
    """``out_dir/{train,val}.parquet``; returns the paths."""
    splits = mixed_splits(n_train, n_val, seed=seed, lengths=lengths, sloppy_frac=sloppy_frac)
    return {
        s: write_parquet(rows, os.path.join(os.fspath(out_dir), f"{s}.parquet")) for s, rows in splits.items()
    }


def main(argv: list[str] | None = None) -> dict[str, str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/mixed/data", help="output directory (train.parquet, val.parquet)")
    p.add_argument("--train", type=int, default=64, help="training rows per environment")
    p.add_argument("--val", type=int, default=8, help="validation rows per environment")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", default="2000,4000", help="S-NIAH context lengths in characters")
    p.add_argument("--sloppy-frac", type=float, default=0.0, help="S-NIAH shortcut demonstrations")
    args = p.parse_args(argv)
    paths = write_dataset(args.out, args.train, args.val, args.seed, args.lengths, args.sloppy_frac)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return paths


if __name__ == "__main__":
    main()
