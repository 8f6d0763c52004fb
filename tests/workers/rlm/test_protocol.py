"""RLM protocol: code-block and FINAL parsing rules (with near-misses), observations, trajectory records."""

import json

import pytest

from workers.agents.trajectory import (
    CodeResult,
    FinalCall,
    Trajectory,
    TrajectoryTurn,
    dump_jsonl,
    load_jsonl,
)
from workers.rlm.prompts import build_messages, describe_context
from workers.rlm.protocol import TRUNCATION_MARKER, code_calls_final, format_observation, parse_turn, truncate

F = "```"


def block(code: str, lang: str = "repl") -> str:
    return f"{F}{lang}\n{code}\n{F}"


# ---------------------------------------------------------------------------------------------- blocks


def test_blocks_in_order_and_only_repl_runs():
    text = "\n".join(
        [
            "First I look.",
            block("x = 1\nprint(x)"),
            "Then an example that must not run:",
            block("import os\nos.remove('/')", "python"),
            block("y = x + 1"),
            block("echo hi", "bash"),
            "  " + F + "REPL extra info",
            "  z = 3",
            "  " + F,
        ]
    )
    t = parse_turn(text)
    assert t.code_blocks == ["x = 1\nprint(x)", "y = x + 1", "z = 3"]  # indented fence: dedented
    assert t.final is None and not t.code_calls_final and t.unterminated is None
    assert "First I look." in t.reasoning and "os.remove" in t.reasoning and "x = 1" not in t.reasoning
    # opting in to python fences
    assert parse_turn(text, languages=("repl", "python")).code_blocks[1] == "import os\nos.remove('/')"


def test_block_edge_cases():
    # a fence must start its line; one-line ```repl x``` is not a block; empty blocks are dropped
    assert parse_turn(f"see {F}repl\nx = 1\n{F}").code_blocks == []
    assert parse_turn(f"{F}repl x = 1{F}").code_blocks == []
    assert parse_turn(block("   \n")).code_blocks == []
    # a longer closing fence closes; a shorter one does not
    t = parse_turn(f"````repl\ns = '''\n{F}\n'''\n````")
    assert t.code_blocks == [f"s = '''\n{F}\n'''"]
    # relative indentation inside the block is kept
    assert parse_turn(block("for i in range(2):\n    print(i)")).code_blocks == [
        "for i in range(2):\n    print(i)"
    ]


def test_unterminated_block_is_not_run():
    t = parse_turn(block("a = 1") + "\nnow the rest:\n" + F + "repl\nfor i in range(10):\n    FINAL(")
    assert t.code_blocks == ["a = 1"]
    assert t.unterminated == "for i in range(10):\n    FINAL("
    assert not t.code_calls_final
    # FINAL lines after an unclosed fence are inside it: they do not count
    t = parse_turn(F + "repl\nx = 2\nFINAL(x)\n")
    assert t.final is None and t.code_blocks == [] and t.unterminated == "x = 2\nFINAL(x)"
    # an unclosed non-repl fence is just text
    assert parse_turn(F + "python\nprint(1)\n").unterminated is None


def test_think_regions_are_reasoning():
    t = parse_turn("<think>draft:\n" + block("x = 1") + "\nFINAL(3)\n</think>\n" + block("y = 2"))
    assert t.code_blocks == ["y = 2"] and t.final is None and "draft:" in t.reasoning
    t = parse_turn("<think>still thinking\nFINAL(3)\n" + block("x = 1"))  # truncated inside think
    assert t.code_blocks == [] and t.final is None


# ----------------------------------------------------------------------------------------------- FINAL


