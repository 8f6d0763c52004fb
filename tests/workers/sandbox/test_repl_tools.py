"""The REPL's custom tools, JSON contexts and setup code, on real sandboxed REPLs: tools run on the host
(never in the REPL process) through the sub-call channel with JSON arguments and results, per-tool
timeouts, failures raised as ToolError naming the tool, tool names checked and rebound after every block;
dict / nested / several contexts restored after in-place changes; setup code before the first block."""

import asyncio
import os
import threading
import time

import pytest

from workers.sandbox import ReplSandbox, SandboxConfig, SandboxError, Tool

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def sandbox():
    with ReplSandbox(SandboxConfig(timeout_s=5, max_output_chars=2000, start_timeout_s=5)) as sb:
        yield sb


def test_tools_run_on_the_host_with_json_in_and_out(sandbox):
    seen = []

    def where(tag: str, n: int = 1) -> dict:
        """Report the process this runs in."""
        seen.append((tag, n, threading.current_thread() is not threading.main_thread()))
        return {"pid": os.getpid(), "tag": tag, "n": [n, n * 2], "none": None}

    async def twice(xs: list) -> list:
        """Double every number (a coroutine tool)."""
        await asyncio.sleep(0)
        return [2 * x for x in xs]

    with sandbox.create(tools={"where": where, "twice": twice}) as r:
        res = r.execute(
            "import os\nout = where('a', n=3)\nprint(out['pid'] != os.getpid(), out['tag'], out['n'], out['none'])\n"
            "print(twice((1, 2.5)), where.__name__)\nprint(where.__doc__)"
        )
    assert res.error is None, res.error
    lines = res.stdout.splitlines()
    assert lines[0] == "True a [3, 6] None"  # the host's pid: not the REPL process
    assert lines[1] == "[2, 5.0] where"  # a tuple argument arrives as a JSON list
    assert lines[2] == "where(tag: str, n: int = 1)" and lines[4] == "Report the process this runs in."
    assert seen == [("a", 3, True)]  # a sync tool runs in a worker thread
    assert [c["name"] for c in res.tool_calls] == ["where", "twice"]
    assert res.tool_calls[0]["args"] == '{"args": ["a"], "kwargs": {"n": 3}}'
    assert res.tool_calls[1]["result"] == "[2, 5.0]" and res.tool_calls[1]["elapsed_s"] >= 0


def test_tool_failures_raise_tool_error_naming_the_tool(sandbox):
    def boom():
        raise KeyError("missing")

    def a_set():
        return {1, 2}

    def slow():
        time.sleep(2)
        return 1

    def huge():
        return "x" * (9 << 20)

    tools = {"boom": boom, "a_set": a_set, "slow": Tool(slow, timeout_s=0.3), "huge": huge}
    code = (
        "for f in (boom, a_set, slow, huge):\n"
        "    try:\n        f()\n    except Exception as e:\n        print(type(e).__name__, '|', e)\n"
        "try:\n    boom({1})\nexcept Exception as e:\n    print(type(e).__name__, '|', e)\n"
    )
    with sandbox.create(tools=tools) as r:
        t0 = time.perf_counter()
        res = r.execute(code, timeout_s=1.0)  # blocked in a tool does not count against the block
        elapsed = time.perf_counter() - t0
        again = r.execute("print(boom.__name__)")
    assert res.error is None and not res.timed_out, res.error
    assert res.stdout.splitlines() == [
        "ToolError | tool 'boom' failed: KeyError: 'missing'",
        "ToolError | tool 'a_set' returned a result that is not JSON-able (Object of type set is not JSON serializable)",
        "ToolError | tool 'slow' timed out after 0.3 s",
        "ToolError | tool 'huge' returned 9,437,186 characters of JSON (limit 8,388,608)",
        "TypeError | tool 'boom': arguments must be JSON-able (Object of type set is not JSON serializable)",
    ]
    assert elapsed < 2  # the timed-out tool's thread was not waited for
    assert [c["error"][:12] for c in res.tool_calls] == [
        "tool 'boom' ",
        "tool 'a_set'",
        "tool 'slow' ",
        "tool 'huge' ",
    ]
    assert again.stdout == "boom\n"


def test_tool_names_are_checked_and_rebound_after_every_block(sandbox):
    def one():
        return 1

    for bad in ("llm_query", "FINAL", "context", "context_3", "_private", "not-a-name", "class"):
        with pytest.raises(ValueError, match="tool name"):
            sandbox.create(tools={bad: one})
    with sandbox.create(tools={"one": one}, setup_vars={"one": "shadow?"}) as r:
        first = r.execute("one = 'rebound'\nprint(one)\nv = SHOW_VARS()")
        second = r.execute("print(one(), v)\ndel one")
        third = r.execute("print(one())")
    assert first.stdout == "rebound\n"
    assert second.stdout == "1 No user variables yet.\n"
    assert third.stdout == "1\n"
    assert all(name != "one" for name, _ in third.variables)


