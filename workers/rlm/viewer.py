"""A static HTML page for RLM trajectories (JSONL, as written by the inference API or the env worker).

    python -m workers.rlm.viewer outputs/rlm.jsonl [more.jsonl ...] -o outputs/rlm.html

One self-contained file (inline CSS and a few lines of JS, no external assets): an outline of every
root and its child calls, then per trajectory its query, status, answer, timings and turns; per turn
the model's response, each code block with its stdout/stderr/error and time, the ``llm_query`` /
``rlm_query`` sub-calls it made, and the child trajectories it started nested in place (collapsible
``<details>``). Roots are grouped by the ``root_uid`` they share with their children.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
from collections.abc import Iterable, Sequence

from workers.agents.trajectory import Trajectory, TrajectoryTurn, load_jsonl

__all__ = ["load_trajectories", "main", "render_html", "write_html"]

MAX_TEXT_CHARS = 20_000  # per text box; longer text is cut (the JSONL keeps it whole)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em;color:#1d1d1f;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .3em}
.stats{color:#555;margin-bottom:1em}
.toolbar button,.toolbar select{margin-right:.5em}
ul.tree{list-style:none;padding-left:1.2em;margin:.2em 0}
ul.tree li{margin:.15em 0}
details{border:1px solid #ddd;border-radius:6px;background:#fff;margin:.5em 0;padding:.3em .6em}
details.traj{border-left:4px solid #888}
details.traj.status-finished{border-left-color:#2a9d3a}
details.traj.status-error{border-left-color:#d33}
details.traj.status-budget,details.traj.status-max_iterations{border-left-color:#e0a000}
details.turn{background:#fcfcff}
summary{cursor:pointer}
.badge{display:inline-block;font-size:.8em;padding:0 .45em;border-radius:4px;background:#eee;margin-left:.35em}
.badge.finished{background:#d7f5dc}.badge.error{background:#fbd5d5}
.badge.budget,.badge.max_iterations{background:#fff0c2}
pre{white-space:pre-wrap;word-break:break-word;background:#f4f4f6;padding:.45em;border-radius:4px;margin:.3em 0;
max-height:30em;overflow:auto;font-size:.85em}
pre.code{background:#1e1e2a;color:#e8e8f0}
pre.stdout{background:#eef7ee}pre.stderr{background:#fff6e5}pre.error{background:#fdeaea}
pre.response{background:#f1f4ff}
.label{font-size:.75em;color:#666;text-transform:uppercase;letter-spacing:.04em;margin-top:.4em}
table.subcalls{border-collapse:collapse;font-size:.85em;width:100%}
table.subcalls td,table.subcalls th{border:1px solid #ddd;padding:.25em;vertical-align:top;text-align:left}
.answer{font-weight:600}
.hidden{display:none}
"""

_JS = """
(function(){
  var roots=document.querySelectorAll('details.traj.depth-0');
  var shown=document.getElementById('shown');
  function apply(){
    var want=document.getElementById('status-filter').value, n=0;
    roots.forEach(function(d){
      var ok=(want==='all'||d.dataset.status===want);
      d.classList.toggle('hidden',!ok); if(ok){n++;}
    });
    shown.textContent=String(n);
  }
  document.getElementById('status-filter').addEventListener('change',apply);
  document.getElementById('expand').addEventListener('click',function(){
    document.querySelectorAll('details').forEach(function(d){d.open=true;});});
  document.getElementById('collapse').addEventListener('click',function(){
    document.querySelectorAll('details').forEach(function(d){d.open=false;});});
  apply();
  document.body.setAttribute('data-rendered','1');
})();
"""


def _e(text) -> str:
    s = "" if text is None else str(text)
    if len(s) > MAX_TEXT_CHARS:
        s = s[:MAX_TEXT_CHARS] + f"\n... [{len(s) - MAX_TEXT_CHARS} more characters in the JSONL]"
    return html.escape(s, quote=True)


def _anchor(traj_id: str) -> str:
    return "traj-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in traj_id)


def _secs(x) -> str:
    return "" if x is None else f"{float(x):.2f}s"


def load_trajectories(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Trajectory]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Trajectory] = []
    for p in paths:
        out.extend(load_jsonl(p))
    return out


