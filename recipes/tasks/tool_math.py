r"""Multi-digit arithmetic where a Python tool genuinely helps (the tool-use env of ``workers.math_env``).

Prompt: ``Compute 4821 + 9377 - 1504 + 37 * 212.``  -- several multi-digit terms (``digits`` digits each),
optionally one product of a multi-digit and a 2-digit number: exact mental arithmetic is hard for a small
model, one ``<python>print(...)</python>`` call is not. Ground truth: the integer value, scored by the
``hyflow/arithmetic`` rule (the last ``\boxed{}`` holds that integer) -- the same rule as
``workers.math_env.verify_boxed``.

Demonstrations for the warm start are multi-turn (``extra_info["reference_turns"]``, replayed in the sandbox
so the observations are real):

* ``tool`` (the rest): ``<python>print(<expression>)</python>`` then ``\boxed{<value>}``;
* ``error_frac``: a first call with a typo (a dangling operator: a SyntaxError observation), then the
  fixed call, then the answer -- recovery from a tool error;
* ``direct_frac``: an immediate ``\boxed{}`` guess with one digit wrong (no tool) -- an imitation policy
  that skips the tool that often, and is wrong when it does; RL has a reason to prefer the tool.

Every row also carries ``extra_info["tool_turns"]`` (the correct tool solution, whatever its demonstration
kind) and ``extra_info["failed_steps"]`` (JSON step records, as ``workers.math_env`` writes them, of a typical
failed attempt: a guess, a call with a typo, a call with a miscopied number, or a right call with a miscopied
answer). The hybrid recipe's warm start shows the reference [prompt + a judge's hint about that failure + the
correct solution], so that the reference, as the hint-conditioned teacher, has learnt to use hints.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from workers.agents.tool_calls import tool_parser
from workers.math_env.protocol import format_tool_observation
from workers.reward.arithmetic import ARITHMETIC


@dataclass
class ToolMathConfig:
    min_terms: int = 3
    max_terms: int = 4
    digits: int = 4  # each term has this many digits
    ops: str = "+-"
    mul_prob: float = 0.5  # chance that one term is <digits-digit> * <2-digit>
    error_frac: float = 0.2  # demonstrations that recover from a SyntaxError
    direct_frac: float = 0.2  # demonstrations that guess without the tool (wrong by one digit)
    # how the demonstrations call the tool: "tags" (<python>code</python>) or a tool-call parser name ("hermes",
    # "llama3_json"): set it to the env's env.agent.tool_format
    tool_format: str = "tags"
    # each demonstrated turn starts with a short reasoning: "none"; "block" (<think>...</think>, e.g. Qwen3);
    # "continue" (...</think>: the template's generation prompt opened the block, e.g. DeepSeek-R1's)
    think: str = "none"

    def validate(self) -> None:
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
        if not 1 <= self.digits <= 12:
            raise ValueError(f"digits must be in [1, 12], got {self.digits}")
        if not self.ops or set(self.ops) - set("+-"):
            raise ValueError(f"ops must be a non-empty subset of '+-', got {self.ops!r}")
        for name in ("mul_prob", "error_frac", "direct_frac"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.think not in ("none", "block", "continue"):
            raise ValueError(f"think must be 'none', 'block' or 'continue', got {self.think!r}")
        if self.tool_format != "tags":
            tool_parser(self.tool_format)  # an unknown format names the known ones
        if self.error_frac + self.direct_frac > 1.0:
            raise ValueError(
                f"error_frac + direct_frac must be <= 1, got {self.error_frac} + {self.direct_frac}"
            )


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 1, 10**digits - 1)


def sample_problem(rng: random.Random, cfg: ToolMathConfig) -> dict | None:
    n = rng.randint(cfg.min_terms, cfg.max_terms)
    terms = [str(_number(rng, cfg.digits)) for _ in range(n)]
    if rng.random() < cfg.mul_prob:
        k = rng.randrange(n)
        terms[k] = f"{terms[k]} * {rng.randint(11, 99)}"
    expr = terms[0]
    for t in terms[1:]:
        expr += f" {rng.choice(cfg.ops)} {t}"
    value = eval(expr, {"__builtins__": {}})  # digits and + - * only, built above
    return {"key": expr, "expr": expr, "value": int(value)}


def _wrong_digit(value: int, rng: random.Random) -> int:
    s = str(abs(value))
    i = rng.randrange(len(s))
    d = str((int(s[i]) + rng.randint(1, 9)) % 10)
    out = int(s[:i] + d + s[i + 1 :]) if (i or d != "0" or len(s) == 1) else value + 1
    return -out if value < 0 else out


def reference_turns(
    problem: dict, kind: str, rng: random.Random, tool_format: str = "tags", think: str = "none"
) -> list[str]:
    expr, value = problem["expr"], problem["value"]

    def call(code: str) -> str:
        if tool_format == "tags":
            return f"<python>{code}</python>"
        return tool_parser(tool_format).format_call("python", {"code": code})

    if kind == "direct":
        turns = [f"\\boxed{{{_wrong_digit(value, rng)}}}"]
    elif kind == "error":
        turns = [call(f"print({expr} +)"), call(f"print({expr})"), f"\\boxed{{{value}}}"]
    else:
        turns = [call(f"print({expr})"), f"\\boxed{{{value}}}"]
    if think != "none":  # why this turn: a call, the printed value as the answer, or a guess without the tool
        why = ["Python computes it exactly."] * (len(turns) - 1)
        why.append("I can do it in my head." if kind == "direct" else "The answer is the printed value.")
        opening = "<think>" if think == "block" else ""
        turns = [f"{opening}{w}</think>\n{t}" for w, t in zip(why, turns)]
    return turns


FAILED_KINDS = ("guess", "typo", "miscopy", "copy_slip")


def failed_attempt(problem: dict, rng: random.Random) -> list[dict]:
    """The step records of a typical wrong attempt at ``problem`` (module docstring), its kind drawn at random."""
    expr, value = problem["expr"], problem["value"]
    kind = rng.choice(FAILED_KINDS)
    if kind == "guess":
        return [{"kind": "answer", "action": f"\\boxed{{{_wrong_digit(value, rng)}}}", "observation": ""}]
    if kind == "typo":
        typo = f"print({expr} +)"
        err = format_tool_observation("", error="SyntaxError: invalid syntax")
        return [{"kind": "tool", "action": f"<python>{typo}</python>", "observation": err}]
    if kind == "miscopy":
        numbers = expr.split()
        k = rng.randrange(0, len(numbers), 2)  # a number, not an operator
        numbers[k] = str(_wrong_digit(int(numbers[k]), rng))
        wrong = " ".join(numbers)
        out = format_tool_observation(f"{eval(wrong, {'__builtins__': {}})}\n")  # digits and + - * only
        return [{"kind": "tool", "action": f"<python>print({wrong})</python>", "observation": out}]
    call = {
        "kind": "tool",
        "action": f"<python>print({expr})</python>",
        "observation": format_tool_observation(f"{value}\n"),
    }
    return [call, {"kind": "answer", "action": f"\\boxed{{{_wrong_digit(value, rng)}}}", "observation": ""}]


def make_row(problem: dict, split: str, index: int, demo_rng: random.Random, cfg: ToolMathConfig) -> dict:
    question = f"Compute {problem['expr']}."
    u = demo_rng.random()
    kind = "error" if u < cfg.error_frac else "direct" if u < cfg.error_frac + cfg.direct_frac else "tool"
    if split == "val":
        kind = "tool"
    return {
        "data_source": ARITHMETIC,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"ground_truth": str(problem["value"]), "style": "rule"},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "reference_turns": reference_turns(problem, kind, demo_rng, cfg.tool_format, cfg.think),
            "solution": f"{problem['expr']} = {problem['value']}. The answer is \\boxed{{{problem['value']}}}.",
            "demo_kind": kind,
            "tool_turns": reference_turns(problem, "tool", demo_rng),
            # its own stream, so the demonstrations' draws stay what they were before this column existed
            "failed_steps": json.dumps(failed_attempt(problem, random.Random(f"{question}/failed"))),
        },
    }