@pytest.mark.parametrize(
    ("text", "kind", "answer", "var"),
    [
        ("FINAL(42)", "FINAL", "42", None),
        ("  FINAL(1234567)  ", "FINAL", "1234567", None),
        ("Done.\nFINAL(The answer is 7)\n", "FINAL", "The answer is 7", None),
        ('FINAL("a ) b (c")', "FINAL", "a ) b (c", None),  # quoted: unquoted, parens inside ignored
        ("FINAL(f(x) + (y * 2))", "FINAL", "f(x) + (y * 2)", None),  # nested parentheses
        ("FINAL(it's 42)", "FINAL", "it's 42", None),  # an apostrophe: quote-blind count on the line
        ('FINAL("x)', "FINAL", '"x', None),  # likewise an unpaired quote: the parentheses balance
        ("FINAL(\n(1, 2)\n(3, 4)\n)", "FINAL", "(1, 2)\n(3, 4)", None),  # spans lines
        ('FINAL("""two\nlines ) here""")', "FINAL", "two\nlines ) here", None),
        ("FINAL([(1, 2), (3, 4)])", "FINAL", "[(1, 2), (3, 4)]", None),  # non-str literal: raw text
        ("FINAL_VAR(answer)", "FINAL_VAR", None, "answer"),
        ('FINAL_VAR( "answer" )', "FINAL_VAR", None, "answer"),
        ("FINAL_VAR('_x1')", "FINAL_VAR", None, "_x1"),
    ],
)
def test_final_on_its_own_line(text, kind, answer, var):
    final = parse_turn(text).final
    assert final is not None
    assert (final.kind, final.answer, final.var_name) == (kind, answer, var)


@pytest.mark.parametrize(
    "text",
    [
        "I will call FINAL(x) later",
        "Then `FINAL(x)` finishes the run.",
        "`FINAL(x)`",
        "FINAL(x) is what I'd write",
        "FINAL(x).",  # trailing text after the call
        "**FINAL(x)**",
        "> FINAL(x)",
        "- FINAL(x)",
        "myFINAL(x)",
        "FINAL (x)",  # a space before the parenthesis is not a call
        "final(x)",
        block("FINAL(x)", "python"),
        block("FINAL(x)", ""),
        block("FINAL_VAR(answer)", "text"),
        "FINAL_VAR(not an identifier)",
        "FINAL_VAR(1abc)",
        "FINAL_VAR(class)",  # a keyword
        "FINAL_VAR(a.b)",
        "FINAL_VAR()",
        "FINAL()",
        "FINAL(   )",
        "FINAL(x",  # unbalanced
        "FINAL((x)",
        "FINAL(x))",
    ],
)
def test_final_near_misses(text):
    t = parse_turn(text)
    assert t.final is None, text
    assert not t.code_calls_final


def test_unbalanced_final_does_not_swallow_the_next_line():
    t = parse_turn('FINAL("a (b) c"\nFINAL(7)')
    assert t.final == FinalCall("FINAL", "7", answer="7")


def test_first_valid_final_line_wins_and_code_runs_first():
    t = parse_turn("FINAL_VAR(bad name)\n" + block("answer = 6 * 7") + "\nFINAL_VAR(answer)\nFINAL(99)")
    assert t.code_blocks == ["answer = 6 * 7"]
    assert t.final.kind == "FINAL_VAR" and t.final.var_name == "answer"
    assert t.may_finish


def test_final_inside_code_is_noted_not_parsed():
    t = parse_turn(block("result = 3\nFINAL(result)"))
    assert t.final is None and t.code_calls_final and t.may_finish
    assert parse_turn(block('FINAL_VAR("result")')).code_calls_final
    assert code_calls_final("if done:\n    FINAL(x)")
    assert not code_calls_final("print('FINAL(x)')")  # a string, not a call
    assert not code_calls_final("# FINAL(x)")
    assert not code_calls_final("obj.FINAL(x)")  # not the bare name
    assert not code_calls_final("FINAL(")  # a syntax error never runs
    assert not parse_turn("no code here").may_finish


# ----------------------------------------------------------------------------------------- observation