def test_tools_do_not_exist_in_the_repl_process_and_are_unknown_elsewhere(sandbox):
    def secret():
        return "host only"

    with sandbox.create(tools={"secret": secret}) as r:
        res = r.execute("print(secret.__code__.co_freevars)\nprint(secret())")
    assert res.stdout == "('call', 'name')\nhost only\n"  # the REPL's function only forwards the call
    with sandbox.create() as r:  # another REPL has no such tool
        assert "NameError" in r.execute("secret()").error


def test_dict_and_nested_contexts_are_json_values_restored_after_changes(sandbox):
    ctx = {
        "title": "report",
        "sections": [{"name": "a", "lines": ["x", "y"]}, {"name": "b", "lines": []}],
        "n": 2,
    }
    with sandbox.create(context=ctx) as r:
        res = r.execute(
            "print(type(context).__name__, sorted(context), context['sections'][0]['lines'][1], context['n'] + 1)\n"
            "context['sections'][0]['lines'].append('MUTATED')\ncontext['new'] = 1\n"
            "print(len(context['sections'][0]['lines']))"
        )
        after = r.execute(
            "print(context['sections'][0]['lines'], 'new' in context, context == ORIG)".replace(
                "ORIG", repr(ctx)
            )
        )
        r.execute("context = 'gone'")
        rebound = r.execute("print(type(context).__name__)")
    assert res.stdout == "dict ['n', 'sections', 'title'] y 3\n3\n"
    assert after.stdout == "['x', 'y'] False True\n"
    assert rebound.stdout == "dict\n"
    with pytest.raises(ValueError, match="context must be JSON-able"):
        sandbox.create(context={"a": {1, 2}})


def test_several_contexts_are_context_0_1_with_context_the_first(sandbox):
    with sandbox.create(contexts=["first doc", ["d1", "d2"], {"k": [1]}]) as r:
        res = r.execute(
            "print(context is context_0, context_0, context_1, context_2)\n"
            "context_1.clear()\ncontext_2['k'].append(2)\ncontext_0 = 'x'"
        )
        after = r.execute("print(context_0, context_1, context_2, context is context_0)\nprint(SHOW_VARS())")
    assert res.stdout == "True first doc ['d1', 'd2'] {'k': [1]}\n"
    assert after.stdout == "first doc ['d1', 'd2'] {'k': [1]} True\nNo user variables yet.\n"
    with pytest.raises(ValueError, match="not both"):
        sandbox.create(context="a", contexts=["b"])
    with pytest.raises(ValueError, match=r"contexts\[1\] must be JSON-able"):
        sandbox.create(contexts=["a", object()])


def test_setup_code_runs_before_the_first_block_and_after_a_restart(sandbox):
    setup = "import re\nWORDS = re.findall(r'\\w+', context)\ndef count(w):\n    return WORDS.count(w)\nprint('hidden')"
    with sandbox.create(context="a b a c", setup_code=setup) as r:
        assert r.setup_variables == [("WORDS", "list"), ("count", "function")]
        res = r.execute("print(count('a'), len(WORDS))")
        killed = r.execute("import time\nWORDS.append('z')\ntime.sleep(30)", timeout_s=0.5)
        res2 = r.execute("print(count('a'), len(WORDS))")
    assert res.stdout == "2 4\n"  # setup output is not shown
    assert killed.timed_out and killed.restarted
    assert res2.stdout == "2 4\n"  # the restarted REPL ran the setup code again


def test_setup_code_failures_name_setup_code(sandbox):
    with pytest.raises(SandboxError, match=r"setup_code failed:(.|\n)*ZeroDivisionError"):
        sandbox.create(setup_code="x = 1\n1 / 0")
    with pytest.raises(SandboxError, match=r"setup_code did not finish within start_timeout_s \(5 s\)"):
        sandbox.create(setup_code="while True:\n    pass")
    with sandbox.create() as r:  # the sandbox is fine afterwards
        assert r.execute("print(1)").stdout == "1\n"


def test_rlms_style_entries_descriptions_and_json_constants(sandbox):
    def f(x):
        return x + 1

    tools = {"inc": {"tool": f, "description": "Add one."}, "LIMITS": {"max": [1, 2]}, "API": "v2"}
    with sandbox.create(tools=tools) as r:
        res = r.execute(
            "print(inc(1), inc.__doc__.splitlines()[-1], LIMITS['max'], API)\nLIMITS['max'].append(3)"
        )
        after = r.execute("print(LIMITS)\nAPI = 'changed'\nprint(SHOW_VARS())")
        again = r.execute("print(API)")
    assert res.stdout == "2 Add one. [1, 2] v2\n"
    assert after.stdout == "{'max': [1, 2]}\nNo user variables yet.\n"  # restored like a context, not listed
    assert again.stdout == "v2\n"
    with pytest.raises(TypeError, match="tool 'bad' must be a callable, a Tool or a JSON value"):
        sandbox.create(tools={"bad": {1, 2}})
