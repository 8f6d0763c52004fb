"""Countdown-style target reaching: combine the given numbers with ``+ - *`` to hit a target.

Prompt: ``Using the numbers 7, 3, 5, make 22. Use each number exactly once with + - * and
parentheses.``  Solution (demonstrations show one correct expression, then check it)::

    3*5+7 = 15+7 = 22. The answer is \\boxed{3*5+7}.

The answer is verified by rule (exact multiset of numbers, value equals the target), so any correct
expression scores. Finding one is a search problem: a small model imitating demonstrations learns
the format and proposes plausible expressions, many of which miss, so its pass@k is far above its
pass@1 -- the setting where RL has something to amplify. ``demo="format"`` writes demonstrations
that show only the format (a random expression over the numbers, checked honestly, usually missing
the target).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from workers.reward.arithmetic import COUNTDOWN
from workers.reward.expr import Token, render, solve_steps


@dataclass
class CountdownConfig:
    min_numbers: int = 3
    max_numbers: int = 3
    max_number: int = 15  # numbers drawn from 1..max_number
    ops: str = "+-*"
    paren_prob: float = 0.3
    min_target: int = 1
    max_target: int = 99
    demo: str = "solution"  # "solution" (a correct expression) or "format" (a random expression)

    def validate(self) -> None:
        if not 2 <= self.min_numbers <= self.max_numbers:
            raise ValueError(
                f"need 2 <= min_numbers <= max_numbers, got {self.min_numbers}, {self.max_numbers}"
            )
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if self.demo not in ("solution", "format"):
            raise ValueError(f"demo must be 'solution' or 'format', got {self.demo!r}")
        if self.min_target > self.max_target:
            raise ValueError("min_target > max_target")


def _random_expr(rng: random.Random, nums: list[int], cfg: CountdownConfig) -> list[Token]:
    nums = list(nums)
    rng.shuffle(nums)
    n = len(nums)
    toks: list[Token] = [nums[0]]
    for x in nums[1:]:
        toks += [rng.choice(cfg.ops), x]
    if n >= 3 and rng.random() < cfg.paren_prob:
        spans = [(i, j) for i in range(n) for j in range(i + 1, n) if not (i == 0 and j == n - 1)]
        i, j = rng.choice(spans)
        toks = toks[: 2 * i] + ["("] + toks[2 * i : 2 * j + 1] + [")"] + toks[2 * j + 1 :]
    return toks


def sample_problem(rng: random.Random, cfg: CountdownConfig) -> dict | None:
    n = rng.randint(cfg.min_numbers, cfg.max_numbers)
    nums = [rng.randint(1, cfg.max_number) for _ in range(n)]
    toks = _random_expr(rng, nums, cfg)
    steps = solve_steps(toks)
    target = steps[-1][0]
    assert isinstance(target, int)  # the last step is the expression's value
    if not cfg.min_target <= target <= cfg.max_target:
        return None
    if any(isinstance(t, int) and t < 0 for s in steps for t in s):
        return None
    shown = list(nums)
    rng.shuffle(shown)
    return {"key": (tuple(sorted(nums)), target), "numbers": shown, "target": int(target), "tokens": toks}


def solution_text(toks: list[Token]) -> str:
    steps = solve_steps(toks)
    return " = ".join(render(s) for s in steps) + f". The answer is \\boxed{{{render(toks)}}}."


def make_row(problem: dict, split: str, index: int, demo_rng: random.Random, cfg: CountdownConfig) -> dict:
    nums, target = problem["numbers"], problem["target"]
    question = (
        f"Using the numbers {', '.join(map(str, nums))}, make {target}. "
        "Use each number exactly once with + - * and parentheses."
    )
    toks = problem["tokens"] if cfg.demo == "solution" else _random_expr(demo_rng, nums, cfg)
    return {
        "data_source": COUNTDOWN,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"ground_truth": {"target": target, "numbers": list(nums)}, "style": "rule"},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "solution": solution_text(toks),
            "demo_kind": cfg.demo,
        },
    }
