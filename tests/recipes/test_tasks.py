"""Task generators: determinism, split disjointness, verifiable answers, parquet schema, scorers, CLI."""

from fractions import Fraction

import pyarrow.parquet as pq
import pytest

from recipes.tasks import DATA_SOURCES, TASKS, generate_splits, make_dataset, task_config
from recipes.tasks.make import main as make_main
from workers.reward import compute_score, extract_boxed
from workers.reward.expr import ExprError, evaluate, solve_steps, tokenize

COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def _key(row):
    return row["prompt"][0]["content"]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_by_seed(task):
    a = generate_splits(task, 60, 20, seed=3)
    b = generate_splits(task, 60, 20, seed=3)
    c = generate_splits(task, 60, 20, seed=4)
    assert a == b
    assert [_key(r) for r in a["train"]] != [_key(r) for r in c["train"]]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_disjoint_and_sized(task):
    s = generate_splits(task, 300, 100, seed=0)
    assert len(s["train"]) == 300 and len(s["val"]) == 100
    train, val = {_key(r) for r in s["train"]}, {_key(r) for r in s["val"]}
    assert len(train) == 300 and len(val) == 100
    assert not train & val
    for split, rows in s.items():
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
        assert {r["extra_info"]["split"] for r in rows} == {split}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_sft_split_disjoint_and_earlier_splits_unchanged(task):
    base = generate_splits(task, 100, 50, seed=0)
    s = generate_splits(task, 100, 50, seed=0, n_sft=150)
    assert set(base) == {"train", "val"} and set(s) == {"train", "val", "sft"}
    assert s["train"] == base["train"] and s["val"] == base["val"]
    keys = [{_key(r) for r in s[k]} for k in ("train", "val", "sft")]
    assert [len(k) for k in keys] == [100, 50, 150]
    assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2])
    assert {r["extra_info"]["split"] for r in s["sft"]} == {"sft"}
    if task == "arith_mixed":  # the warm-start split carries the noisy demonstrations
        assert {r["extra_info"]["demo_kind"] for r in s["sft"]} == {"correct", "left_to_right"}


def test_countdown_disjoint_up_to_number_order():
    s = generate_splits("countdown", 300, 100, seed=0)

    def canon(r):
        gt = r["reward_model"]["ground_truth"]
        return tuple(sorted(gt["numbers"])), gt["target"]

    assert not {canon(r) for r in s["train"]} & {canon(r) for r in s["val"]}


@pytest.mark.parametrize("task", ["arithmetic", "arith_mixed"])
def test_arithmetic_answers_verify(task):
    s = generate_splits(task, 200, 50, seed=1)
    for rows in s.values():
        for r in rows:
            expr = r["extra_info"]["question"].removeprefix("Compute ").removesuffix(".")
            gt = r["reward_model"]["ground_truth"]
            assert evaluate(expr) == Fraction(int(gt))
            sol = r["extra_info"]["solution"]
            assert sol.startswith(expr + " = ")
            if r["extra_info"]["demo_kind"] == "correct":
                assert extract_boxed(sol) == gt
                assert compute_score(r["data_source"], sol, gt) == 1.0
            else:  # sloppy left-to-right demonstration: wrong on a precedence trap
                assert compute_score(r["data_source"], sol, gt) == 0.0


def test_arith_mixed_noise_only_in_train_and_problems_unchanged():
    mixed = generate_splits("arith_mixed", 400, 100, seed=0)
    kinds = [r["extra_info"]["demo_kind"] for r in mixed["train"]]
    assert 0.45 < kinds.count("left_to_right") / len(kinds) < 0.75
    assert {r["extra_info"]["demo_kind"] for r in mixed["val"]} == {"correct"}
    # every arith_mixed problem is a precedence trap
    for r in mixed["val"]:
        expr = r["extra_info"]["question"].removeprefix("Compute ").removesuffix(".")
        assert solve_steps(tokenize(expr), precedence=False)[-1][0] != int(r["reward_model"]["ground_truth"])
    # demonstration noise does not change the problems
    clean = generate_splits("arith_mixed", 400, 100, seed=0, demo_noise=0.0)
    assert [_key(r) for r in clean["train"]] == [_key(r) for r in mixed["train"]]
    assert {r["extra_info"]["demo_kind"] for r in clean["train"]} == {"correct"}


def test_arithmetic_difficulty_knobs():
    s = generate_splits(
        "arithmetic", 200, 0, seed=0, min_operands=5, max_operands=5, paren_prob=1.0, ops="+-"
    )
    for r in s["train"]:
        expr = r["extra_info"]["question"].removeprefix("Compute ").removesuffix(".")
        toks = tokenize(expr)
        assert sum(isinstance(t, int) for t in toks) == 5
        assert "(" in toks and "*" not in toks
        for step in solve_steps(toks):
            assert all(0 <= t <= 99 for t in step if isinstance(t, int))
    with pytest.raises(ValueError, match="unknown knob"):
        task_config("arithmetic", max_operandz=3)
    with pytest.raises(ValueError, match="ops"):
        task_config("arithmetic", ops="+^")


