"""Long-context RLM tasks: determinism, disjoint splits, lengths, needles, recomputable ground truth,
reference solutions that reproduce it under plain ``exec``, scorers on hand-worked examples, CLI."""

import contextlib
import io
import itertools
import re
from collections import Counter

import pyarrow.parquet as pq
import pytest

from recipes.tasks import ALL_TASKS, DATA_SOURCES, LONG_CONTEXT_TASKS, TASKS, generate_splits, task_config
from recipes.tasks.long_context import CUES, LABELS, classify_instance, context_length, parse_lengths
from recipes.tasks.make import main as make_main
from workers.reward import compute_score, get_scorer, score_batch
from workers.reward.long_context import (
    OOLONG,
    OOLONG_PAIRS,
    SNIAH,
    pair_f1,
    parse_pairs,
    score_oolong,
    score_oolong_pairs,
    score_sniah,
)
from workers.rlm.protocol import parse_turn

LC = sorted(LONG_CONTEXT_TASKS)
SMALL = {"lengths": "2000,3000"}
COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]
_LINE = re.compile(r"^Date: (.+?) \|\| User: (\d+) \|\| Instance: (.+?)(?: \|\| Label: (\w+))?$")


def run_reference(row) -> str | None:
    """Execute the reference turns with plain ``exec`` on the context; the answer they finish with."""
    ns: dict = {"context": row["extra_info"]["context"]}
    answers: list[str] = []
    ns["FINAL"] = lambda value: answers.append(str(value))
    ns["FINAL_VAR"] = lambda name: answers.append(str(ns[name]))
    for text in row["extra_info"]["reference_turns"]:
        turn = parse_turn(text)
        assert turn.code_blocks or turn.final, text
        for code in turn.code_blocks:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(code, ns)
            if answers:
                return answers[0]
        if turn.final is not None:
            f = turn.final
            return f.answer if f.kind == "FINAL" else str(ns[f.var_name])
    return None


def records(context):
    lines = context if isinstance(context, list) else context.split("\n")
    out = []
    for line in lines:
        m = _LINE.match(line)
        assert m, line
        label = m.group(4) or classify_instance(m.group(3))
        if m.group(4):
            assert classify_instance(m.group(3)) == m.group(4)  # explicit labels agree with the cues
        out.append((int(m.group(2)), label))
    return out


# ------------------------------------------------------------------------------------------ registry


def test_registered_beside_the_existing_tasks():
    assert set(LC) == {"sniah", "oolong", "oolong_pairs"}
    assert not set(LC) & set(TASKS) and set(ALL_TASKS) == set(TASKS) | set(LC)
    assert {SNIAH, OOLONG, OOLONG_PAIRS} <= set(DATA_SOURCES)
    assert DATA_SOURCES[:2] == ("hyflow/arithmetic", "hyflow/countdown")
    for source in (SNIAH, OOLONG, OOLONG_PAIRS):
        get_scorer(source)  # registered with the reward worker's registry
    with pytest.raises(ValueError, match="lengths"):
        task_config("sniah", lengths="10")
    with pytest.raises(ValueError, match="unknown knob"):
        task_config("oolong", needle_depth_min=0.5)
    assert parse_lengths("8K, 64000,1M") == (8000, 64000, 1_000_000)
    assert task_config("sniah", lengths=[8000, 16000]).length_values == (8000, 16000)
    with pytest.raises(ValueError, match="bad length"):
        parse_lengths("8G")


def test_cues_are_unambiguous():
    cues = [c for c, _ in CUES]
    assert len(set(cues)) == len(cues) and {lab for _, lab in CUES} == set(LABELS)
    for a, b in itertools.permutations(cues, 2):
        assert not a.startswith(b), (a, b)


