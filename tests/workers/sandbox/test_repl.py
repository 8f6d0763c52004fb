"""The REPL sandbox's protocol: persistence, context, output capture, variables, reserved names,
FINAL / FINAL_VAR, errors, sub-calls to a host handler, and the sync / async APIs.

Every test runs real subprocess REPLs (forked from the sandbox's zygote), in whatever isolation this
machine gives (bubblewrap where installed); the hostile inputs are in test_hostile.py.
"""

import asyncio
import gc
import hashlib
import time

import pytest

from workers.sandbox import RESERVED_NAMES, ReplSandbox, SandboxConfig, SandboxError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def sandbox():
    with ReplSandbox(SandboxConfig(timeout_s=5, max_output_chars=1000)) as sb:
        yield sb


@pytest.fixture
def repl(sandbox):
    r = sandbox.create(context="The quick brown fox", setup_vars={"n_items": 3})
    yield r
    r.close()


def test_state_persists_across_blocks(repl):
    assert repl.execute("x = 20\ndef f(y):\n    return x + y").ok
    res = repl.execute("x += 1\nprint(f(1), n_items)")
    assert res.error is None
    assert res.stdout == "22 3\n"
    assert res.elapsed_s > 0
    assert repl.execute("import os\nopen('notes.txt', 'w').write('kept')").ok
    res = repl.execute(
        "print(open('notes.txt').read(), os.getcwd() == SCRATCH)".replace("SCRATCH", repr(repl.scratch_dir))
    )
    assert res.stdout == "kept True\n"


def test_context_large_str_list_and_unicode(sandbox):
    big = "".join(chr(97 + (i * 7) % 26) for i in range(1_000_000))
    t0 = time.perf_counter()
    with sandbox.create(context=big) as r:
        created = time.perf_counter() - t0
        res = r.execute("import hashlib\nprint(len(context), hashlib.sha256(context.encode()).hexdigest())")
    assert res.stdout.split() == ["1000000", hashlib.sha256(big.encode()).hexdigest()]
    assert created < 5  # passed once over the socket at creation, not re-sent per block

    with sandbox.create(context=["doc one", "doc two", "naïve ☃ 𝔘"]) as r:
        res = r.execute("print(type(context).__name__, len(context), context[1])\nprint(context[2])")
    assert res.stdout == "list 3 doc two\nnaïve ☃ 𝔘\n"

    with sandbox.create() as r:
        assert r.execute("print(context)").stdout == "None\n"


def test_stdout_stderr_and_fd_level_output_are_captured(repl):
    code = (
        "import os, sys\n"
        "print('py-out')\n"
        "print('py-err', file=sys.stderr)\n"
        "os.system('echo shell-out; echo shell-err 1>&2')\n"
        "sys.__stdout__.write('raw-fd\\n')\n"
    )
    res = repl.execute(code)
    assert res.error is None
    assert res.stdout.splitlines() == ["py-out", "shell-out", "raw-fd"]
    assert res.stderr.splitlines() == ["py-err", "shell-err"]
    # Nothing leaks into the next block.
    assert repl.execute("pass").stdout == ""


def test_output_is_per_repl_under_concurrency(sandbox):
    async def main():
        repls = [await sandbox.acreate() for _ in range(4)]
        try:
            codes = [
                f"import time\nfor i in range(30):\n    print('repl{k}', i)\n    time.sleep(0.001)"
                for k in range(4)
            ]
            return await asyncio.gather(*(r.aexecute(c) for r, c in zip(repls, codes)))
        finally:
            for r in repls:
                await r.aclose()

    for k, res in enumerate(asyncio.run(main())):
        assert res.stdout.splitlines() == [f"repl{k} {i}" for i in range(30)]


def test_output_truncated_with_marker(repl):
    res = repl.execute("print('x' * 5000)")
    assert res.stdout == "x" * 1000 + "\n... [truncated 4001 chars]"
    res = repl.execute("import sys\nprint('e' * 3000, file=sys.stderr)")
    assert res.stderr.startswith("e" * 1000) and res.stderr.endswith("[truncated 2001 chars]")
    res = repl.execute("import os\nos.system(\"head -c 4000 /dev/zero | tr '\\\\0' y\")")
    assert res.stdout.startswith("y" * 1000) and "[truncated 3000 chars]" in res.stdout