def test_countdown_answers_verify():
    s = generate_splits("countdown", 200, 50, seed=2)
    for r in s["train"]:
        sol, gt = r["extra_info"]["solution"], r["reward_model"]["ground_truth"]
        assert compute_score(r["data_source"], sol, gt) == 1.0
        assert evaluate(extract_boxed(sol)) == gt["target"]


def test_scorers():
    a = DATA_SOURCES[0]
    assert compute_score(a, "so \\boxed{10}.", "10") == 1.0
    assert compute_score(a, "\\boxed{ 10 }", "10") == 1.0
    assert compute_score(a, "\\boxed{9} then \\boxed{10}", "10") == 1.0  # the last box counts
    assert compute_score(a, "\\boxed{10} then \\boxed{9}", "10") == 0.0
    assert compute_score(a, "the answer is 10", "10") == 0.0
    assert compute_score(a, "\\boxed{5+5}", "10") == 0.0
    assert compute_score(a, "\\boxed{-3}", "-3") == 1.0
    assert compute_score(a, "\\boxed{10", "10") == 0.0
    c = DATA_SOURCES[1]
    gt = {"target": 22, "numbers": [7, 3, 5]}
    assert compute_score(c, "\\boxed{3*5+7}", gt) == 1.0
    assert compute_score(c, "\\boxed{(5*3)+7}", gt) == 1.0
    assert compute_score(c, "\\boxed{3*5+7+0}", gt) == 0.0  # extra number
    assert compute_score(c, "\\boxed{22}", gt) == 0.0
    assert compute_score(c, "\\boxed{3*5*7}", gt) == 0.0
    assert compute_score(c, "\\boxed{3*5+7)}", gt) == 0.0  # malformed
    assert compute_score(c, "\\boxed{-3*5+7}", gt) == 0.0  # unary minus not allowed
    with pytest.raises(NotImplementedError):
        compute_score("nope", "\\boxed{1}", "1")


def test_expr_parser():
    assert evaluate("3+4*2-1") == 10
    assert evaluate("(3+4)*2") == 14
    assert evaluate("8/4/2") == 1
    assert evaluate("-3+1") == -2
    for bad in ["", "3+", "3 4", "(3", "3)", "import os", "1/0", "9" * 20]:
        with pytest.raises((ExprError, ZeroDivisionError)):
            evaluate(bad)
    assert [len(s) for s in solve_steps(tokenize("2*(3+4)-1"))] == [9, 5, 3, 1]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_parquet_schema(tmp_path, task):
    paths = make_dataset(task, tmp_path / task, n_train=40, n_val=10, n_sft=20, seed=0)
    assert sorted(paths) == ["sft", "train", "val"]
    for split, path in paths.items():
        table = pq.read_table(path)
        assert table.column_names == COLUMNS
        assert table.num_rows == {"train": 40, "val": 10, "sft": 20}[split]
        for r in table.to_pylist():
            assert r["data_source"] in TASKS[task].data_sources
            assert isinstance(r["prompt"], list) and r["prompt"][0]["role"] == "user"
            assert r["prompt"][0]["content"]
            assert r["reward_model"]["style"] == "rule" and r["reward_model"]["ground_truth"] is not None
            assert r["ability"] == "math"
            ei = r["extra_info"]
            assert ei["split"] == split and isinstance(ei["index"], int) and ei["solution"]


def test_cli(tmp_path, capsys):
    out = tmp_path / "arith"
    make_main(["--task", "arithmetic", "--out", str(out), "--train", "30", "--val", "5", "--seed", "0",
               "--knob", "max_operands=5", "--knob", "nonnegative=false"])  # fmt: skip
    assert pq.read_table(out / "train.parquet").num_rows == 30
    assert pq.read_table(out / "val.parquet").num_rows == 5
    assert not (out / "sft.parquet").exists()
    make_main(
        ["--task", "arith_mixed", "--out", str(tmp_path / "m"), "--train", "30", "--val", "5", "--sft", "7"]
    )
    assert pq.read_table(tmp_path / "m" / "sft.parquet").num_rows == 7
    assert "train:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        make_main(["--task", "arithmetic", "--out", str(out), "--knob", "nope=1"])
    with pytest.raises(SystemExit):  # impossible request: too few distinct problems
        make_main(["--task", "arithmetic", "--out", str(out), "--train", "500", "--val", "0",
                   "--knob", "min_operands=2", "--knob", "max_operands=2", "--knob", "max_operand=2"])  # fmt: skip
