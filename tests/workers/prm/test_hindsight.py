"""The rule-based hindsight judge (``prm.scorer=rule``): step votes and bridge thoughts on hand-made tool
trajectories, one per failure it names, through ``PRMWorker.score_steps`` as the recipe calls it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dataproto import DataProto
from workers.prm import PRMConfig, PRMWorker
from workers.prm.hindsight import FAILURES, bridge_thought, diagnose, problem_expression, step_votes

Q = "Compute 12 + 34 * 5."  # = 182
CALL = "<python>print(12 + 34 * 5)</python>"


def tool(action: str, observation: str) -> dict:
    return {"kind": "tool", "action": action, "observation": observation}


def answer(n) -> dict:
    return {"kind": "answer", "action": f"\\boxed{{{n}}}", "observation": ""}


CASES = {
    "solved": ([tool(CALL, "Output:\n182"), answer(182)], [1, 1], None),
    "guess": ([answer(180)], [-1], f"Do not guess the value. Run the tool first: {CALL}"),
    "tool_error": (
        [tool("<python>print(12 + 34 * 5 +)</python>", "Error: SyntaxError: invalid syntax"), answer(1)],
        [-1, -1],
        f"The call failed (SyntaxError: invalid syntax). Run exactly {CALL}",
    ),
    "wrong_value": (
        [tool("<python>print(12 + 43 * 5)</python>", "Output:\n227"), answer(227)],
        [-1, -1],
        f"The code changed the numbers. Copy them exactly: {CALL}",
    ),
    "copy_slip": (
        [tool(CALL, "Output:\n182"), answer(128)],
        [1, -1],
        "The tool printed 182. Answer exactly \\boxed{182}",
    ),
    "timeout": (
        [tool(CALL, "Timed out: the code ran too long")],
        [-1],
        f"The call timed out. Run exactly {CALL}",
    ),
    "no_output": (
        [tool("<python>x = 12 + 34 * 5</python>", "No output. Use print(...) to see a value.")],
        [-1],
        f"The call printed nothing. Print the value: {CALL}",
    ),
    "malformed": ([{"kind": "malformed", "action": "hmm", "observation": "Format error"}], [-1], None),
    "no_answer": ([tool(CALL, "Output:\n182")], [1], "The tool printed 182. Answer \\boxed{182}"),
}


def test_every_failure_kind_has_a_case():
    assert set(CASES) - {"solved"} == set(FAILURES)


def test_problem_expression():
    assert problem_expression(Q) == "12 + 34 * 5"
    assert problem_expression("Compute 4821 + 9377 - 1504 + 37 * 212.") == "4821 + 9377 - 1504 + 37 * 212"
    assert problem_expression("no numbers") == ""


@pytest.mark.parametrize("name", CASES)
def test_votes_and_bridge_thoughts(name):
    steps, votes, hint = CASES[name]
    assert step_votes(steps, "182") == votes
    if name == "solved":
        return
    assert diagnose(steps, "182")[0] == name
    if hint is not None:
        assert bridge_thought(Q, steps, "182") == hint
    else:
        assert CALL in bridge_thought(Q, steps, "182")


def batch(names: list[str], outcomes: list[float], with_truth: bool = True) -> DataProto:
    B = len(names)

    def col(values) -> np.ndarray:
        c = np.empty(B, dtype=object)
        c[:] = values
        return c

    nt = {
        "steps": col([json.dumps(CASES[n][0]) for n in names]),
        "extra_info": col([{"question": Q}] * B),
    }
    if with_truth:
        nt["reward_model"] = col([{"ground_truth": "182", "style": "rule"}] * B)
    scores = torch.zeros(B, 4)
    scores[:, -1] = torch.tensor(outcomes)
    return DataProto.from_dict({"token_level_scores": scores}, non_tensors=nt)


def test_worker_scores_steps_and_hints_failures_only():
    w = PRMWorker(PRMConfig(scorer="rule", votes=3, max_steps=3))
    w.init_model()
    names = ["solved", "guess", "copy_slip", "wrong_value"]
    out = w.score_steps(batch(names, [1.0, 0.0, 0.0, 0.0]))
    assert out.batch["prm_step_scores"].tolist() == [[1, 1, 0], [-1, 0, 0], [1, -1, 0], [-1, -1, 0]]
    assert out.batch["prm_step_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 1, 0]]
    assert list(out.non_tensor_batch["hint"]) == [
        "",
        CASES["guess"][2],
        CASES["copy_slip"][2],
        CASES["wrong_value"][2],
    ]
    m = out.meta_info["metrics"]
    assert m["prm/hint_frac"] == 0.75 and m["prm/unparseable_frac"] == 0.0
    assert m["prm/score/mean"] == pytest.approx((1 + 1 - 1 + 1 - 1 - 1 - 1) / 7)


def test_hint_on_always_gives_solved_rows_no_intervention():
    w = PRMWorker(PRMConfig(scorer="rule", hint_on="always", max_steps=3))
    out = w.score_steps(batch(["solved", "guess"], [1.0, 0.0]))
    assert list(out.non_tensor_batch["prm_hint_raw"])[0] == "NO_INTERVENTION"
    assert list(out.non_tensor_batch["hint"]) == ["", CASES["guess"][2]]


def test_missing_ground_truth_is_named():
    w = PRMWorker(PRMConfig(scorer="rule", max_steps=3))
    with pytest.raises(ValueError, match="row 0 has no reward_model.ground_truth"):
        w.score_steps(batch(["guess"], [0.0], with_truth=False))
