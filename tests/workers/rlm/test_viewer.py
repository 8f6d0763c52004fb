"""The static trajectory viewer: built from JSONL (written by scripted runs through ``RLMAgent`` and the public
``RLM()`` API, and from hand-built trajectories for records other parts of the agent write: tool calls, recorded
usage with cost), checked as HTML text and opened in headless Chromium (skipped where absent)."""

from __future__ import annotations

import asyncio
import html
import os
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.browser import chromium, chromium_args
from tests.skips import skip_or_fail
from workers.agents.llm import EngineLLM
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.agents.trajectory import (
    CodeResult,
    FinalCall,
    Trajectory,
    TrajectoryTurn,
    dump_jsonl,
    load_jsonl,
)
from workers.rlm.agent import AgentConfig, RLMAgent
from workers.rlm.inference import RLM
from workers.rlm.protocol import truncate
from workers.rlm.viewer import main, render_html, write_html
from workers.sandbox import ReplSandbox, SandboxConfig

pytestmark = pytest.mark.timeout(120)

F = "```"
HOSTILE = "<script>document.title='pwned'</script>"
SCRIPT = {
    "Find the code word": [
        "Let me look.\n" + f"{F}repl\nprint(len(context))\nnote = llm_query('say hi')\nprint(note)\n{F}",
        f"{F}repl\nparts = rlm_query_batched(['left half', 'right half'], [context[:6], context[6:]])\n"
        f"print(parts)\n{F}",
        f"Printing markup is harmless: {HOSTILE}\nFINAL_VAR(parts)",
    ],
    "left half": [f"{F}repl\nFINAL(context.strip())\n{F}"],
    "right half": [f"{F}repl\nraise ValueError('no luck')\n{F}", f"{F}repl\nFINAL(context.strip())\n{F}"],
}


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    from workers.models import load_tokenizer
    from workers.models.tiny import ensure_tiny_model

    tok = load_tokenizer(ensure_tiny_model("nano"))
    gen = scripted_generate(tok, ReplayScript(SCRIPT, sub=lambda p: "hi there"))
    with ReplSandbox(SandboxConfig(timeout_s=5)) as sb:
        agent = RLMAgent(EngineLLM(gen, tok), sb, AgentConfig(max_iterations=4))

        async def both():
            return await asyncio.gather(
                agent.run("Find the code word", "alpha beta  ", uid="u1", traj_id="root-a"),
                agent.run("An unscripted question", "zzz", uid="u2", traj_id="root-b"),
            )

        a, b = asyncio.run(both())
    path = tmp_path_factory.mktemp("viewer") / "traj.jsonl"
    dump_jsonl(a.trajectories + b.trajectories, path)
    return path


LOG_SCRIPT = {
    "Summarise the log": [
        f"Peek first.\n{F}repl\nprint(context * 400)\nnote = llm_query('one word for: ' + context)\n{F}\nThen more.",
        "Thinking it over. " * 12 + f"\n{F}repl\n" + "x = 1\n" * 80 + F,  # cut inside its block
        "FINAL(done)",  # never reached: the token budget is spent first
    ]
}


@pytest.fixture(scope="module")
def budget_jsonl(tmp_path_factory):
    """A run through the public API that hits every truncation: the sandbox cuts a block's output
    (max_output_chars), the observation cuts it again (max_observation_chars), a response is cut at
    max_new_tokens, and the root's token budget (max_tokens) ends it with status "budget"."""
    from workers.models import load_tokenizer
    from workers.models.tiny import ensure_tiny_model

    tok = load_tokenizer(ensure_tiny_model("nano"))
    log = tmp_path_factory.mktemp("viewer-budget") / "rlm.jsonl"
    gen = scripted_generate(tok, ReplayScript(LOG_SCRIPT, sub=lambda p: "terse"))
    with RLM(
        engine=gen,
        tokenizer=tok,
        max_iterations=4,
        agent_config=AgentConfig(max_new_tokens=120, max_observation_chars=300, max_tokens=150),
        sandbox=SandboxConfig(timeout_s=5, max_output_chars=1000),  # the limits of the RLM's own sandbox
        log_path=log,
    ) as rlm:
        res = rlm.completion("Summarise the log", context="log line; ")
    assert res.status == "budget" and [t.finish_reason for t in res.root.turns] == ["stop", "length"]
    return log