def test_truncate_keeps_head_and_tail_with_a_marker():
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    assert truncate(text, 1000) == text
    out = truncate(text, 100)
    marker = TRUNCATION_MARKER.format(n=900)
    assert marker in out
    head, tail = out.split(marker)
    assert head == text[:75] and tail == text[-25:] and len(head) + len(tail) == 100
    with pytest.raises(ValueError):
        truncate(text, -1)


def test_format_observation_blocks_errors_variables_and_notices():
    results = [
        CodeResult(code="print('x' * 5000)", stdout="x" * 5000, variables={"text": "str, 5000 chars"}),
        {"code": "1/0", "stdout": "", "error": "ZeroDivisionError: division by zero", "elapsed_s": 0.5},
        CodeResult(code="pass"),
        CodeResult(code="while True: pass", error="killed after 10 s", timed_out=True),
    ]
    obs = format_observation(results, max_chars=300, iteration=3, max_iterations=10, budget={"sub-calls": 5})
    parts = obs.split("\n\n")
    assert parts[0].startswith("[REPL block 1/4]")
    assert TRUNCATION_MARKER.format(n=4700).strip() in parts[0]
    assert "[variables] text: str, 5000 chars" in parts[0]
    assert len(parts[0]) < 300 + 200
    assert parts[1].startswith("[REPL block 2/4, 0.50s]") and "[error] ZeroDivisionError" in parts[1]
    assert parts[2] == "[REPL block 3/4]\n(no output)"
    assert "timed out" in parts[3]
    assert parts[-1] == "[Turn 3 of 10 done; 7 left. Budget left: sub-calls 5.]"
    assert "[variables]" not in format_observation(results, 300, show_variables=False)
    # the error is kept even when stdout is huge; long parts share what is left
    big = format_observation([CodeResult(stdout="y" * 10_000, error="Traceback: boom")], max_chars=200)
    assert "Traceback: boom" in big and len(big) < 400
    both = format_observation(
        [CodeResult(stdout="o" * 1000, stderr="e" * 1000, error="E" * 10)], max_chars=210
    )
    assert both.count("[... 900 characters truncated ...]") == 2 and "E" * 10 in both  # 100 + 100 + 10
    # the sandbox's result dicts: variables as [name, type] pairs, stderr
    sandbox = {"stdout": "", "stderr": "warning: x", "error": None, "variables": [["a", "int"], ["s", "str"]]}
    obs = format_observation([sandbox])
    assert obs == "[REPL block 1/1]\n[stderr] warning: x\n[variables] a: int, s: str"


def test_format_observation_turn_notices_and_last_turn():
    t = parse_turn("I think the answer is 4.")
    assert "No ```repl block and no FINAL" in format_observation([], turn=t)
    t = parse_turn(F + "repl\nx = (")
    assert "was not closed" in format_observation([], turn=t)
    assert "Next turn is the last" in format_observation([], iteration=9, max_iterations=10)
    assert format_observation([]) == "(no code was run)"


# ---------------------------------------------------------------------------------------- trajectories


def _trajectory() -> Trajectory:
    turn0 = TrajectoryTurn(
        index=0,
        prompt_text="<system>...<user>q",
        response_text=block("print(len(context))"),
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[10, 11],
        response_logprobs=[-0.5, -1.25],
        code_results=[CodeResult(code="print(len(context))", stdout="8000\n", elapsed_s=0.01)],
        child_ids=["t1"],
        timings={"gen_s": 0.2, "exec_s": 0.01},
    )
    turn1 = TrajectoryTurn(
        index=1,
        prompt_text="[REPL block 1/1]\n8000",
        response_text="FINAL(8000)",
        prompt_token_ids=[4, 5],
        response_token_ids=[12, 13, 14],
        response_logprobs=[-0.1, -0.2, -float("inf")],
        final=FinalCall("FINAL", "8000", answer="8000"),
    )
    return Trajectory(
        id="t0",
        query="How long is the context?",
        root_uid="uid-7",
        turns=[turn0, turn1],
        final_answer="8000",
        status="finished",
        children=["t1"],
        context_info=describe_context("x" * 8000).to_dict(),
        metadata={"data_source": "hyflow/sniah"},
        timings={"wall_s": 0.3},
    )


