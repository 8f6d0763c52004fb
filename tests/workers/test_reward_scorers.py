"""Rule scorers: answer extraction, matching rules, registration and per-sample error isolation."""

import sys
import typing

import pytest

from workers.reward import extract_boxed, get_scorer, load_custom_scorer, register_scorer, score_batch
from workers.reward.scorers import parse_number


def test_extract_boxed_takes_the_last_balanced_box():
    assert extract_boxed(r"first \boxed{1} then \boxed{\frac{3}{4}} done") == r"\frac{3}{4}"
    assert extract_boxed("no answer") is None
    assert extract_boxed(r"cut off \boxed{12") is None


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42.0),
        ("-3.5", -3.5),
        ("1,000", 1000.0),
        ("7.", 7.0),
        ("3/4", 0.75),
        (r"\frac{1}{8}", 0.125),
        ("x", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_boxed_math_numeric_and_symbolic():
    score = get_scorer("math")
    assert score(r"so \boxed{10}", "10") == 1.0
    assert score(r"so \boxed{10.0}", 10) == 1.0
    assert score(r"so \boxed{11}", "10") == 0.0
    assert score("10", "10") == 0.0  # no box, no credit
    assert score(r"\boxed{\left(1, 2\right)}", "(1,2)") == 1.0


def test_exact_and_numeric_tolerance():
    assert get_scorer("exact_match")(r"\boxed{ Paris }", "paris") == 1.0
    assert get_scorer("numeric")(r"\boxed{3.1416}", "3.14159", {"tolerance": 1e-3}) == 1.0
    assert get_scorer("numeric")(r"\boxed{3.2}", "3.14159", {"tolerance": 1e-3}) == 0.0


def test_raising_scorer_fails_only_its_sample():
    @register_scorer("test_flaky")
    def flaky(text, truth, extra=None):
        if text == "boom":
            raise RuntimeError("parser exploded")
        return float(text == truth)

    result = score_batch(["a", "boom", "c"], ["test_flaky"] * 3, ["a", "b", "x"])
    assert result.scores == [1.0, 0.0, 0.0]
    assert result.errors == 1
    assert result.error_messages == ["row 1 (test_flaky): RuntimeError: parser exploded"]


def test_non_finite_score_is_an_error():
    register_scorer("test_nan")(lambda text, truth, extra=None: float("nan"))
    result = score_batch(["x"], ["test_nan"], ["y"])
    assert result.scores == [0.0] and result.errors == 1


def test_unknown_data_source_names_it_and_default_applies():
    with pytest.raises(KeyError, match="'nope'.*registered"):
        score_batch(["x"], ["nope"], ["y"])
    assert score_batch([r"\boxed{2}"], ["nope"], ["2"], default_scorer="math").scores == [1.0]


def test_a_custom_reward_function_scores_every_source_and_bad_files_are_named(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return len(solution_str) + (0.5 if data_source == 'nope' else 0.0)\n"
        "def broken(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError('no')\n"
    )
    custom = load_custom_scorer(str(path))
    # a source no scorer is registered for is no error: the custom function scores it
    result = score_batch(["abc", "de"], ["nope", "hyflow/arithmetic"], ["1", "2"], custom=custom)
    assert result.scores == [3.5, 2.0] and result.errors == 0
    failing = score_batch(["x"], ["nope"], ["1"], custom=load_custom_scorer(str(path), "broken"))
    assert failing.scores == [0.0] and failing.error_messages == ["row 0 (nope): ValueError: no"]
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path='/no/such.py'"):
        load_custom_scorer("/no/such.py")
    with pytest.raises(AttributeError, match="defines no function 'absent'"):
        load_custom_scorer(str(path), "absent")


def test_a_custom_reward_file_with_postponed_annotations_and_a_dataclass_scores(tmp_path):
    """The file of issue 56, which crashed in the reward workers (``'NoneType' object has no attribute
    '__dict__'``: dataclasses look the class's module up in ``sys.modules``): it is imported as a registered
    module, once."""
    path = tmp_path / "my_reward.py"
    path.write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass, field\n"
        "@dataclass\n"
        "class Rule:\n"
        "    bonus: float = 0.25\n"
        "    words: list[str] = field(default_factory=lambda: ['yes'])\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    rule = Rule()\n"
        "    return float(solution_str == ground_truth) + rule.bonus * (solution_str in rule.words)\n"
    )
    custom = load_custom_scorer(str(path))
    assert score_batch(["yes", "no", "4"], ["a", "b", "c"], ["yes", "yes", "4"], custom=custom).scores == [
        1.25,
        0.0,
        1.0,
    ]
    module = sys.modules[custom.__module__]
    assert module.__file__ == str(path) and typing.get_type_hints(module.Rule) == {
        "bonus": float,
        "words": list[str],
    }
    assert load_custom_scorer(str(path)) is custom  # one module per file
