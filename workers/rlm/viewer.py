"""A static HTML page for RLM trajectories (JSONL, as written by the inference API or the env worker).

    python -m workers.rlm.viewer outputs/rlm.jsonl [more.jsonl ...] -o outputs/rlm.html

One self-contained file (inline CSS and a few lines of JS, no external assets): the token usage of the whole
run, an outline of every root and its child calls, then per trajectory its query, status, answer, usage,
timings and a timeline of what the model saw and what it did:

- *what the model saw* before each turn (collapsible): the initial prompt before turn 1, after that the
  observation of the previous turn's code plus the chat-template text (``TrajectoryTurn.prompt_text``);
- each turn's response with its code blocks in place, each block's code shown once, followed by its
  stdout/stderr/error (a fenced block that did not run is marked so);
- token counts per turn (the whole request, the new prompt tokens, the response) and per sub-call;
- the ``llm_query`` / ``rlm_query`` / tool sub-calls of the turn, and the child trajectories it started
  nested in place (collapsible ``<details>``);
- truncation badges: a response cut at ``max_new_tokens`` (``finish_reason == "length"``), output the sandbox
  or the observation cut, a trajectory stopped by its budget (status ``budget``).

Usage comes from ``root.metadata["usage"]`` when the agent recorded it (``workers.rlm.usage`` shape: ``total``,
``by_depth``, ``by_model``, with cost), else it is summed here from the turns' and sub-calls' ``usage``.
Roots are grouped by the ``root_uid`` they share with their children.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from workers.agents.trajectory import CodeResult, Trajectory, TrajectoryTurn, load_jsonl
from workers.rlm.protocol import TRUNCATION_MARKER, scan_fences

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["load_trajectories", "main", "render_html", "write_html"]

MAX_TEXT_CHARS = 20_000  # per text box; longer text is cut (the JSONL keeps it whole)

# the sandbox ends output it cut with "... [truncated N chars]" (workers/sandbox)
_SANDBOX_CUT = re.compile(r"\.\.\. \[truncated (\d+) chars\]")
# the observation formatter and sub-call records cut text with protocol.TRUNCATION_MARKER
_MARK_HEAD, _MARK_TAIL = TRUNCATION_MARKER.strip("\n").split("{n}")
_RECORD_CUT = re.compile(re.escape(_MARK_HEAD) + r"(\d+)" + re.escape(_MARK_TAIL))

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
details.seen{background:#f7f7f2;border-style:dashed}
summary{cursor:pointer}
.badge{display:inline-block;font-size:.8em;padding:0 .45em;border-radius:4px;background:#eee;margin-left:.35em}
.badge.finished{background:#d7f5dc}.badge.error{background:#fbd5d5}
.badge.budget,.badge.max_iterations{background:#fff0c2}
.badge.tokens{background:#e6eefc}
.badge.cut{background:#ffd9b3;font-weight:600}
pre{white-space:pre-wrap;word-break:break-word;background:#f4f4f6;padding:.45em;border-radius:4px;margin:.3em 0;
max-height:30em;overflow:auto;font-size:.85em}
pre.code{background:#1e1e2a;color:#e8e8f0}
pre.code.not-run{background:#3a3a44;color:#ccc}
pre.stdout{background:#eef7ee}pre.stderr{background:#fff6e5}pre.error{background:#fdeaea}
pre.response{background:#f1f4ff}pre.seen{background:#f7f7f2}
div.block{border-left:3px solid #1e1e2a;padding-left:.5em;margin:.4em 0}
.label{font-size:.75em;color:#666;text-transform:uppercase;letter-spacing:.04em;margin-top:.4em}
table.subcalls,table.usage{border-collapse:collapse;font-size:.85em}
table.subcalls{width:100%}
table.subcalls td,table.subcalls th,table.usage td,table.usage th{border:1px solid #ddd;padding:.25em;
vertical-align:top;text-align:left}
table.usage td.n{text-align:right}
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


def _n(x) -> str:
    return "?" if x is None else f"{int(x):,}"


def _badge(text: str, cls: str = "") -> str:
    return f" <span class='badge{' ' + cls if cls else ''}'>{text}</span>"  # the space: copied text stays readable


def _cut_chars(text: str | None, pattern: re.Pattern) -> int:
    """Characters that truncation markers in ``text`` say were cut (0: none)."""
    return sum(int(m.group(1)) for m in pattern.finditer(text or ""))


def load_trajectories(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Trajectory]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Trajectory] = []
    for p in paths:
        out.extend(load_jsonl(p))
    return out


# --------------------------------------------------------------------------------------------------
# Token counts and usage


def _turn_tokens(turns: Sequence[TrajectoryTurn]) -> list[tuple[int | None, int | None, int | None]]:
    """Per turn (whole request's prompt tokens, new prompt tokens, response tokens); None where unknown.

    ``turn.usage`` when recorded; else from the token ids (the request is everything up to this turn's
    prompt: the earlier turns' prompt and response tokens plus this prompt)."""
    out: list[tuple[int | None, int | None, int | None]] = []
    seen = 0
    for t in turns:
        u = t.usage or {}
        new = len(t.prompt_token_ids) if t.prompt_token_ids else None
        seen += len(t.prompt_token_ids)
        request = u.get("prompt_tokens")
        if request is None and t.prompt_token_ids:
            request = seen
        completion = u.get("completion_tokens")
        if completion is None and t.response_token_ids:
            completion = len(t.response_token_ids)
        seen += len(t.response_token_ids)
        out.append((request, new, completion))
    return out


def _bucket() -> dict[str, Any]:
    return {"prompt_tokens": 0, "completion_tokens": 0, "calls": 0, "cost_usd": 0.0}


def _add(b: dict[str, Any], prompt, completion, calls, cost) -> None:
    b["prompt_tokens"] += int(prompt or 0)
    b["completion_tokens"] += int(completion or 0)
    b["calls"] += int(calls or 0)
    b["cost_usd"] = None if b["cost_usd"] is None or cost is None else b["cost_usd"] + float(cost)


class _Usage:
    """Token usage in the shape the agent records as ``root.metadata["usage"]``: ``total``, ``by_depth``
    (a trajectory's turns at its depth, its sub-LM calls one level below) and ``by_model``."""

    def __init__(self) -> None:
        self.total = _bucket()
        self.by_depth: dict[str, dict[str, Any]] = {}
        self.by_model: dict[str, dict[str, Any]] = {}

    def add(self, depth: int, model: str, prompt, completion) -> None:
        """One model call (its cost unknown here)."""
        for b in (
            self.total,
            self.by_depth.setdefault(str(depth), _bucket()),
            self.by_model.setdefault(model or "(unknown)", _bucket()),
        ):
            _add(b, prompt, completion, 1, None)

    def merge(self, usage: Mapping) -> None:
        """Add a usage record (this shape, e.g. a root's ``metadata["usage"]``)."""
        parts = [(self.total, usage.get("total") or {})]
        parts += [
            (self.by_depth.setdefault(str(k), _bucket()), v) for k, v in (usage.get("by_depth") or {}).items()
        ]
        parts += [
            (self.by_model.setdefault(str(k), _bucket()), v) for k, v in (usage.get("by_model") or {}).items()
        ]
        for b, v in parts:
            _add(b, v.get("prompt_tokens"), v.get("completion_tokens"), v.get("calls"), v.get("cost_usd"))

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "by_depth": self.by_depth, "by_model": self.by_model}

    @classmethod
    def of_tree(cls, trajectories: Iterable[Trajectory]) -> _Usage:
        """Summed from the turns' ``usage`` (or token ids) and the sub-calls' ``usage`` (no cost)."""
        u = cls()
        for t in trajectories:
            for turn, (request, _, completion) in zip(t.turns, _turn_tokens(t.turns)):
                u.add(t.depth, (turn.usage or {}).get("model", ""), request, completion)
            for rec in _subcalls(t):
                su = rec.get("usage")
                if isinstance(su, Mapping):
                    u.add(
                        t.depth + 1, su.get("model", ""), su.get("prompt_tokens"), su.get("completion_tokens")
                    )
        u.total["cost_usd"] = None  # no price table here (even for a tree without calls)
        return u


def _usage_table(usage: Mapping, source: str) -> str:
    """A table of a usage record (``total`` / ``by_depth`` / ``by_model``); ``source`` says where it came from."""
    rows = [("total", usage.get("total") or {})]
    rows += [
        (f"depth {k}", v) for k, v in sorted((usage.get("by_depth") or {}).items(), key=lambda kv: int(kv[0]))
    ]
    rows += [(f"model {k}", v) for k, v in sorted((usage.get("by_model") or {}).items())]
    body = "".join(
        f"<tr><th>{_e(name)}</th><td class='n'>{_n(v.get('prompt_tokens'))}</td>"
        f"<td class='n'>{_n(v.get('completion_tokens'))}</td><td class='n'>{_n(v.get('calls'))}</td>"
        f"<td class='n'>{_cost(v.get('cost_usd'))}</td></tr>"
        for name, v in rows
    )
    return (
        f"<table class='usage' data-source='{source}'><tr><th></th><th>prompt tokens</th>"
        f"<th>completion tokens</th><th>calls</th><th>cost</th></tr>{body}</table>"
    )


def _cost(usd) -> str:
    return "" if usd is None else f"${float(usd):.4f}"


def _subcalls(t: Trajectory) -> list[dict]:
    return t.metadata.get("subcalls", []) if isinstance(t.metadata, dict) else []


def _call_name(rec: Mapping) -> str:
    """``llm_query``, ``rlm_query``, ... or ``tool <name>``."""
    return f"{rec.get('kind')} {rec['name']}" if rec.get("name") else str(rec.get("kind"))


# --------------------------------------------------------------------------------------------------
# The page


class _Page:
    def __init__(self, trajectories: Sequence[Trajectory]):
        self.by_id: dict[str, Trajectory] = {}
        for t in trajectories:
            self.by_id.setdefault(t.id, t)
        self.roots = [t for t in self.by_id.values() if t.parent_id is None or t.parent_id not in self.by_id]
        self.rendered: set[str] = set()

    def tree(self, t: Trajectory) -> list[Trajectory]:
        """``t`` and its descendants present on the page."""
        out = [t]
        for c in t.children:
            if c in self.by_id:
                out += self.tree(self.by_id[c])
        return out

    def usage(self, root: Trajectory) -> tuple[Mapping, str]:
        """(root's tree usage, "recorded" or "computed")."""
        recorded = root.metadata.get("usage") if isinstance(root.metadata, dict) else None
        if isinstance(recorded, Mapping) and "total" in recorded:
            return recorded, "recorded"
        return _Usage.of_tree(self.tree(root)).to_dict(), "computed"

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
        subcalls = _subcalls(t)
        tokens = _turn_tokens(t.turns)
        prompt_in = sum(r or 0 for r, _, _ in tokens)
        out = sum(c or 0 for _, _, c in tokens)
        cut = sum(turn.finish_reason == "length" for turn in t.turns)
        head = (
            f"<summary><b>{_e(t.id)}</b><span class='badge {t.status}'>{t.status}</span>"
            + _badge(f"depth {t.depth}")
            + _badge(f"{len(t.turns)} turns")
            + _badge(f"{len(subcalls)} sub-calls")
            + _badge(f"turns: {prompt_in:,} in / {out:,} out tok", "tokens")
            + (_badge(f"{cut} response(s) cut at max_new_tokens", "cut") if cut else "")
            + (_badge("stopped by its budget", "cut") if t.status == "budget" else "")
            + (_badge(_secs(t.timings["total_s"])) if "total_s" in t.timings else "")
            + f" {_e(_short(t.query, 100))}</summary>"
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
            label = "stopped by its budget" if t.status == "budget" else "error"
            parts.append(f"<div class='label'>{label}</div><pre class='error'>{_e(t.error)}</pre>")
        if t.depth == 0 or t.parent_id not in self.by_id:
            usage, source = self.usage(t)
            note = "recorded by the agent" if source == "recorded" else "summed from the turns and sub-calls"
            parts.append(
                f"<div class='label'>usage of this call tree ({note})</div>" + _usage_table(usage, source)
            )
        for turn, tok in zip(t.turns, tokens):
            parts.append(self.seen(turn, tok[1]))
            # records are appended as calls end; show them in the order they started
            calls = sorted(
                (s for s in subcalls if s.get("turn") == turn.index), key=lambda s: s.get("start_s", 0.0)
            )
            parts.append(self.turn(turn, tok, calls, open_))
        leftover = [c for c in t.children if c in self.by_id and c not in self.rendered]
        for c in leftover:
            parts.append(self.trajectory(self.by_id[c], open_=False))
        cls = f"traj depth-{t.depth} status-{t.status}"
        return (
            f"<details class='{cls}' id='{_anchor(t.id)}' data-status='{_e(t.status)}' data-depth='{t.depth}'"
            f"{' open' if open_ else ''}>{head}{''.join(parts)}</details>"
        )

    def seen(self, turn: TrajectoryTurn, new_tokens: int | None) -> str:
        """What the model saw before ``turn`` (collapsed: the first one holds the whole system prompt)."""
        k = turn.index
        what = (
            "the initial prompt (system prompt and query)"
            if k == 0
            else f"the observation of turn {k}'s code, with the chat-template text"
        )
        cut = _cut_chars(turn.prompt_text, _RECORD_CUT) + _cut_chars(turn.prompt_text, _SANDBOX_CUT)
        head = (
            f"<summary>What the model saw before turn {k + 1}: {what}"
            + (_badge(f"{_n(new_tokens)} tok", "tokens") if new_tokens is not None else "")
            + (_badge(f"observation truncated ({cut:,} chars cut)", "cut") if cut else "")
            + "</summary>"
        )
        return f"<details class='seen' data-turn='{k}'>{head}<pre class='seen'>{_e(turn.prompt_text)}</pre></details>"

    def turn(self, turn: TrajectoryTurn, tokens: tuple, calls: list[dict], open_: bool = False) -> str:
        tm = turn.timings or {}
        request, new, completion = tokens
        cut_out = sum(_output_cut(r) for r in turn.code_results)
        head = (
            f"<summary>Turn {turn.index + 1}"
            + _badge(
                f"in {_n(request)} tok"
                + (f" ({_n(new)} new)" if new is not None else "")
                + f" / out {_n(completion)}",
                "tokens",
            )
            + (_badge("response cut at max_new_tokens", "cut") if turn.finish_reason == "length" else "")
            + (_badge(f"output truncated ({cut_out:,} chars cut)", "cut") if cut_out else "")
            + (_badge("forced final answer (iterations spent)", "cut") if tm.get("forced_final") else "")
            + "".join(_badge(f"{k[:-2]} {_secs(tm[k])}") for k in ("gen_s", "exec_s") if k in tm)
            + _badge(f"{len(turn.code_results)} blocks")
            + (_badge(f"{len(turn.child_ids)} children") if turn.child_ids else "")
            + (_badge("FINAL line") if turn.final else "")
            + "</summary>"
        )
        model = (turn.usage or {}).get("model")
        parts = [
            "<div class='label'>model response"
            + (f" &middot; {_e(model)}" if model else "")
            + (f" &middot; finish {_e(turn.finish_reason)}" if turn.finish_reason else "")
            + "</div>",
            _response(turn),
        ]
        if turn.final is not None:
            f = turn.final
            arg = f.answer if f.kind == "FINAL" else f.var_name
            parts.append(f"<div class='answer'>{_e(f.kind)}({_e(arg)}) on its own line</div>")
        if calls:
            parts.append(_subcall_table(calls))
        for cid in turn.child_ids:
            if cid in self.by_id and cid not in self.rendered:
                parts.append(self.trajectory(self.by_id[cid], open_=False))
        return f"<details class='turn' data-turn='{turn.index}'{' open' if open_ else ''}>{head}{''.join(parts)}</details>"


def _output_cut(r: CodeResult) -> int:
    return sum(_cut_chars(x, _SANDBOX_CUT) for x in (r.stdout, r.stderr, r.error))


def _block(i: int, r: CodeResult, note: str = "") -> str:
    """One executed block: its code, then what it printed (the code appears here only)."""
    cut = _output_cut(r)
    parts = [
        f"<div class='label'>block {i} &middot; {_secs(r.elapsed_s)}"
        + (" &middot; timed out" if r.timed_out else "")
        + (f" &middot; {note}" if note else "")
        + "</div>"
        f"<pre class='code'>{_e(r.code)}</pre>"
    ]
    if cut:
        parts.append(_badge(f"output truncated by the sandbox ({cut:,} chars cut)", "cut"))
    if r.stdout:
        parts.append(f"<pre class='stdout'>{_e(r.stdout)}</pre>")
    if r.stderr:
        parts.append(f"<pre class='stderr'>{_e(r.stderr)}</pre>")
    if r.error:
        parts.append(f"<pre class='error'>{_e(r.error)}</pre>")
    if r.final_answer is not None:
        parts.append(f"<div class='answer'>FINAL: {_e(r.final_answer)}</div>")
    return f"<div class='block'>{''.join(parts)}</div>"


def _response(turn: TrajectoryTurn) -> str:
    """The response in order, each fenced block replaced by the block that ran it (its code and output), so
    code appears once. A fence whose code matches no run block is shown as not run; blocks the agent ran
    without a fence (e.g. resolving a ``FINAL_VAR`` line) follow at the end."""
    results = list(turn.code_results)
    j = 0
    parts: list[str] = []
    for kind, seg in scan_fences(turn.response_text or ""):
        if kind == "text":
            text = seg.strip("\n")
            if text.strip():
                parts.append(f"<pre class='response'>{_e(text)}</pre>")
            continue
        code = textwrap.dedent(seg).strip()
        if j < len(results) and code and code == results[j].code.strip():
            parts.append(_block(j + 1, results[j]))
            j += 1
        elif kind == "open":
            parts.append(
                "<div class='label'>unterminated repl block, not run</div>"
                f"<pre class='code not-run'>{_e(seg)}</pre>"
            )
        else:
            parts.append(
                f"<div class='label'>fenced block, not run</div><pre class='code not-run'>{_e(seg)}</pre>"
            )
    for k in range(j, len(results)):
        parts.append(_block(k + 1, results[k], note="run by the agent"))
    return "".join(parts) or "<pre class='response'>(empty response)</pre>"


def _subcall_table(calls: list[dict]) -> str:
    rows = []
    for c in calls:
        u = c.get("usage") if isinstance(c.get("usage"), Mapping) else None
        tokens = (
            f"{_n(u.get('prompt_tokens'))} in / {_n(u.get('completion_tokens'))} out"
            + (f" &middot; {_e(u.get('model'))}" if u.get("model") else "")
            if u
            else "&ndash;"
        )
        cut = sum(_cut_chars(c.get(k), _RECORD_CUT) for k in ("prompt", "response"))
        response = c.get("response")
        error = c.get("error")
        rows.append(
            f"<tr data-kind='{_e(c.get('kind'))}'><td>{_e(_call_name(c))}"
            + (_badge(f"record cut ({cut:,} chars)", "cut") if cut else "")
            + f"</td><td><pre>{_e(c.get('prompt'))}</pre></td>"
            f"<td><pre>{_e(response)}</pre>"
            + (f"<pre class='error'>{_e(error)}</pre>" if error and error != response else "")
            + f"</td><td>{tokens}</td><td>{_secs(c.get('elapsed_s'))}</td><td>{_link(c.get('child_id'))}</td></tr>"
        )
    return (
        "<div class='label'>sub-calls and tool calls</div><table class='subcalls'><tr><th>kind</th>"
        "<th>prompt / arguments</th><th>response</th><th>tokens</th><th>time</th><th>child</th></tr>"
        + "".join(rows)
        + "</table>"
    )


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
    run = _Usage()
    sources = set()
    for r in roots:
        usage, source = page.usage(r)
        run.merge(usage)
        sources.add(source)
    outline = "".join(page.outline(t) for t in roots)
    body = "".join(page.trajectory(t, open_=len(roots) <= 3) for t in roots)
    options = "".join(f"<option value='{_e(s)}'>{_e(s)}</option>" for s in statuses)
    total = run.total
    data = json.dumps(
        {"roots": len(roots), "trajectories": n_all, "finished": finished, "usage": run.to_dict()}
    )
    note = {
        frozenset({"recorded"}): "recorded by the agent",
        frozenset({"computed"}): "summed from the turns and sub-calls",
    }.get(frozenset(sources), "recorded by the agent where present, else summed from the turns and sub-calls")
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{_e(title)}</h1>"
        f"<div class='stats' id='stats' data-summary='{_e(data)}'>{len(roots)} roots, {n_all} trajectories "
        f"({n_all - len(roots)} child calls), {finished} finished &middot; showing <span id='shown'>"
        f"{len(roots)}</span> &middot; <span id='run-tokens'>{total['prompt_tokens']:,} prompt + "
        f"{total['completion_tokens']:,} completion tokens in {total['calls']:,} model calls</span></div>"
        "<div class='toolbar'><select id='status-filter'><option value='all'>all statuses</option>"
        f"{options}</select><button id='expand'>expand all</button><button id='collapse'>collapse all</button>"
        "</div>"
        f"<h2>Usage of the run</h2><div class='label'>{note}</div><div id='run-usage'>"
        f"{_usage_table(run.to_dict(), 'run')}</div>"
        f"<h2>Call tree</h2><ul class='tree' id='outline'>{outline}</ul>"
        f"<h2>Trajectories</h2><div id='trajectories'>{body}</div>"
        f"<script>{_JS}</script></body></html>"
    )


def _is_paths(x: object) -> TypeIs[str | os.PathLike | Sequence[str | os.PathLike]]:
    """Whether ``write_html`` reads ``x`` as JSONL path(s): one path, or a non-empty list or tuple whose
    first item is a path (anything else is taken as the trajectories themselves)."""
    return isinstance(x, (str, os.PathLike)) or (
        isinstance(x, (list, tuple)) and bool(x) and isinstance(x[0], (str, os.PathLike))
    )


def write_html(
    trajectories: Iterable[Trajectory] | str | os.PathLike | Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    title: str = "RLM trajectories",
) -> str:
    """Render ``trajectories`` (or JSONL path(s)) to ``out_path``; returns the path."""
    if _is_paths(trajectories):
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