# -------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("task", LC)
def test_deterministic_by_seed_and_disjoint(task):
    a = generate_splits(task, 12, 6, seed=3, **SMALL)
    assert a == generate_splits(task, 12, 6, seed=3, **SMALL)
    c = generate_splits(task, 12, 6, seed=4, **SMALL)
    ctx = [r["extra_info"]["context"] for r in a["train"]]
    assert ctx != [r["extra_info"]["context"] for r in c["train"]]
    assert len(a["train"]) == 12 and len(a["val"]) == 6
    for split, rows in a.items():
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
        assert {r["extra_info"]["split"] for r in rows} == {split}
    train = {(r["prompt"][0]["content"], r["extra_info"]["context"]) for r in a["train"]}
    val = {(r["prompt"][0]["content"], r["extra_info"]["context"]) for r in a["val"]}
    assert len(train) == 12 and not train & val
    if task == "sniah":  # needle keys never repeat across splits
        keys = [r["extra_info"]["needle_key"] for rows in a.values() for r in rows]
        assert len(set(keys)) == len(keys)
    # asking for more train rows leaves validation unchanged
    assert generate_splits(task, 20, 6, seed=3, **SMALL)["val"] == a["val"]


@pytest.mark.parametrize("task", LC)
def test_row_format_and_reference_solution(task):
    rows = generate_splits(task, 6, 0, seed=1, **SMALL)["train"]
    for r in rows:
        assert list(r) == COLUMNS and r["ability"] == "long_context"
        assert r["data_source"] == LONG_CONTEXT_TASKS[task].data_sources[0]
        ei = r["extra_info"]
        assert r["prompt"] == [{"role": "user", "content": ei["question"]}]
        assert ei["context"] not in r["prompt"][0]["content"]  # the context is not in the prompt
        assert ei["context_length"] == context_length(ei["context"]) and ei["context_type"] == "str"
        assert ei["solution"] == "\n\n".join(ei["reference_turns"])
        gt = r["reward_model"]["ground_truth"]
        answer = run_reference(r)
        assert answer is not None
        assert compute_score(r["data_source"], answer, gt) == 1.0


@pytest.mark.parametrize("style", ["var_line", "code", "literal_line"])
@pytest.mark.parametrize("task", LC)
def test_reference_styles_and_list_contexts(task, style):
    knobs = {"lengths": "3000", "final_style": style, "context_format": "list"}
    if task == "sniah":
        knobs["item_chars"] = 500
    if task != "sniah":
        knobs["label_mode"] = "explicit"
    for r in generate_splits(task, 3, 0, seed=5, **knobs)["train"]:
        ei = r["extra_info"]
        assert isinstance(ei["context"], list) and ei["n_items"] == len(ei["context"]) > 1
        turns = [parse_turn(t) for t in ei["reference_turns"]]
        last = turns[-1]
        if style == "code":
            assert last.code_calls_final and last.final is None
        else:
            assert last.final is not None and last.final.kind == (
                "FINAL_VAR" if style == "var_line" else "FINAL"
            )
        assert not any(t.may_finish for t in turns[:-1])
        answer = run_reference(r)
        assert score_batch([answer], [r["data_source"]], [r["reward_model"]["ground_truth"]]).scores == [1.0]


# ------------------------------------------------------------------------------------------- S-NIAH


@pytest.mark.parametrize("lengths", ["8000,64000", "1M"])
def test_sniah_needle_once_at_requested_length(lengths):
    rows = generate_splits("sniah", 4 if lengths != "1M" else 1, 0, seed=2, lengths=lengths)["train"]
    for r in rows:
        ei = r["extra_info"]
        text, key, value = ei["context"], ei["needle_key"], r["reward_model"]["ground_truth"]
        want = ei["requested_length"]
        assert want in parse_lengths(lengths)
        assert abs(len(text) - want) <= 0.01 * want
        assert re.fullmatch(r"[1-9]\d{6}", value)
        assert text.count(f"The special magic number for {key} is {value}.") == 1
        assert text.count("magic") == 1 and text.count(value) == 1 and text.count(key) == 1
        assert not re.search(r"\d", text.replace(value, ""))  # the filler has no digits
        assert abs(text.index(ei["needle"]) / len(text) - ei["needle_depth"]) < 1e-9
        assert key in r["prompt"][0]["content"]