def test_trajectory_round_trip_and_jsonl(tmp_path):
    root = _trajectory()
    child = Trajectory(id="t1", query="sub", root_uid="uid-7", depth=1, parent_id="t0", status="budget")
    d = root.to_dict()
    json.dumps(d)  # plain JSON types
    again = Trajectory.from_dict(json.loads(json.dumps(d)))
    assert again == root
    assert isinstance(again.turns[0].code_results[0], CodeResult) and again.turns[1].final.answer == "8000"
    assert Trajectory.from_json(root.to_json()) == root
    path = dump_jsonl([root, child], tmp_path / "traj" / "run.jsonl")
    dump_jsonl([child], path, append=True)
    loaded = load_jsonl(path)
    assert loaded == [root, child, child]
    assert loaded[1].parent_id == "t0" and loaded[1].depth == 1 and loaded[1].root_uid == "uid-7"
    with pytest.raises(ValueError, match="status"):
        Trajectory(id="x", query="q", status="done")


def test_token_sequence_masks_prompts():
    ids, mask, logprobs = _trajectory().token_sequence()
    assert ids == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]
    assert mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert logprobs[:5] == [0.0, 0.0, 0.0, -0.5, -1.25] and logprobs[-1] == -float("inf")


# --------------------------------------------------------------------------------------------- prompts


def test_prompts_depth_aware_and_context_free():
    context = ["chunk one", "chunk two!"]
    root = build_messages("Find X.", context, depth=0, max_depth=1, max_iterations=8)
    assert [m["role"] for m in root] == ["system", "user"]
    sys_root = root[0]["content"]
    assert "list[str] of 19 characters in 2 items" in sys_root
    for name in (
        "llm_query",
        "llm_query_batched",
        "rlm_query",
        "rlm_query_batched",
        "SHOW_VARS",
        "FINAL_VAR",
    ):
        assert name in sys_root
    assert "helper agent like you" in sys_root and "at most 8 turns" in sys_root
    assert "chunk one" not in sys_root and "chunk one" not in root[1]["content"]
    assert root[1]["content"].startswith("Find X.")
    child = build_messages("Sub-task.", "abc", depth=1, max_depth=2)[0]["content"]
    assert "depth 1" in child and "helper agent like you" in child
    capped = build_messages("Sub-task.", None, depth=2, max_depth=2)[0]["content"]
    assert "no further helper agents" in capped and "`context` is None" in capped
    info = describe_context("y" * 1234).to_dict()
    assert (
        build_messages("q", context_info=info)[0]["content"] == build_messages("q", "y" * 1234)[0]["content"]
    )


def test_compact_prompt_keeps_the_protocol_in_a_fraction_of_the_length():
    from workers.rlm.prompts import PromptConfig

    context = ["chunk one", "chunk two!"]
    full = build_messages("Find X.", context, max_depth=1, max_iterations=4)[0]["content"]
    cfg = PromptConfig(style="compact", max_output_chars=500, tools={"grep(pattern)": "search lines"})
    compact = build_messages("Find X.", context, max_depth=1, max_iterations=4, config=cfg)[0]["content"]
    assert len(compact) * 4 < len(full)
    for name in (
        "```repl",
        "llm_query(",
        "rlm_query(",
        "FINAL(",
        "FINAL_VAR(",
        "grep(pattern)",
        "At most 4 turns",
    ):
        assert name in compact, name
    assert "list[str] of 19 characters in 2 items" in compact and "500 characters" in compact
    capped = build_messages("q", "abc", depth=1, max_depth=1, config=cfg)[0]["content"]
    assert "rlm_query(" not in capped  # at the depth cap no helper agents are offered
    with pytest.raises(ValueError, match="style"):
        PromptConfig(style="short")
