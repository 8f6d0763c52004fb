"""The ``tool_math`` task and the hybrid recipe's warm-start demonstrations and pass@k estimator."""

from __future__ import annotations

import collections
import json

import pytest

from recipes.tasks import generate_splits, task_config
from recipes.trainer.hybrid import hinted_demonstrations
from recipes.trainer.validation import pass_at_k
from workers.agents.replay import reference_batch, reference_trajectories
from workers.math_env.env_loop import MathToolEnvConfig
from workers.math_env.protocol import verify_boxed
from workers.models import load_tokenizer
from workers.models.tiny import ensure_tiny_model
from workers.prm.hindsight import bridge_thought, diagnose
from workers.reward import compute_score
from workers.roles.reference import build_teacher_inputs


def test_problems_are_seeded_and_ground_truth_is_the_value():
    a = generate_splits("tool_math", 40, 10, seed=3)
    b = generate_splits("tool_math", 40, 10, seed=3)
    assert a == b
    for r in a["train"] + a["val"]:
        expr = r["extra_info"]["question"].removeprefix("Compute ").removesuffix(".")
        assert str(eval(expr)) == r["reward_model"]["ground_truth"]
        assert r["data_source"] == "hyflow/arithmetic"
    assert {r["extra_info"]["demo_kind"] for r in a["val"]} == {"tool"}  # held-out demos are always clean
    kinds = collections.Counter(
        r["extra_info"]["demo_kind"] for r in generate_splits("tool_math", 400, 0)["train"]
    )
    assert 40 <= kinds["error"] <= 120 and 40 <= kinds["direct"] <= 120  # 20% / 20% by default


def test_knobs_are_validated():
    with pytest.raises(ValueError, match="ops"):
        task_config("tool_math", ops="*")
    with pytest.raises(ValueError, match="error_frac \\+ direct_frac"):
        task_config("tool_math", error_frac=0.7, direct_frac=0.7)
    with pytest.raises(ValueError, match="unknown knob"):
        task_config("tool_math", digit=3)


def test_demonstrations_replayed_in_the_sandbox():
    rows = generate_splits("tool_math", 12, 0, seed=1, error_frac=0.4, direct_frac=0.3)["train"]
    tok = load_tokenizer(ensure_tiny_model("nano"))
    trajs = reference_trajectories(rows, tok, MathToolEnvConfig())
    assert len(trajs) == len(rows)  # every demonstration ends with an answer
    for r, t in zip(rows, trajs):
        truth, kind = r["reward_model"]["ground_truth"], r["extra_info"]["demo_kind"]
        score = verify_boxed(t.final_answer, truth)
        assert score == compute_score(
            "hyflow/arithmetic", t.final_answer, truth
        )  # env verifier == reward rule
        assert score == (0.0 if kind == "direct" else 1.0), (kind, t.final_answer, truth)
        steps = t.metadata["steps"]
        if kind == "error":  # the typo gives a real SyntaxError observation, the fix the value
            assert "SyntaxError" in steps[0]["observation"] and truth in steps[1]["observation"]
        if kind == "tool":
            assert steps[0]["observation"] == f"Output:\n{truth}"
    batch = reference_batch(rows, tok, MathToolEnvConfig())
    assert len(batch) == len(rows) and (batch.batch["response_mask"].sum(-1) > 0).all()


def test_pass_at_k():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 4) == 1.0
    with pytest.raises(ValueError, match="pass@5"):
        pass_at_k(4, 1, 5)


def test_failed_attempts_fail_as_their_kind_says():
    """Every row's ``failed_steps`` is a wrong attempt the hindsight judge diagnoses as the failure it is."""
    rows = generate_splits("tool_math", 60, 0, seed=2)["train"]
    seen = collections.Counter()
    for r in rows:
        steps, truth = json.loads(r["extra_info"]["failed_steps"]), r["reward_model"]["ground_truth"]
        assert all(verify_boxed(s["action"], truth) == 0.0 for s in steps if s["kind"] == "answer")
        seen[diagnose(steps, truth)[0]] += 1
        assert r["extra_info"]["tool_turns"] == [
            f"<python>print({r['extra_info']['question'][len('Compute ') : -1]})</python>",
            f"\\boxed{{{truth}}}",
        ]
    assert set(seen) == {"guess", "tool_error", "wrong_value", "copy_slip"}, seen


def test_hinted_demonstrations_use_the_teachers_layout():
    """``hybrid.hinted_demos``: the warm start shows [prompt + hint + correct solution] token for token as the
    teacher (``build_teacher_inputs``) sees [prompt + hint + response], so what the reference learns there is
    what it is asked in RL."""
    rows = generate_splits("tool_math", 6, 0, seed=1)["train"]
    tok = load_tokenizer(ensure_tiny_model("nano"))
    env, template = MathToolEnvConfig(), "Hint: {hint}\n"
    batch = hinted_demonstrations(rows, tok, env, frac=0.5, template=template)
    assert len(batch) == 6 + 3  # every demonstration, then 3 hinted correct solutions
    solutions = reference_batch(
        [
            {**r, "extra_info": {**r["extra_info"], "reference_turns": r["extra_info"]["tool_turns"]}}
            for r in rows[:3]
        ],
        tok,
        env,
    )
    hints = [
        tok.encode(
            template.format(
                hint=bridge_thought(
                    r["extra_info"]["question"],
                    json.loads(r["extra_info"]["failed_steps"]),
                    r["reward_model"]["ground_truth"],
                )
            ),
            add_special_tokens=False,
        )
        for r in rows[:3]
    ]
    b, s = batch.batch, solutions.batch
    P = s["prompts"].shape[1]
    teacher = build_teacher_inputs(s["prompts"], s["responses"], s["attention_mask"], hints, tok.pad_token_id)
    for i in range(3):
        want = teacher["input_ids"][i][teacher["attention_mask"][i].bool()].tolist()
        got = b["input_ids"][6 + i][b["attention_mask"][6 + i].bool()].tolist()
        assert got == want
        trained = b["responses"][6 + i][b["response_mask"][6 + i].bool()].tolist()
        assert (
            trained == s["responses"][i][s["response_mask"][i].bool()].tolist()
        )  # loss on the solution only
        assert "Hint: " in tok.decode(b["prompts"][6 + i]) and P < b["prompts"].shape[1]
    with pytest.raises(ValueError, match="row 1 repeats the question"):  # a replay is known by its question
        hinted_demonstrations([rows[0], rows[0]], tok, env, frac=1.0, template=template)