def test_variables_listing(repl, sandbox):
    res = repl.execute("import json\n_hidden = 1\ns = 'a'\nitems = [1]\nclass K:\n    pass\nk = K()")
    assert res.variables == [("n_items", "int"), ("s", "str"), ("items", "list"), ("K", "type"), ("k", "K")]
    assert "Available variables: n_items: int, s: str" in repl.execute("print(SHOW_VARS())").stdout
    with ReplSandbox(SandboxConfig(show_vars=False, isolation=sandbox.mode)) as quiet:
        with quiet.create() as r:
            assert r.execute("a = 1").variables == []


def test_reserved_names_are_restored_after_each_block(sandbox):
    with sandbox.create(context=["a", "b"]) as r:
        clobber = (
            "\n".join(f"{name} = 3" for name in RESERVED_NAMES if name != "SHOW_VARS") + "\ndel SHOW_VARS"
        )
        res = r.execute(clobber + "\nprint(context, FINAL)")
        assert res.stdout == "3 3\n"  # inside the block the rebinding is visible
        assert not any(name in RESERVED_NAMES for name, _ in res.variables)
        res = r.execute("print(context)\nprint(SHOW_VARS())\nprint(llm_query('x')[:6])\nFINAL('done')")
        assert res.stdout.splitlines()[0] == "['a', 'b']"
        assert res.stdout.splitlines()[2] == "Error:"
        assert res.final_answer == "done"
        # In-place mutation of the context is undone too.
        r.execute("context.append('c')\ncontext[0] = 'changed'")
        assert r.execute("print(context)").stdout == "['a', 'b']\n"


def test_final_and_final_var(repl):
    res = repl.execute("FINAL(42)")
    assert res.final_answer == "42"
    assert repl.execute("pass").final_answer is None  # per block
    assert repl.final_answer == "42"  # last one recorded by this REPL
    res = repl.execute("answer = [1, 2]\nFINAL_VAR('answer')")
    assert res.final_answer == "[1, 2]"
    assert repl.execute("FINAL_VAR(\" 'answer' \")").final_answer == "[1, 2]"
    assert repl.execute("FINAL_VAR(7)").final_answer == "7"
    res = repl.execute("r = FINAL_VAR('missing')\nprint(r.startswith('Error'))")
    assert res.final_answer is None
    assert res.stdout == "True\n"
    assert "'missing' not found" in res.stderr
    assert "User variables: ['n_items', 'answer']" in res.stderr


def test_errors_are_observations_with_user_frames(repl):
    res = repl.execute("def g():\n    raise KeyError('k')\nvalue = 5\ng()")
    assert res.error.startswith("Traceback (most recent call last):")
    assert "KeyError: 'k'" in res.error
    assert "raise KeyError('k')" in res.error  # source lines of the block are shown
    assert "_child.py" not in res.error  # the runtime's frames are hidden
    assert ("value", "int") in res.variables  # what ran before the error stays
    assert "SyntaxError" in repl.execute("def (:").error
    res = repl.execute("import sys\nsys.exit(3)")
    assert "SystemExit: 3" in res.error and not res.killed
    assert repl.execute("print(value)").stdout == "5\n"


def test_echo_last_expression_option(sandbox):
    with ReplSandbox(SandboxConfig(echo_last_expr=True, isolation=sandbox.mode)) as sb, sb.create() as r:
        assert r.execute("x = 5\nx * 2").stdout == "10\n"
        assert r.execute("None").stdout == ""
        assert r.execute("print('a')").stdout == "a\n"


def test_subcalls_reach_the_async_handler_and_failures_become_strings(sandbox):
    calls = []
    active = peak = 0

    async def handler(kind, payload):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.05)
        active -= 1
        calls.append((kind, payload))
        if payload["prompt"] == "fail":
            raise RuntimeError("engine unavailable")
        ctx = payload.get("context")
        return f"{kind}({payload['prompt']})" + (f"[{ctx}]" if ctx else "")

    code = (
        "a = llm_query('hello')\n"
        "b = llm_query_batched(['p1', 'p2', 'p3'])\n"
        "c = rlm_query('sub', context='piece')\n"
        "d = rlm_query_batched(['q1', 'q2'], contexts=['c1', 'c2'])\n"
        "e = llm_query('fail')\n"
        "for v in (a, b, c, d, e):\n"
        "    print(v)\n"
    )

    async def main():
        r = await sandbox.acreate(context="ctx", handler=handler)
        try:
            return await r.aexecute(code)
        finally:
            await r.aclose()

    res = asyncio.run(main())
    assert res.error is None
    assert res.stdout.splitlines() == [
        "llm_query(hello)",
        "['llm_query(p1)', 'llm_query(p2)', 'llm_query(p3)']",
        "rlm_query(sub)[piece]",
        "['rlm_query(q1)[c1]', 'rlm_query(q2)[c2]']",
        "Error: llm_query failed: RuntimeError: engine unavailable",
    ]
    assert peak >= 3  # batched prompts are answered concurrently
    assert ("rlm_query", {"prompt": "sub", "context": "piece", "model": None}) in calls


