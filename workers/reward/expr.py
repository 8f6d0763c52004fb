"""Small, safe arithmetic expressions: tokenise, parse, evaluate, and solve one step at a time.

Used by the rule scorers (``workers.reward.arithmetic``, to check an answer such as ``\\boxed{3*5+7}``) and
by the task generators (``recipes.tasks``, to write step-by-step solutions). Only integers, ``+ - * /`` and
parentheses are accepted; nothing is passed to ``eval``.
"""

from __future__ import annotations

import re
from fractions import Fraction

Token = int | str  # an integer operand, or one of "+", "-", "*", "/", "(", ")"

_TOKEN_RE = re.compile(r"\s*(?:(\d+)|(.))")
_OPS = "+-*/"
MAX_DIGITS = 12  # refuse absurdly large literals (keeps scoring cheap on adversarial outputs)


class ExprError(ValueError):
    """The text is not a well-formed expression of the accepted form."""


def tokenize(text: str) -> list[Token]:
    toks: list[Token] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:  # only trailing whitespace left
            break
        num, ch = m.groups()
        if num is not None:
            if len(num) > MAX_DIGITS:
                raise ExprError(f"number too long: {num[:20]}...")
            toks.append(int(num))
        elif ch in _OPS or ch in "()":
            toks.append(ch)
        elif ch.isspace():
            pass
        else:
            raise ExprError(f"unexpected character {ch!r} in {text!r}")
        pos = m.end()
    return toks


def _apply(a: Fraction, op: str, b: Fraction) -> Fraction:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        raise ExprError("division by zero")
    return a / b


def evaluate_tokens(toks: list[Token], allow_unary_minus: bool = True) -> Fraction:
    """Evaluate with the usual precedence (``* /`` before ``+ -``, left to right)."""
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def atom() -> Fraction:
        nonlocal pos
        t = peek()
        if t == "-" and allow_unary_minus:
            pos += 1
            return -atom()
        if t == "(":
            pos += 1
            v = expr()
            if peek() != ")":
                raise ExprError("missing ')'")
            pos += 1
            return v
        if isinstance(t, int):
            pos += 1
            return Fraction(t)
        raise ExprError(f"expected a number or '(' at token {pos}, got {t!r}")

    def term() -> Fraction:
        nonlocal pos
        v = atom()
        while peek() in ("*", "/"):
            op = str(toks[pos])
            pos += 1
            v = _apply(v, op, atom())
        return v

    def expr() -> Fraction:
        nonlocal pos
        v = term()
        while peek() in ("+", "-"):
            op = str(toks[pos])
            pos += 1
            v = _apply(v, op, term())
        return v

    if not toks:
        raise ExprError("empty expression")
    v = expr()
    if pos != len(toks):
        raise ExprError(f"unexpected token {toks[pos]!r} at position {pos}")
    return v


def evaluate(text: str, allow_unary_minus: bool = True) -> Fraction:
    return evaluate_tokens(tokenize(text), allow_unary_minus=allow_unary_minus)


def render(toks: list[Token]) -> str:
    return "".join(str(t) for t in toks)


def solve_step(toks: list[Token], precedence: bool = True) -> list[Token]:
    """Apply one operation and return the new token list.

    Works inside the first innermost parenthesis group (or the whole expression). With
    ``precedence`` the leftmost ``*``/``/`` goes first, else the leftmost ``+``/``-``; without it
    (a "sloppy" solver) simply the leftmost operator. A group reduced to one number loses its
    parentheses in the same step. Operands are ints (division must be exact).
    """
    lo, hi, paren = 0, len(toks), False
    for i, t in enumerate(toks):
        if t == "(":
            lo, paren = i + 1, True
        elif t == ")":
            hi = i
            break
    sub = toks[lo:hi]
    if len(sub) == 1:
        if not paren:
            raise ExprError("nothing left to solve")
        return toks[: lo - 1] + sub + toks[hi + 1 :]
    op_idx = [j for j in range(1, len(sub), 2)]
    j = op_idx[0]
    if precedence:
        muls = [k for k in op_idx if sub[k] in ("*", "/")]
        if muls:
            j = muls[0]
    a, op, b = sub[j - 1], sub[j], sub[j + 1]
    if not (isinstance(a, int) and isinstance(b, int) and isinstance(op, str)):
        raise ExprError(f"malformed expression {render(toks)!r}")
    v = _apply(Fraction(a), op, Fraction(b))
    if v.denominator != 1:
        raise ExprError(f"inexact division {a}/{b}")
    new_sub: list[Token] = sub[: j - 1] + [int(v)] + sub[j + 2 :]
    if paren and len(new_sub) == 1:
        return toks[: lo - 1] + new_sub + toks[hi + 1 :]
    return toks[:lo] + new_sub + toks[hi:]


def solve_steps(toks: list[Token], precedence: bool = True) -> list[list[Token]]:
    """All intermediate token lists, from ``toks`` itself to a single number."""
    out = [list(toks)]
    while len(out[-1]) > 1:
        out.append(solve_step(out[-1], precedence=precedence))
    return out
