"""Multi-step integer arithmetic with step-by-step solutions ending in ``\\boxed{N}``.

Prompt: ``Compute 3+4*2-1.``  Solution (precedence respected, one operation per step)::

    3+4*2-1 = 3+8-1 = 11-1 = 10. The answer is \\boxed{10}.

Difficulty knobs (``ArithmeticConfig``): operand count, operand range, operator set, chance of one
parenthesised group, a bound on every intermediate value, non-negative intermediates.

``precedence_trap`` is the fraction of problems drawn so that evaluating left to right gives a wrong
answer (the rest are unconstrained). ``demo_noise`` makes the training (``train`` and ``sft`` split) demonstrations imperfect in a systematic way: that fraction of
them is written by a "sloppy teacher" who evaluates strictly left to right, ignoring precedence
(``3+4*2-1 = 7*2-1 = 14-1 = 13``). The ground truth is always the correct value, and validation
solutions are always correct. A model that imitates the mixture picks the sloppy branch at the
decisive step as often as the teacher did (greedy decoding follows the majority), so supervised
warm-start accuracy stays well below what the model can do; reinforcement learning with the rule
reward discovers which branch pays (the ``arith_mixed`` task preset: every problem a precedence
trap, intermediate values bounded by 20, 60% of the demonstrations sloppy). The problems themselves do not
depend on ``demo_noise``: the same seed yields the same prompts and ground truths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from workers.reward.arithmetic import ARITHMETIC
from workers.reward.expr import ExprError, Token, render, solve_steps


@dataclass
class ArithmeticConfig:
    min_operands: int = 3
    max_operands: int = 4
    max_operand: int = 9  # operands drawn from 1..max_operand
    ops: str = "+-*"  # any of "+-*/" ("/" only where the division is exact)
    paren_prob: float = 0.0  # chance of one parenthesised sub-expression
    max_abs_value: int = 99  # bound on every intermediate value (both solution orders)
    nonnegative: bool = True  # reject problems with a negative intermediate value
    demo_noise: float = 0.0  # fraction of train demonstrations solved left to right (wrong)
    precedence_trap: float = 0.0  # fraction of problems where left-to-right gives a wrong answer
    instruction: bool = False  # append an instruction about the \boxed{} format to the prompt

    def validate(self) -> None:
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(
                f"need 2 <= min_operands <= max_operands, got {self.min_operands}, {self.max_operands}"
            )
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if not self.ops or set(self.ops) - set("+-*/"):
            raise ValueError(f"ops must be a non-empty subset of '+-*/', got {self.ops!r}")
        for name in ("paren_prob", "demo_noise", "precedence_trap"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")


INSTRUCTION = " Show your steps and put the final answer in \\boxed{}."


def _within_bounds(steps: list[list[Token]], cfg: ArithmeticConfig) -> bool:
    for step in steps:
        for t in step:
            if isinstance(t, int) and (abs(t) > cfg.max_abs_value or (cfg.nonnegative and t < 0)):
                return False
    return True


def sample_problem(rng: random.Random, cfg: ArithmeticConfig) -> dict | None:
    """One random problem, or None when the draw violates the knobs (the caller draws again)."""
    trap = cfg.precedence_trap > 0 and rng.random() < cfg.precedence_trap
    n = rng.randint(cfg.min_operands, cfg.max_operands)
    nums = [rng.randint(1, cfg.max_operand) for _ in range(n)]
    ops = [rng.choice(cfg.ops) for _ in range(n - 1)]
    toks: list[Token] = [nums[0]]
    for op, x in zip(ops, nums[1:]):
        toks += [op, x]
    if n >= 3 and cfg.paren_prob > 0 and rng.random() < cfg.paren_prob:
        # wrap operands i..j (not the whole expression) in parentheses
        spans = [(i, j) for i in range(n) for j in range(i + 1, n) if not (i == 0 and j == n - 1)]
        i, j = rng.choice(spans)
        toks = toks[: 2 * i] + ["("] + toks[2 * i : 2 * j + 1] + [")"] + toks[2 * j + 1 :]
    elif trap and not any(a in "+-" and b in "*/" for k, a in enumerate(ops) for b in ops[k + 1 :]):
        return None  # cheap pre-check: without a "* or /" after a "+ or -" the order cannot matter
    try:
        steps = solve_steps(toks, precedence=True)
        sloppy = solve_steps(toks, precedence=False)
    except (ExprError, ZeroDivisionError):
        return None
    if not (_within_bounds(steps, cfg) and _within_bounds(sloppy, cfg)):
        return None
    answer = steps[-1][0]
    if trap and sloppy[-1][0] == answer:
        return None
    return {"key": render(toks), "tokens": toks, "answer": int(answer)}


def solution_text(toks: list[Token], precedence: bool = True) -> str:
    steps = solve_steps(toks, precedence=precedence)
    value = steps[-1][0]
    return " = ".join(render(s) for s in steps) + f". The answer is \\boxed{{{value}}}."


def make_row(problem: dict, split: str, index: int, demo_rng: random.Random, cfg: ArithmeticConfig) -> dict:
    toks = problem["tokens"]
    sloppy = split in ("train", "sft") and cfg.demo_noise > 0 and demo_rng.random() < cfg.demo_noise
    question = f"Compute {problem['key']}." + (INSTRUCTION if cfg.instruction else "")
    return {
        "data_source": ARITHMETIC,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"ground_truth": str(problem["answer"]), "style": "rule"},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "solution": solution_text(toks, precedence=not sloppy),
            "demo_kind": "left_to_right" if sloppy else "correct",
        },
    }