class _Page:
    def __init__(self, trajectories: Sequence[Trajectory]):
        self.by_id: dict[str, Trajectory] = {}
        for t in trajectories:
            self.by_id.setdefault(t.id, t)
        self.roots = [t for t in self.by_id.values() if t.parent_id is None or t.parent_id not in self.by_id]
        self.rendered: set[str] = set()

    # -- outline ------------------------------------------------------------------------------------
    def outline(self, t: Trajectory) -> str:
        kids = "".join(self.outline(self.by_id[c]) for c in t.children if c in self.by_id)
        answer = f" &rarr; <span class='answer'>{_e(_short(t.final_answer))}</span>" if t.final_answer else ""
        return (
            f"<li><a href='#{_anchor(t.id)}'>{_e(t.id)}</a> <span class='badge {t.status}'>{t.status}</span>"
            f" <span class='badge'>depth {t.depth}</span> {_e(_short(t.query, 80))}{answer}"
            + (f"<ul class='tree'>{kids}</ul>" if kids else "")
            + "</li>"
        )

    # -- trajectories -------------------------------------------------------------------------------
    def trajectory(self, t: Trajectory, open_: bool) -> str:
        self.rendered.add(t.id)
        subcalls = t.metadata.get("subcalls", []) if isinstance(t.metadata, dict) else []
        head = (
            f"<summary><b>{_e(t.id)}</b><span class='badge {t.status}'>{t.status}</span>"
            f"<span class='badge'>depth {t.depth}</span><span class='badge'>{len(t.turns)} turns</span>"
            f"<span class='badge'>{len(subcalls)} sub-calls</span>"
            f"<span class='badge'>{_secs(t.timings.get('total_s'))}</span> {_e(_short(t.query, 100))}</summary>"
        )
        parts = [
            "<div class='label'>query</div>",
            f"<pre class='query'>{_e(t.query)}</pre>",
            "<div class='label'>final answer</div>",
            f"<pre class='final-answer'>{_e(t.final_answer) if t.final_answer is not None else '(none)'}</pre>",
        ]
        meta = [f"uid {_e(t.root_uid)}"]
        if t.parent_id:
            meta.append(f"parent <a href='#{_anchor(t.parent_id)}'>{_e(t.parent_id)}</a>")
        if t.context_info:
            ci = t.context_info
            meta.append(f"context {_e(ci.get('type'))}, {_e(ci.get('length'))} chars")
        for k in ("gen_s", "exec_s", "total_s"):
            if k in t.timings:
                meta.append(f"{k} {_secs(t.timings[k])}")
        parts.append(f"<div class='meta'>{' &middot; '.join(meta)}</div>")
        if t.error:
            parts.append(f"<div class='label'>error</div><pre class='error'>{_e(t.error)}</pre>")
        for turn in t.turns:
            calls = [s for s in subcalls if s.get("turn") == turn.index]
            parts.append(self.turn(turn, calls, open_))
        leftover = [c for c in t.children if c in self.by_id and c not in self.rendered]
        for c in leftover:
            parts.append(self.trajectory(self.by_id[c], open_=False))
        cls = f"traj depth-{t.depth} status-{t.status}"
        return (
            f"<details class='{cls}' id='{_anchor(t.id)}' data-status='{_e(t.status)}' data-depth='{t.depth}'"
            f"{' open' if open_ else ''}>{head}{''.join(parts)}</details>"
        )

    def turn(self, turn: TrajectoryTurn, calls: list[dict], open_: bool = False) -> str:
        tm = turn.timings or {}
        head = (
            f"<summary>Turn {turn.index + 1}<span class='badge'>gen {_secs(tm.get('gen_s'))}</span>"
            f"<span class='badge'>exec {_secs(tm.get('exec_s'))}</span>"
            f"<span class='badge'>{len(turn.code_results)} blocks</span>"
            + (f"<span class='badge'>{len(turn.child_ids)} children</span>" if turn.child_ids else "")
            + ("<span class='badge'>FINAL line</span>" if turn.final else "")
            + "</summary>"
        )
        parts = [f"<div class='label'>model</div><pre class='response'>{_e(turn.response_text)}</pre>"]
        for i, r in enumerate(turn.code_results, 1):
            parts.append(
                f"<div class='label'>block {i} &middot; {_secs(r.elapsed_s)}"
                + (" &middot; timed out" if r.timed_out else "")
                + "</div>"
                f"<pre class='code'>{_e(r.code)}</pre>"
            )
            if r.stdout:
                parts.append(f"<pre class='stdout'>{_e(r.stdout)}</pre>")
            if r.stderr:
                parts.append(f"<pre class='stderr'>{_e(r.stderr)}</pre>")
            if r.error:
                parts.append(f"<pre class='error'>{_e(r.error)}</pre>")
            if r.final_answer is not None:
                parts.append(f"<div class='answer'>FINAL: {_e(r.final_answer)}</div>")
        if turn.final is not None:
            f = turn.final
            arg = f.answer if f.kind == "FINAL" else f.var_name
            parts.append(f"<div class='answer'>{_e(f.kind)}({_e(arg)}) on its own line</div>")
        if calls:
            rows = "".join(
                f"<tr><td>{_e(c.get('kind'))}</td><td><pre>{_e(c.get('prompt'))}</pre></td>"
                f"<td><pre>{_e(c.get('response'))}</pre></td><td>{_secs(c.get('elapsed_s'))}</td>"
                f"<td>{_link(c.get('child_id'))}</td></tr>"
                for c in calls
            )
            parts.append(
                "<div class='label'>sub-calls</div><table class='subcalls'><tr><th>kind</th><th>prompt</th>"
                f"<th>response</th><th>time</th><th>child</th></tr>{rows}</table>"
            )
        for cid in turn.child_ids:
            if cid in self.by_id and cid not in self.rendered:
                parts.append(self.trajectory(self.by_id[cid], open_=False))
        return f"<details class='turn'{' open' if open_ else ''}>{head}{''.join(parts)}</details>"


