"""The static trajectory viewer: built from JSONL, opened in headless Chromium (skipped where absent)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from workers.agents.llm import EngineLLM
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.agents.trajectory import dump_jsonl, load_jsonl
from workers.rlm.agent import AgentConfig, RLMAgent
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


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


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


@pytest.mark.skipif(
    chromium() is None, reason="headless Chromium is not installed (apt-get install chromium)"
)
def test_headless_chromium_renders_tree_code_and_outputs(jsonl, tmp_path):
    html_path = write_html(jsonl, tmp_path / "view.html", title="RLM run")
    base = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
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
    png = tmp_path / "view.png"
    subprocess.run(
        [*base, f"--screenshot={png}", "--window-size=1200,1600", url],
        capture_output=True,
        timeout=90,
        check=True,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