def hand_built() -> list[Trajectory]:
    """Records other parts of the agent write, built by hand: a tool call and a sub-call with usage, turns
    without ``usage`` (token ids only), a forced final turn; a second root whose usage was recorded with cost."""
    code = "r = lookup('alpha')\nprint(r)"
    turns = [
        TrajectoryTurn(
            index=0,
            prompt_text="SYSTEM: the tool lookup(key) is available.\nUSER: What is alpha?",
            response_text=f"Call the tool.\n{F}repl\n{code}\n{F}\n{F}python\nprint('an example')\n{F}",
            prompt_token_ids=[1] * 40,
            response_token_ids=[2] * 12,
            code_results=[CodeResult(code=code, stdout="ALPHA\n", elapsed_s=0.01)],
            finish_reason="stop",
        ),
        TrajectoryTurn(
            index=1,
            prompt_text="[REPL block 1/1]\nALPHA-OBSERVED\n",
            response_text="FINAL_VAR(missing)",
            prompt_token_ids=[1] * 10,
            response_token_ids=[2] * 5,
            code_results=[CodeResult(code="FINAL_VAR('missing')", error="NameError: missing")],
            final=FinalCall("FINAL_VAR", "missing", var_name="missing"),
            timings={"forced_final": 1.0},
            finish_reason="stop",
        ),
    ]
    subcalls = [
        {"kind": "tool", "name": "lookup", "turn": 0, "prompt": '{"args": ["alpha"]}', "response": '"ALPHA"'},
        {
            "kind": "llm_query",
            "turn": 0,
            "prompt": "spell alpha",
            "response": "A-L-P-H-A",
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "model": "sub-model"},
        },
    ]
    priced = {"prompt_tokens": 1000, "completion_tokens": 200, "calls": 2, "cost_usd": 0.0123}
    return [
        Trajectory(
            id="tools",
            query="What is alpha?",
            turns=turns,
            status="max_iterations",
            metadata={"subcalls": subcalls},
        ),
        Trajectory(
            id="priced",
            query="A priced run",
            status="finished",
            final_answer="ok",
            metadata={"usage": {"total": priced, "by_depth": {"0": priced}, "by_model": {"gpt-x": priced}}},
        ),
    ]


def visible_text(html_path, tmp_path, expand: bool) -> str:
    """The page's text as Chromium renders it (``innerText``: what is inside closed ``<details>`` is left out),
    before or after a click on "expand all". A probe script appended to a copy of the page writes it out."""
    probe = (
        "<script>"
        + ("document.getElementById('expand').click();" if expand else "")
        + "var p=document.createElement('pre');p.id='visible-text';p.textContent=document.body.innerText;"
        "document.body.appendChild(p);</script>"
    )
    copy = Path(tmp_path) / ("probe-expanded.html" if expand else "probe.html")
    copy.write_text(Path(html_path).read_text().replace("</body>", probe + "</body>"))
    dom = subprocess.run(
        [*chromium_args(tmp_path), "--dump-dom", "file://" + str(copy)],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    ).stdout
    return html.unescape(re.search(r'<pre id="visible-text">(.*?)</pre>', dom, re.S).group(1))


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.nesting: dict[str, list[str]] = {}  # details id -> ids of the details it sits in
        self.scripts = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if tag == "details" and attrs.get("id"):
            self.nesting[attrs["id"]] = [a["id"] for t, a in self.stack if t == "details" and a.get("id")]
        self.stack.append((tag, attrs))

    def handle_endtag(self, tag):
        while self.stack:
            t, _ = self.stack.pop()
            if t == tag:
                break