def test_sniah_depth_knobs_and_distractors():
    rows = generate_splits(
        "sniah", 8, 0, seed=0, lengths="8000", needle_depth_min=0.5, needle_depth_max=0.6, n_distractors=3
    )["train"]
    for r in rows:
        ei = r["extra_info"]
        assert 0.48 <= ei["needle_depth"] <= 0.62
        found = re.findall(r"The special magic number for ([\w-]+) is (\d{7})\.", ei["context"])
        assert len(found) == 4 and len({k for k, _ in found}) == 4
        assert dict(found)[ei["needle_key"]] == r["reward_model"]["ground_truth"]
        assert run_reference(r) == r["reward_model"]["ground_truth"]


def test_sniah_pattern_search_and_small_key_vocabulary():
    rows = generate_splits("sniah", 24, 4, seed=0, lengths="2000", search="pattern", key_words=2)
    keys = {r["extra_info"]["needle_key"] for split in rows.values() for r in split}
    assert len(keys) <= 4  # 2 adjectives x 2 nouns
    for r in rows["train"]:
        first = r["extra_info"]["reference_turns"][0]
        assert r["extra_info"]["needle_key"] not in first  # the program never names the key
        assert run_reference(r) == r["reward_model"]["ground_truth"]
    with pytest.raises(ValueError, match="n_distractors=0"):
        generate_splits("sniah", 2, 0, seed=0, lengths="2000", search="pattern", n_distractors=1)
    with pytest.raises(ValueError, match="search must be"):
        generate_splits("sniah", 2, 0, seed=0, lengths="2000", search="grep")


def test_sniah_decoys_defeat_the_sloppy_shortcut_only():
    rows = generate_splits(
        "sniah", 60, 0, seed=0, lengths="2000", search="pattern", n_decoys=1, sloppy_frac=0.5
    )["train"]
    styles = {"sloppy": [], "pattern": []}
    for r in rows:
        ei, truth = r["extra_info"], r["reward_model"]["ground_truth"]
        numbers = re.findall(r"\d{7}", ei["context"])
        assert len(numbers) == 2 and truth in numbers  # the needle and one decoy with another number
        assert (
            f"wrongly gave {(set(numbers) - {truth}).pop()} as the special magic number for " in ei["context"]
        )
        got = run_reference(r)
        styles[ei["reference_search"]].append(got == truth)
        if ei["reference_search"] == "sloppy":
            assert got == numbers[0]  # the shortcut: the first seven-digit number, decoy or not
    assert all(styles["pattern"])  # the careful program is never fooled
    assert 0 < sum(styles["sloppy"]) < len(styles["sloppy"])  # the shortcut is right only sometimes
    assert 15 <= len(styles["sloppy"]) <= 45


# ------------------------------------------------------------------------------------------- OOLONG


@pytest.mark.parametrize("label_mode", ["implicit", "explicit"])
def test_oolong_ground_truth_recomputes(label_mode):
    rows = generate_splits("oolong", 24, 0, seed=7, lengths="8000", label_mode=label_mode)["train"]
    assert {r["extra_info"]["query_type"] for r in rows} == {
        "count",
        "count_user",
        "most_common",
        "least_common",
    }
    for r in rows:
        ei, gt = r["extra_info"], r["reward_model"]["ground_truth"]
        assert 8000 - 150 <= ei["context_length"] <= 8000  # within one line of the requested length
        recs = records(ei["context"])
        assert ("|| Label:" in ei["context"]) == (label_mode == "explicit")
        counts = Counter(lab for _, lab in recs)
        q = ei["query_type"]
        if q == "count":
            assert gt == str(counts[ei["label"]]) and ei["answer_type"] == "numeric"
        elif q == "count_user":
            assert gt == str(sum(1 for u, lab in recs if u == ei["user"] and lab == ei["label"]))
            assert f"user {ei['user']}" in ei["question"]
        else:
            ranked = sorted(LABELS, key=lambda lab: counts[lab], reverse=q == "most_common")
            assert gt == ranked[0] and counts[ranked[0]] != counts[ranked[1]]
            assert ei["answer_type"] == "categorical"