def test_sync_handler_no_handler_and_subcall_time_not_counted(sandbox):
    def slow_upper(kind, payload):
        time.sleep(1.2)
        return payload["prompt"].upper()

    with sandbox.create(handler=slow_upper) as r:
        res = r.execute("print(llm_query('abc'))", timeout_s=1.0)
    assert res.stdout == "ABC\n" and not res.timed_out  # 1.2 s in the handler, 1 s block limit
    with sandbox.create() as r:
        res = r.execute("print(llm_query('x'))\nprint(rlm_query_batched(['a', 'b']))")
    assert res.stdout.startswith("Error: llm_query is not available")
    assert res.stdout.count("Error: rlm_query is not available") == 2

    async def never(kind, payload):
        await asyncio.sleep(30)

    cfg = SandboxConfig(subcall_timeout_s=0.3, isolation=sandbox.mode)
    with ReplSandbox(cfg, handler=never) as sb, sb.create() as r:
        res = r.execute("print(llm_query('x'))")
    assert res.stdout == "Error: llm_query timed out after 0.3 s\n"


def test_many_repls_concurrently_from_asyncio(sandbox):
    async def trajectory(k):
        r = await sandbox.acreate(context=f"doc {k}")
        try:
            await r.aexecute("total = 0")
            for i in range(3):
                await r.aexecute(f"total += {i}")
            return (await r.aexecute("print(context, total)")).stdout
        finally:
            await r.aclose()

    async def main():
        return await asyncio.gather(*(trajectory(k) for k in range(16)))

    before = sandbox.num_repls
    assert asyncio.run(main()) == [f"doc {k} 3\n" for k in range(16)]
    assert sandbox.num_repls == before  # slots were freed


def test_misuse_raises_and_cancellation_restarts(sandbox):
    async def main():
        r = await sandbox.acreate(context="c")
        try:
            slow = asyncio.ensure_future(r.aexecute("import time\ntime.sleep(0.5)"))
            await asyncio.sleep(0.1)
            with pytest.raises(SandboxError, match="already running"):
                await r.aexecute("1")
            assert (await slow).ok
            await r.aexecute("x = 1")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(r.aexecute("while True:\n    pass"), 0.3)
            return await r.aexecute("print(context, 'x' in globals())")
        finally:
            await r.aclose()

    res = asyncio.run(main())
    assert res.restarted and res.stdout == "c False\n"
    assert "variables from earlier steps are lost" in res.stderr
    r = sandbox.create()
    r.close()
    r.close()  # idempotent
    with pytest.raises(SandboxError, match="closed"):
        r.execute("1")
    # A REPL dropped without close() is reclaimed (processes killed, slot freed) when collected.
    before = sandbox.num_repls
    r = sandbox.create()
    assert sandbox.num_repls == before + 1
    del r
    gc.collect()
    assert sandbox.num_repls == before


def test_isolation_report(sandbox):
    report = sandbox.isolation_report()
    assert report["mode"] == sandbox.mode in ("bwrap", "rlimits")
    keys = ("namespaces", "network", "filesystem", "uid_separation", "limits", "process", "python_level")
    for key in keys + ("environment", "seccomp"):
        assert key in report
    assert set(report["limits"]) >= {"timeout", "memory", "cpu", "processes", "file_size"}
    if report["mode"] == "bwrap":
        assert report["bwrap"]["version"].startswith("bubblewrap")
    with pytest.raises(ValueError):
        SandboxConfig(isolation="docker")


def test_without_bubblewrap_auto_falls_back_and_bwrap_mode_refuses(monkeypatch):
    import workers.sandbox.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "bwrap_path", lambda: None)
    with pytest.raises(SandboxError, match="not installed"):
        ReplSandbox(SandboxConfig(isolation="bwrap"))
    with ReplSandbox(SandboxConfig(isolation="auto")) as sb:
        assert sb.mode == "rlimits"
        report = sb.isolation_report()
        assert "not installed" in report["bwrap_not_used"]
        with sb.create(context="c") as r:
            assert r.execute("print(context)").stdout == "c\n"
