"""RLM callbacks (``RLM(callbacks=Callbacks(on_iteration=..., on_subcall=..., on_final=...))``, or an object with
those methods) and verbose console output, through ``RLM()`` with a scripted policy (the tiny model's tokenizer, fixed turns) and a real sandbox."""

from __future__ import annotations

import io
import warnings

import pytest
from rich.console import Console
from rlm_testlib import block

from workers.agents.scripted import ReplayScript, scripted_generate
from workers.rlm.callbacks import Callbacks, FinalEvent, IterationEvent, SubcallEvent
from workers.rlm.console import VerbosePrinter
from workers.rlm.inference import RLM
from workers.sandbox import ReplSandbox, SandboxConfig

pytestmark = pytest.mark.timeout(120)


# The root asks the sub-LM, then a child agent (which answers at once), then finishes with FINAL_VAR.
SCRIPT = {
    "Q-root": [
        "Ask the sub-LM first.\n" + block("s = llm_query('sum: ' + context[:3])\nprint(s)"),
        block("a = rlm_query('child-Q', context[3:])\nprint(a)"),
        "FINAL_VAR(a)",
    ],
    "child-Q": [block("FINAL(context.upper())")],
}


def sub_reply(prompt_text: str) -> str:
    return "SUB-ANSWER" if "sum: abc" in prompt_text else "?"


@pytest.fixture(scope="module")
def sandbox():
    with ReplSandbox(SandboxConfig(timeout_s=5, max_output_chars=5000)) as sb:
        yield sb


def make_rlm(tok, sandbox, **kwargs) -> RLM:
    gen = scripted_generate(tok, ReplayScript(SCRIPT, sub=sub_reply))
    return RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_depth=1, max_iterations=4, **kwargs)


def test_callbacks_fire_in_order_with_payloads_for_root_and_child(tok, sandbox):
    events: list = []
    listeners = Callbacks([events.append], [events.append], [events.append])
    with make_rlm(tok, sandbox, callbacks=listeners) as rlm:
        res = rlm.completion("Q-root", context="abcdefg")
    assert (res.status, res.answer) == ("finished", "DEFG")
    root, child = res.trajectories
    order = [
        (type(e).__name__, e.trajectory_id, e.turn if not isinstance(e, FinalEvent) else None) for e in events
    ]
    assert order == [
        ("SubcallEvent", root.id, 0),  # llm_query, during the root's first turn
        ("IterationEvent", root.id, 0),
        ("IterationEvent", child.id, 0),  # the child runs inside the root's second turn ...
        ("FinalEvent", child.id, None),
        ("SubcallEvent", root.id, 1),  # ... and its answer comes back to the root's code
        ("IterationEvent", root.id, 1),
        ("IterationEvent", root.id, 2),
        ("FinalEvent", root.id, None),
    ]
    sub_llm, it0, child_it, child_final, sub_rlm, it1, it2, root_final = events
    # an iteration: the response, its code results, the turn's usage; a final answer only on the last turn
    assert isinstance(it0, IterationEvent) and it0.depth == 0 and it0.max_turns == 4
    assert it0.response == root.turns[0].response_text and "Ask the sub-LM" in it0.response
    assert it0.code_results[0].stdout == "SUB-ANSWER\n" and it0.final_answer is None
    assert it0.usage == root.turns[0].usage and it0.usage["completion_tokens"] > 0
    assert (child_it.depth, child_it.final_answer) == (1, "DEFG") and child_it.code_results
    assert it2.final_answer == "DEFG" and it2.code_results == []
    # sub-calls: the same records the trajectory keeps
    assert isinstance(sub_llm, SubcallEvent) and sub_llm.kind == "llm_query" and sub_llm.depth == 0
    assert sub_llm.record is root.metadata["subcalls"][0] and sub_llm.record["response"] == "SUB-ANSWER"
    assert sub_rlm.kind == "rlm_query" and sub_rlm.record["child_id"] == child.id
    assert sub_rlm.record["response"] == "DEFG"
    # trajectory ends: status, answer, usage of the trajectory and everything below it
    assert (child_final.depth, child_final.status, child_final.answer, child_final.turns) == (
        1,
        "finished",
        "DEFG",
        1,
    )
    assert child_final.usage.total.calls == 1  # the child's one turn
    assert (root_final.status, root_final.answer, root_final.turns, root_final.error) == (
        "finished",
        "DEFG",
        3,
        None,
    )
    assert root_final.usage.total.calls == 5  # 3 root turns + the llm_query + the child's turn
    assert root_final.usage.to_dict() == res.usage.to_dict() and root_final.elapsed_s > 0