def head_answer(ei: dict, recs: list, head: int) -> str:
    """What the question asks, computed over the first ``head`` records only (a sloppy reference; ties go to
    the first category in the order the program ranks them: seen order for compact most_common, else LABELS)."""
    counts = Counter(lab for u, lab in recs[:head] if ei["query_type"] != "count_user" or u == ei["user"])
    if ei["query_type"] in ("count", "count_user"):
        return str(counts[ei["label"]])
    if ei["query_type"] == "least_common":
        return min(LABELS, key=lambda lab: counts[lab])
    return max(counts if ei["reference_program"] == "compact" else LABELS, key=lambda lab: counts[lab])


@pytest.mark.parametrize("program", ["compact", "stepwise"])
def test_oolong_sloppy_references_aggregate_the_head_only(program):
    rows = generate_splits(
        "oolong", 80, 0, seed=3, lengths="2000,4000", label_mode="explicit", program=program, sloppy_frac=0.5
    )["train"]
    right: dict[int, list[bool]] = {0: [], 10: []}
    for r in rows:
        ei, gt = r["extra_info"], r["reward_model"]["ground_truth"]
        got, head = run_reference(r), ei["reference_head"]
        assert ei["reference_program"] == program
        assert len(ei["reference_turns"]) == (1 if program == "compact" else 3)
        if head:
            assert got == head_answer(ei, records(ei["context"]), head) and f"[:{head}]" in ei["solution"]
        right[head].append(got == gt)
    assert all(right[0]) and 20 <= len(right[0]) <= 60  # the careful program is always right
    assert 0 < sum(right[10]) < len(right[10])  # counting the first ten lines is right only sometimes


def test_oolong_compact_program_needs_written_labels():
    with pytest.raises(ValueError, match="label_mode='explicit'"):
        generate_splits("oolong", 2, 0, seed=0, lengths="2000", program="compact")
    with pytest.raises(ValueError, match="sloppy_frac"):
        generate_splits("oolong", 2, 0, seed=0, lengths="2000", sloppy_frac=1.5)


def predicates(kind: str, text: str):
    """The per-user tests (P, Q) of a pair condition, read back from its text."""
    labels = re.findall(r"category '(\w+)'", text)
    x = labels[0]
    if kind == "both_has":
        return ((lambda c: c[x] >= 1),) * 2
    if kind == "both_lacks":
        return ((lambda c: c[x] == 0),) * 2
    if kind == "both_more":
        return ((lambda c: c[x] > c[labels[1]]),) * 2
    if kind == "both_at_least":
        k = int(re.search(r"at least (\d+)", text).group(1))
        return ((lambda c: c[x] >= k),) * 2
    assert kind == "exactly_one"
    return (lambda c: c[x] >= 1), (lambda c: c[x] == 0)


def test_oolong_pairs_ground_truth_recomputes():
    rows = generate_splits("oolong_pairs", 30, 0, seed=11, lengths="8000,16000")["train"]
    assert {r["extra_info"]["condition"] for r in rows} == {
        "both_has", "both_lacks", "both_more", "both_at_least", "exactly_one"
    }  # fmt: skip
    for r in rows:
        ei, gt = r["extra_info"], r["reward_model"]["ground_truth"]
        per_user: dict[int, Counter] = {}
        for u, lab in records(ei["context"]):
            per_user.setdefault(u, Counter())[lab] += 1
        text = ei["condition_text"]
        p, q = predicates(ei["condition"], text)
        want = [
            [a, b]
            for a, b in itertools.combinations(sorted(per_user), 2)
            if (p(per_user[a]) and q(per_user[b])) or (p(per_user[b]) and q(per_user[a]))
        ]
        assert gt == want and 3 <= len(gt) <= 30
        assert text in ei["question"]


# ------------------------------------------------------------------------------------------ scorers


def test_sniah_scorer():
    assert score_sniah("1234567", "1234567") == 1.0
    assert score_sniah(' "1234567". ', "1234567") == 1.0
    assert score_sniah("`1234567`", "1234567") == 1.0
    assert score_sniah("1234568", "1234567") == 0.0
    assert score_sniah("The number is 1234567", "1234567") == 0.0
    assert score_sniah("", "1234567") == 0.0 and score_sniah(None, "1234567") == 0.0