def test_page_structure_and_escaping(jsonl):
    trajs = load_jsonl(jsonl)
    assert [t.id for t in trajs] == ["root-a", "root-a/0", "root-a/1", "root-b"]
    page = render_html(trajs, title="demo")
    parser = _Collect()
    parser.feed(page)
    # children sit inside their parent (within the turn that started them); roots at the top
    assert parser.nesting["traj-root-a"] == [] and parser.nesting["traj-root-b"] == []
    assert parser.nesting["traj-root-a_0"] == ["traj-root-a"] == parser.nesting["traj-root-a_1"]
    assert parser.scripts == 1  # only the viewer's own script: model output is escaped
    assert "&lt;script&gt;document.title=" in page
    assert "http://" not in page and "https://" not in page and "<link" not in page  # no external assets


def test_cli_writes_html(jsonl, tmp_path, capsys):
    out = tmp_path / "page.html"
    assert main([str(jsonl), "-o", str(out), "--title", "CLI page"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert "<title>CLI page</title>" in out.read_text()


def test_headless_chromium_renders_tree_code_and_outputs(jsonl, tmp_path):
    if chromium() is None:
        skip_or_fail("headless Chromium is not installed (apt-get install chromium)")
    html_path = write_html(jsonl, tmp_path / "view.html", title="RLM run")
    base = chromium_args(tmp_path)
    url = "file://" + os.path.abspath(html_path)
    dom = subprocess.run(
        [*base, "--dump-dom", url], capture_output=True, text=True, timeout=90, check=True
    ).stdout
    assert 'data-rendered="1"' in dom  # the page's script ran in the browser
    assert "<title>RLM run</title>" in dom  # the model's markup did not run (it would retitle the page)
    assert 'id="outline"' in dom and dom.count("<li>") == 4  # 2 roots + 2 child calls in the call tree
    for text in (
        "root-a/0",
        "root-a/1",
        "rlm_query_batched([",  # the code of a turn
        "hi there",  # a sub-LM answer, printed by the code
        "ValueError: no luck",  # a child's error observation
        "['alpha', 'beta']",  # the root's final answer
        "max_iterations",  # the unscripted root never finished
        "&lt;script&gt;",
    ):
        assert text in dom, text
    shown = visible_text(html_path, tmp_path, expand=False)
    everything = visible_text(html_path, tmp_path, expand=True)
    # each block's code once: in its block (with its output), not again in the response text
    assert shown.count("rlm_query_batched([") == 1 == everything.count("rlm_query_batched([")
    # what the model saw before each turn: collapsed at first, then between the turns it separates
    assert "What the model saw before turn 2: the observation of turn 1's code" in shown
    assert "[Turn 1 of 4 done; 3 left" not in shown and "[Turn 1 of 4 done; 3 left" in everything
    root = load_jsonl(jsonl)[0]
    t1, t2 = root.turns[:2]
    turn1 = f"Turn 1 in {t1.usage['prompt_tokens']:,} tok ({len(t1.prompt_token_ids):,} new) / out {t1.usage['completion_tokens']}"
    turn2 = f"Turn 2 in {t2.usage['prompt_tokens']:,} tok ({len(t2.prompt_token_ids):,} new) / out {t2.usage['completion_tokens']}"
    positions = [everything.index(x) for x in (turn1, "[Turn 1 of 4 done; 3 left", turn2)]
    assert positions == sorted(positions) and turn1 in shown
    # the run's totals: every turn and sub-LM call of both roots
    trajs = load_jsonl(jsonl)
    calls = [t.usage for tr in trajs for t in tr.turns]
    calls += [c["usage"] for tr in trajs for c in tr.metadata.get("subcalls", []) if "usage" in c]
    prompt, completion = sum(u["prompt_tokens"] for u in calls), sum(u["completion_tokens"] for u in calls)
    totals = f"{prompt:,} prompt + {completion:,} completion tokens in {len(calls)} model calls"
    assert totals in shown
    png = tmp_path / "view.png"
    subprocess.run(
        [*base, f"--screenshot={png}", "--window-size=1200,1600", url],
        capture_output=True,
        timeout=90,
        check=True,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_headless_chromium_shows_truncation_budget_tools_and_usage(budget_jsonl, tmp_path):
    if chromium() is None:
        skip_or_fail("headless Chromium is not installed (apt-get install chromium)")
    jsonl2 = dump_jsonl(hand_built(), tmp_path / "hand.jsonl")
    html_path = tmp_path / "view.html"
    assert main([str(budget_jsonl), jsonl2, "-o", str(html_path)]) == 0  # the CLI, several JSONL files
    shown = visible_text(html_path, tmp_path, expand=False)
    everything = visible_text(html_path, tmp_path, expand=True)
    for text in (
        "response cut at max_new_tokens",
        "output truncated by the sandbox (3,001 chars cut)",  # 4,001 printed, max_output_chars=1000
        "stopped by its budget",
        "token budget of 150 generated tokens per root is spent",
        "unterminated repl block, not run",
        "forced final answer (iterations spent)",
        "tool lookup",  # the tool call's row: its name, arguments and result
        '{"args": ["alpha"]}',
        "7 in / 3 out · sub-model",  # a sub-call's tokens and model
        "Turn 1 in 40 tok (40 new) / out 12",  # no usage recorded: counted from the token ids
        "Turn 2 in 62 tok (10 new) / out 5",  # the request: 40 + 12 earlier tokens and 10 new
        "$0.0123",  # a recorded cost
    ):
        assert text.lower() in shown.lower(), text
    obs = "What the model saw before turn 2: the observation of turn 1's code, with the chat-template text"
    assert obs + " observation truncated" in shown
    assert "[... " in everything and "characters truncated ...]" in everything  # the cut observation itself
    assert "ALPHA-OBSERVED" not in shown and "ALPHA-OBSERVED" in everything
    assert everything.count("r = lookup('alpha')") == 1


def _text(page: str) -> str:
    """The page's text without tags (for HTML-string checks)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def test_what_the_model_saw_comes_before_each_turn():
    page = render_html(hand_built()[:1])
    # the timeline of a trajectory: what the model saw before turn 1, turn 1, what it saw before turn 2, turn 2
    order = re.findall(r"<details class='(seen|turn)' data-turn='(\d+)'", page)
    assert order == [("seen", "0"), ("turn", "0"), ("seen", "1"), ("turn", "1")]
    text = _text(page)
    assert "What the model saw before turn 1: the initial prompt (system prompt and query)" in text
    assert (
        "What the model saw before turn 2: the observation of turn 1's code, with the chat-template text"
        in text
    )
    assert text.index("SYSTEM: the tool lookup") < text.index("Call the tool.") < text.index("ALPHA-OBSERVED")


def test_token_counts_per_turn_and_sub_call():
    text = _text(render_html(hand_built()[:1]))
    assert "Turn 1 in 40 tok (40 new) / out 12" in text  # no usage: from the token ids
    assert "Turn 2 in 62 tok (10 new) / out 5" in text
    assert "7 in / 3 out · sub-model" in text
    turn = TrajectoryTurn(index=0, usage={"prompt_tokens": 1500, "completion_tokens": 30, "model": "m"})
    text = _text(render_html([Trajectory(id="u", query="q", turns=[turn])]))
    assert "Turn 1 in 1,500 tok / out 30" in text  # usage without token ids (a logged trajectory)
    assert "Turn 1 in ? tok / out ?" in _text(
        render_html([Trajectory(id="x", query="q", turns=[TrajectoryTurn(0)])])
    )


def _usage_rows(page: str, source: str) -> dict[str, tuple[str, ...]]:
    """The rows of the first usage table from ``source`` ("run", "recorded", "computed"): name -> cells."""
    table = re.search(f"<table class='usage' data-source='{source}'>(.*?)</table>", page).group(1)
    rows = re.findall(r"<tr><th>(.*?)</th>(.*?)</tr>", table)
    cells = {html.unescape(k): tuple(re.findall(r"<td class='n'>(.*?)</td>", c)) for k, c in rows}
    return {k: v for k, v in cells.items() if v}  # the header row has no cells


def test_usage_totals_recorded_or_summed():
    tools, priced = hand_built()
    page = render_html([tools])
    # summed: the turns (40 + 62 prompt, 12 + 5 completion) and the sub-LM call (7, 3); the tool call has no tokens
    assert "109 prompt + 20 completion tokens in 3 model calls" in _text(page)
    assert "summed from the turns and sub-calls" in _text(page)
    assert _usage_rows(page, "computed") == {
        "total": ("109", "20", "3", ""),
        "depth 0": ("102", "17", "2", ""),  # the trajectory's turns
        "depth 1": ("7", "3", "1", ""),  # its sub-LM calls, one level below
        "model (unknown)": ("102", "17", "2", ""),
        "model sub-model": ("7", "3", "1", ""),
    }
    page = render_html([tools, priced])
    assert "1,109 prompt + 220 completion tokens in 5 model calls" in _text(page)
    assert _usage_rows(page, "recorded")["total"] == ("1,000", "200", "2", "$0.0123")
    assert _usage_rows(page, "run")["total"] == ("1,109", "220", "5", "")  # one root has no cost: no run cost
    twice = render_html([priced, Trajectory(id="p2", query="q", metadata=priced.metadata)])
    assert "2,000 prompt + 400 completion tokens in 4 model calls" in _text(twice)
    assert _usage_rows(twice, "run")["model gpt-x"] == ("2,000", "400", "4", "$0.0246")
    assert "recorded by the agent" in _text(twice)


def test_truncation_flags():
    cut_stdout = "x" * 100 + "\n... [truncated 900 chars]"  # as the sandbox cuts a block's output
    turns = [
        TrajectoryTurn(
            0,
            response_text=f"{F}repl\nprint('x' * 1000)\n{F}",
            code_results=[CodeResult(code="print('x' * 1000)", stdout=cut_stdout)],
            finish_reason="length",
        ),
        TrajectoryTurn(1, prompt_text=truncate("y" * 1000, 100)),  # as the observation formatter cuts
    ]
    budget = Trajectory(id="b", query="q", turns=turns, status="budget", error="token budget of 10 is spent")
    text = _text(render_html([budget]))
    for flag in (
        "1 response(s) cut at max_new_tokens",  # the trajectory's summary
        "response cut at max_new_tokens",  # the turn's
        "output truncated (900 chars cut)",
        "output truncated by the sandbox (900 chars cut)",
        "observation truncated (900 chars cut)",
        "stopped by its budget",
        "token budget of 10 is spent",
    ):
        assert flag in text, flag
    whole = Trajectory(
        id="w", query="q", turns=[TrajectoryTurn(0, prompt_text="y" * 1000, finish_reason="stop")]
    )
    assert "class='badge cut'" not in render_html([whole])


def test_each_blocks_code_once_and_what_did_not_run():
    page = render_html(hand_built()[:1])
    assert page.count(html.escape("r = lookup('alpha')")) == 1  # in its block, not again in the response
    text = _text(page)
    assert (
        text.index("Call the tool.") < text.index("r = lookup") < text.index("ALPHA\n")
    )  # code, then output
    assert "fenced block, not run" in text and "print('an example')" in text  # a python fence does not run
    assert (
        "block 1 · 0.00s · run by the agent" in text
    )  # resolving the FINAL_VAR line: code not in the response
    assert "tool lookup" in text and '"ALPHA"' in text  # the tool call's row
