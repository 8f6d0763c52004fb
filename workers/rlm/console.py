"""Live console output of an RLM run: ``RLM(verbose=True)`` prints, as they happen, every trajectory's turns
(the model's text, each code block and its output, truncated), sub-calls (``llm_query``/``rlm_query``, with the
prompt and answer), child trajectories indented by depth, the final answer and a usage line.

`VerbosePrinter` is an ordinary set of callbacks (`workers.rlm.callbacks`) over a `rich` console; pass your own
``Console`` (e.g. ``Console(file=io.StringIO())``) to capture it.
"""

from __future__ import annotations

import re

from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.rule import Rule
from rich.syntax import Syntax
from rich.text import Text

from workers.rlm.callbacks import FinalEvent, IterationEvent, SubcallEvent
from workers.rlm.protocol import truncate

__all__ = ["VerbosePrinter"]

INDENT = 4  # columns per depth level
_FENCE = re.compile(r"```[^\n`]*\n.*?```", re.DOTALL)


class VerbosePrinter:
    """Callbacks that print an RLM run to ``console`` (default: a `rich` console on stdout). ``max_chars``:
    characters shown of a response, a code output, a sub-call prompt or answer."""

    def __init__(self, console: Console | None = None, max_chars: int = 800):
        self.console = console if console is not None else Console()
        self.max_chars = max_chars
        self._headed: dict[str, int] = {}  # trajectory id -> the turn whose header is printed

    def _header(self, trajectory_id: str, depth: int, turn: int, max_turns: int | None) -> None:
        """A turn's header, once: before its sub-calls (they run during the turn's code) or its code."""
        if self._headed.get(trajectory_id) == turn:
            return
        self._headed[trajectory_id] = turn
        where = f"depth {depth} · " if depth else ""
        of = f"/{max_turns}" if max_turns is not None else ""
        self._print(depth, Rule(f"{where}{trajectory_id} · turn {turn + 1}{of}", align="left"))

    def _print(self, depth: int, renderable: RenderableType) -> None:
        self.console.print(Padding(renderable, (0, 0, 0, INDENT * depth)))

    def _cut(self, text: str) -> str:
        return truncate(text.strip(), self.max_chars)

    def on_iteration(self, ev: IterationEvent) -> None:
        self._header(ev.trajectory_id, ev.depth, ev.turn, ev.max_turns)
        said = _FENCE.sub("", ev.response).strip()  # the code is shown below, with its output
        if said:
            self._print(ev.depth, Text(self._cut(said), style="italic"))
        for r in ev.code_results:
            out = "\n".join(x for x in (r.stdout.rstrip(), r.stderr.rstrip()) if x)
            body: list[RenderableType] = [Syntax(r.code, "python", word_wrap=True)]
            if out:
                body.append(Text(self._cut(out), style="dim"))
            if r.error:
                body.append(Text(self._cut(r.error), style="red"))
            self._print(
                ev.depth, Panel.fit(Group(*body), title="code", title_align="left", border_style="blue")
            )
        if ev.final_answer is not None:
            self._print(ev.depth, Text(f"FINAL: {self._cut(ev.final_answer)}", style="bold green"))

    def on_subcall(self, ev: SubcallEvent) -> None:
        rec = ev.record
        self._header(ev.trajectory_id, ev.depth, ev.turn, None)
        what = rec["kind"] + (f" {rec['name']}" if "name" in rec else "")  # a custom tool's name
        child = f" (child {rec['child_id']})" if "child_id" in rec else ""
        line = Text(f"↳ {what}{child}: ", style="cyan")
        line.append(repr(self._cut(str(rec.get("prompt", "")))))
        line.append(" → ", style="cyan")
        line.append(repr(self._cut(str(rec.get("response", "")))), style="red" if "error" in rec else "")
        self._print(ev.depth, line)

    def on_final(self, ev: FinalEvent) -> None:
        answer = "(none)" if ev.answer is None else self._cut(ev.answer)
        if ev.depth > 0:
            style = "green" if ev.status == "finished" else "yellow"
            self._print(ev.depth, Text(f"← {ev.trajectory_id} {ev.status}: {answer}", style=style))
            return
        title = f"Final answer · {ev.status}" + (f" ({ev.error})" if ev.error else "")
        style = "green" if ev.status == "finished" else "yellow"
        self._print(0, Panel(Text(answer), title=title, title_align="left", border_style=style))
        total = ev.usage.total
        cost = f" · ${total.cost_usd:.4f}" if total.cost_usd is not None else ""
        self._print(
            0,
            Text(
                f"usage: {total.prompt_tokens} prompt + {total.completion_tokens} completion tokens in "
                f"{total.calls} model calls{cost} · {ev.turns} root turns · {ev.elapsed_s:.1f} s",
                style="dim",
            ),
        )