def test_oolong_scorer_numeric_and_categorical():
    assert score_oolong("17", "17") == 1.0
    assert score_oolong("18", "17") == 0.75
    assert score_oolong("15", "17") == pytest.approx(0.5625)
    assert score_oolong("27", "17") == pytest.approx(0.75**10)
    assert score_oolong("There are 14 such instances.", "17") == pytest.approx(0.75**3)
    assert score_oolong("1,017", "1017") == 1.0
    assert score_oolong("16.5", "17") == pytest.approx(0.75**0.5)
    assert score_oolong("either 16 or 18", "17") == 0.0  # two numbers: ambiguous
    assert score_oolong("many", "17") == 0.0 and score_oolong("", "17") == 0.0
    assert score_oolong("location", "location") == 1.0
    assert score_oolong(" 'Location'.", "location") == 1.0
    assert score_oolong("Label: location", "location") == 1.0
    assert score_oolong("numeric", "location") == 0.0
    assert score_oolong("location or numeric", "location") == 0.0


def test_pair_parsing_and_f1():
    want = {(1, 2), (3, 4)}
    for text in [
        "(1, 2)\n(3, 4)",
        "[(1, 2), (4, 3)]",
        "[[1,2],[3,4]]",
        "Pairs: (1,2), (3,4).",
        "1-2\n3-4",
        "1 - 2; 3 - 4",
        "1 & 2, 3 and 4",
        "1, 2\n3, 4",
        "user 1 with user 2\n3 4",
        "{1; 2} [3, 4] (2, 1)",  # duplicates collapse
    ]:
        assert parse_pairs(text) == want, text
    assert parse_pairs([[2, 1], (3, 4)]) == want and parse_pairs("") == set() and parse_pairs(None) == set()
    assert pair_f1(set(), set()) == 1.0 and pair_f1({(1, 2)}, set()) == 0.0
    gold = [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert score_oolong_pairs("(1, 2)\n(3, 4)\n(5, 6)\n(7, 8)", gold) == 1.0
    # 2 of 3 predicted are right, 2 of 4 gold found: P = 2/3, R = 1/2, F1 = 4/7
    assert score_oolong_pairs("(2, 1)\n(3, 4)\n(9, 10)", gold) == pytest.approx(4 / 7)
    assert score_oolong_pairs("(1, 3)", gold) == 0.0
    assert score_oolong_pairs("", gold) == 0.0 and score_oolong_pairs(None, gold) == 0.0
    assert score_oolong_pairs("(1, 2)", "(1, 2)\n(3, 4)") == pytest.approx(2 / 3)  # string ground truth


# --------------------------------------------------------------------------------------------- CLI


def test_cli_writes_parquet(tmp_path, capsys):
    out = tmp_path / "sniah"
    paths = make_main(
        ["--task", "sniah", "--lengths", "2000,3K", "--out", str(out), "--train", "4", "--val", "2",
         "--knob", "needle_depth_max=0.5"]
    )  # fmt: skip
    assert sorted(paths) == ["train", "val"] and "train:" in capsys.readouterr().out
    table = pq.read_table(out / "train.parquet")
    assert table.column_names == COLUMNS and table.num_rows == 4
    for r in table.to_pylist():
        assert r["extra_info"]["requested_length"] in (2000, 3000)
        assert r["extra_info"]["needle_depth"] <= 0.52
        assert run_reference(r) == r["reward_model"]["ground_truth"]
    pairs = make_main(["--task", "oolong_pairs", "--lengths", "4000", "--out", str(tmp_path / "p"),
                       "--train", "3", "--val", "1"])  # fmt: skip
    rows = pq.read_table(pairs["train"]).to_pandas()
    for gt, sol in zip(rows.reward_model, rows.extra_info):
        assert compute_score(OOLONG_PAIRS, run_reference({"extra_info": sol}), gt["ground_truth"]) == 1.0
    with pytest.raises(SystemExit):
        make_main(["--task", "arithmetic", "--lengths", "8000", "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit):
        make_main(["--task", "oolong", "--lengths", "8000", "--knob", "label_mode=both", "--out", str(out)])