def _link(child_id) -> str:
    return f"<a href='#{_anchor(child_id)}'>{_e(child_id)}</a>" if child_id else ""


def _short(text, n: int = 60) -> str:
    s = " ".join(str(text or "").split())
    return s if len(s) <= n else s[: n - 1] + "…"


def render_html(trajectories: Iterable[Trajectory], title: str = "RLM trajectories") -> str:
    """The page for ``trajectories`` (roots and children in any order)."""
    page = _Page(list(trajectories))
    roots = page.roots
    statuses = sorted({t.status for t in roots})
    n_all = len(page.by_id)
    finished = sum(t.status == "finished" for t in roots)
    outline = "".join(page.outline(t) for t in roots)
    body = "".join(page.trajectory(t, open_=len(roots) <= 3) for t in roots)
    options = "".join(f"<option value='{_e(s)}'>{_e(s)}</option>" for s in statuses)
    data = json.dumps({"roots": len(roots), "trajectories": n_all, "finished": finished})
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{_e(title)}</h1>"
        f"<div class='stats' id='stats' data-summary='{_e(data)}'>{len(roots)} roots, {n_all} trajectories "
        f"({n_all - len(roots)} child calls), {finished} finished &middot; showing <span id='shown'>"
        f"{len(roots)}</span></div>"
        "<div class='toolbar'><select id='status-filter'><option value='all'>all statuses</option>"
        f"{options}</select><button id='expand'>expand all</button><button id='collapse'>collapse all</button>"
        "</div>"
        f"<h2>Call tree</h2><ul class='tree' id='outline'>{outline}</ul>"
        f"<h2>Trajectories</h2><div id='trajectories'>{body}</div>"
        f"<script>{_JS}</script></body></html>"
    )


def write_html(
    trajectories: Iterable[Trajectory] | str | os.PathLike | Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    title: str = "RLM trajectories",
) -> str:
    """Render ``trajectories`` (or JSONL path(s)) to ``out_path``; returns the path."""
    if isinstance(trajectories, (str, os.PathLike)) or (
        isinstance(trajectories, (list, tuple))
        and trajectories
        and isinstance(trajectories[0], (str, os.PathLike))
    ):
        trajectories = load_trajectories(trajectories)
    out_path = os.fspath(out_path)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(render_html(trajectories, title))
    return out_path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Render RLM trajectories (JSONL) as a static HTML page.")
    ap.add_argument("jsonl", nargs="+", help="trajectory JSONL file(s)")
    ap.add_argument("-o", "--out", default=None, help="output .html (default: beside the first input)")
    ap.add_argument("--title", default="RLM trajectories")
    args = ap.parse_args(argv)
    out = args.out or os.path.splitext(args.jsonl[0])[0] + ".html"
    path = write_html(list(args.jsonl), out, args.title)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
