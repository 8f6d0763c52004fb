"""Rule scorers: ``score(solution_str, ground_truth, extra_info) -> float``, registered by data_source.

A scorer that raises marks that one sample with score 0 and counts an error; it never fails the
batch (see ``score_batch``). Unknown data sources are a configuration error and are reported once,
naming the data source and the registered ones, unless a default scorer is configured.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from workers.plugins import UserCodeError, load_user_file

Scorer = Callable[[str, object, dict | None], float]
SCORERS: dict[str, Scorer] = {}


def register_scorer(*data_sources: str):
    """Decorator: ``@register_scorer("gsm8k", "arith")`` makes the function the scorer for those sources."""

    def wrap(fn: Scorer) -> Scorer:
        for name in data_sources:
            SCORERS[name] = fn
        return fn

    return wrap


def get_scorer(data_source: str, default: str | None = None) -> Scorer:
    if data_source in SCORERS:
        return SCORERS[data_source]
    if default is not None:
        return get_scorer(default)
    raise KeyError(
        f"no reward scorer registered for data_source {data_source!r}; registered: {sorted(SCORERS)}"
    )


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """The registered scorer of ``data_source``, in verl's ``compute_score`` signature; a data source without
    one raises NotImplementedError, as verl's does."""
    if data_source not in SCORERS:
        raise NotImplementedError(
            f"no reward scorer registered for data_source {data_source!r}; registered: {sorted(SCORERS)}"
        )
    return SCORERS[data_source](solution_str, ground_truth, extra_info)


def extract_boxed(text: str) -> str | None:
    r"""Contents of the last ``\boxed{...}`` in ``text`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: the answer was cut off


_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def parse_number(text: str) -> float | None:
    """A plain number, also with thousands separators, a trailing period, or a simple fraction a/b."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if _NUMBER.match(cleaned):
        return float(cleaned)
    frac = re.fullmatch(r"([-+]?\d+)\s*/\s*(\d+)", cleaned) or re.fullmatch(
        r"\\frac\{([-+]?\d+)\}\{(\d+)\}", cleaned
    )
    if frac and int(frac.group(2)) != 0:
        return int(frac.group(1)) / int(frac.group(2))
    return None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).strip().lower()


@register_scorer("exact_match")
def exact_match(solution_str: str, ground_truth, extra_info=None) -> float:
    """1 when the boxed answer (or the whole response if none) equals the ground truth, ignoring case/space."""
    answer = extract_boxed(solution_str)
    return float(_normalise(solution_str if answer is None else answer) == _normalise(ground_truth))


@register_scorer("numeric")
def numeric_tolerance(solution_str: str, ground_truth, extra_info=None) -> float:
    """1 when the boxed number is within a relative/absolute tolerance (extra_info['tolerance'], 1e-6)."""
    answer = extract_boxed(solution_str)
    value = parse_number(answer) if answer is not None else None
    target = parse_number(str(ground_truth))
    if value is None or target is None:
        return 0.0
    tol = float((extra_info or {}).get("tolerance", 1e-6))
    return float(math.isclose(value, target, rel_tol=tol, abs_tol=tol))


@register_scorer("math", "boxed_math", "gsm8k", "lighteval/MATH")
def boxed_math(solution_str: str, ground_truth, extra_info=None) -> float:
    r"""Math answers from ``\boxed{}``: numeric comparison when both sides parse as numbers, otherwise
    normalised string comparison (spaces and ``\left``/``\right``/``\!`` removed)."""
    answer = extract_boxed(solution_str)
    if answer is None:
        return 0.0
    value, target = parse_number(answer), parse_number(str(ground_truth))
    if value is not None and target is not None:
        return float(math.isclose(value, target, rel_tol=1e-6, abs_tol=1e-6))

    def canon(s: str) -> str:
        s = re.sub(r"\\left|\\right|\\!|\\,|\s+", "", str(s))
        return s.removeprefix("\\text{").removesuffix("}").lower()

    return float(canon(answer) == canon(ground_truth))


@dataclass
class ScoreResult:
    scores: list[float]
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)  # "row i (data_source): error", first few only


# verl's custom reward function: ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float``
CustomScorer = Callable[[str, str, object, dict | None], float]


def load_custom_scorer(path: str, name: str = "compute_score") -> CustomScorer:
    """Function ``name`` of the Python file ``path`` (``custom_reward_function.path`` / ``.name``), imported as a
    module registered in ``sys.modules`` (``workers.plugins.load_user_file``: dataclasses and pickling work in
    it). Errors name the key and the file: FileNotFoundError, ``UserCodeError`` (an ImportError naming the file
    and the line of an error raised while importing it), AttributeError (no such function)."""
    try:
        module = load_user_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"custom_reward_function.path={path!r} is not a file") from None
    except UserCodeError as err:
        raise UserCodeError(f"custom_reward_function.path={path!r}: {err}") from err.__cause__
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"custom_reward_function: {path} defines no function {name!r}")
    return fn


def score_batch(
    solutions: Sequence[str],
    data_sources: Sequence[str],
    ground_truths: Sequence[object],
    extra_infos: Sequence[dict | None] | None = None,
    default_scorer: str | None = None,
    max_messages: int = 5,
    custom: CustomScorer | None = None,
) -> ScoreResult:
    """Score a batch. A scorer that raises, or returns a non-finite value, gives that row 0 and an error.
    ``custom`` scores every data source instead of the registered scorers."""
    result = ScoreResult(scores=[])
    extra_infos = extra_infos if extra_infos is not None else [None] * len(solutions)
    for row, (text, source, truth, extra) in enumerate(
        zip(solutions, data_sources, ground_truths, extra_infos)
    ):
        # an unknown source without a custom function: a config error, raised
        scorer = get_scorer(source, default_scorer) if custom is None else partial(custom, source)
        try:
            score = float(scorer(text, truth, extra))
            if not math.isfinite(score):
                raise ValueError(f"scorer returned {score}")
        except Exception as err:  # one bad sample must not fail the run
            score = 0.0
            result.errors += 1
            if len(result.error_messages) < max_messages:
                result.error_messages.append(f"row {row} ({source}): {type(err).__name__}: {err}")
        result.scores.append(score)
    return result