def test_a_raising_callback_is_reported_once_and_the_run_goes_on(tok, sandbox):
    finals: list = []

    def broken(event):
        raise ValueError("listener bug")

    listeners = Callbacks(on_iteration=[broken], on_subcall=[broken], on_final=[finals.append])
    with make_rlm(tok, sandbox, callbacks=listeners) as rlm:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = rlm.completion("Q-root", context="abcdefg")
    assert (res.status, res.answer) == ("finished", "DEFG")
    assert [f.trajectory_id for f in finals] == [res.trajectories[1].id, res.root.id]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    # broken raised 4 times as on_iteration and twice as on_subcall: one warning for each role
    assert len(messages) == 2 and all("ValueError: listener bug" in m for m in messages)
    assert any("on_iteration" in m for m in messages) and any("on_subcall" in m for m in messages)


LONG_SCRIPT = {
    "Q-verbose": [
        block("print('Z' * 3000)\nh = llm_query('sum: abc')"),
        block("c = rlm_query('child-Q', 'xyz')\nprint(c)"),
        "FINAL_VAR(c)",
    ],
    "child-Q": [block("FINAL(context.upper())")],
}


def test_verbose_prints_code_truncated_output_subcalls_and_the_answer(tok, sandbox, capsys):
    gen = scripted_generate(tok, ReplayScript(LONG_SCRIPT, sub=sub_reply))
    with RLM(engine=gen, tokenizer=tok, sandbox=sandbox, max_depth=1, max_iterations=4, verbose=True) as rlm:
        res = rlm.completion("Q-verbose")
    out = capsys.readouterr().out
    assert res.answer == "XYZ"
    assert "print('Z' * 3000)" in out and "rlm_query('child-Q', 'xyz')" in out  # the code blocks
    assert "characters truncated" in out and "Z" * 3000 not in out  # the long output, cut
    assert "↳ llm_query: 'sum: abc' → 'SUB-ANSWER'" in out
    assert f"↳ rlm_query (child {res.root.id}/0)" in out
    assert f"    ← {res.root.id}/0 finished: XYZ" in out  # the child's end, indented one level
    assert "Final answer · finished" in out and "XYZ" in out
    total = res.usage.total
    assert (
        f"usage: {total.prompt_tokens} prompt + {total.completion_tokens} completion tokens in 5 model calls"
        in out
    )


def test_verbose_printer_writes_to_a_given_console(tok, sandbox):
    """The printer is ordinary callbacks: any rich Console (here one writing to a string) receives the run."""
    buf = io.StringIO()
    printer = VerbosePrinter(Console(file=buf, width=120), max_chars=100)
    with make_rlm(tok, sandbox, callbacks=printer) as rlm:  # its on_iteration / on_subcall / on_final
        res = rlm.completion("Q-root", context="abcdefg")
    text = buf.getvalue()
    assert res.answer == "DEFG"
    assert "s = llm_query('sum: ' + context[:3])" in text and "SUB-ANSWER" in text
    assert "Ask the sub-LM first." in text  # the prose, and the code once (in its panel, not in the prose)
    assert text.count("s = llm_query('sum: ' + context[:3])") == 1
    # the root's first turn: its header, then its llm_query (made while its code ran), then the code panel
    assert text.index(f"{res.root.id} · turn 1") < text.index("↳ llm_query") < text.index("s = llm_query")
    assert f"depth 1 · {res.root.id}/0 · turn 1/4" in text and "FINAL: DEFG" in text
    assert "Final answer · finished" in text


def test_custom_tool_calls_reach_on_subcall_and_the_console(tok, sandbox):
    events: list = []
    buf = io.StringIO()
    printer = VerbosePrinter(Console(file=buf, width=120))
    script = {"Q-tool": [block("r = lookup('k1')\nprint(r)"), "FINAL_VAR(r)"]}
    gen = scripted_generate(tok, ReplayScript(script))
    with RLM(
        engine=gen,
        tokenizer=tok,
        sandbox=sandbox,
        max_iterations=3,
        custom_tools={"lookup": lambda key: f"value-of-{key}"},
        callbacks=Callbacks(on_subcall=[events.append, printer.on_subcall]),
    ) as rlm:
        res = rlm.completion("Q-tool")
    assert res.answer == "value-of-k1"
    assert [(e.kind, e.record["name"], e.turn) for e in events] == [("tool", "lookup", 0)]
    assert "↳ tool lookup:" in buf.getvalue() and "value-of-k1" in buf.getvalue()
