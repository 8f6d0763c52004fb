"""Events an RLM run reports while it goes: ``on_iteration``, ``on_subcall``, ``on_final``.

``RLM(callbacks=Callbacks(on_iteration=[f], on_subcall=[g], on_final=[h]))`` (or ``RLMAgent(...,
callbacks=...)``): each is a plain callable taking one event, called for the root *and* every child trajectory,
in the order things happen:

* `IterationEvent` -- after each model turn has been acted on (its code run): the trajectory's id and depth,
  the turn index, the response text, the code results, the final answer if the turn gave one, the turn's
  token usage, the trajectory's turn cap.
* `SubcallEvent` -- after each ``llm_query`` / ``rlm_query`` from REPL code has its result: the calling
  trajectory, the turn, and the sub-call's record (kind, prompt, response, child id, tokens, error, elapsed).
  A child's own iterations and final event come *before* the ``rlm_query`` event that returns its answer.
* `FinalEvent` -- when a trajectory ends: its status, answer and error, turns, elapsed seconds, and the token
  usage (`workers.rlm.usage.Usage`) of the trajectory and everything below it.

Callbacks run synchronously on the agent's event-loop thread (the RLM's private loop thread for
``completion``), between the agent's steps: keep them quick, and do not block on the run itself. A callback
that raises does not stop the run: its first failure (per event) is reported with ``warnings.warn``, later
ones are ignored.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from workers.agents.trajectory import CodeResult
from workers.rlm.usage import Usage

__all__ = ["Callbacks", "FinalEvent", "IterationEvent", "SubcallEvent"]


@dataclass
class IterationEvent:
    trajectory_id: str
    depth: int
    turn: int  # 0-based index of the turn in its trajectory
    response: str  # the model's text
    code_results: list[CodeResult]
    final_answer: str | None  # set when this turn ended the trajectory with an answer
    usage: dict[str, Any]  # the turn's prompt_tokens, completion_tokens, model
    max_turns: int  # the trajectory's turn cap


@dataclass
class SubcallEvent:
    trajectory_id: str  # the trajectory whose code made the call
    depth: int
    turn: int
    record: dict[str, Any]  # kind, prompt, response, child_id (rlm_query), tokens, error, elapsed_s, ...

    @property
    def kind(self) -> str:
        return self.record["kind"]


@dataclass
class FinalEvent:
    trajectory_id: str
    depth: int
    status: str  # finished / max_iterations / budget / error
    answer: str | None
    error: str | None
    turns: int
    elapsed_s: float
    usage: Usage = field(default_factory=Usage)  # of this trajectory and its descendants (workers.rlm.usage)


Listener = Callable[[Any], Any]


class Callbacks:
    """The listeners of a run, per event: plain callables, and (``add``) objects with any of the methods
    ``on_iteration`` / ``on_subcall`` / ``on_final`` (e.g. the verbose console printer)."""

    def __init__(
        self,
        on_iteration: Iterable[Listener] = (),
        on_subcall: Iterable[Listener] = (),
        on_final: Iterable[Listener] = (),
    ):
        self.listeners: dict[str, list[Listener]] = {
            "on_iteration": list(on_iteration),
            "on_subcall": list(on_subcall),
            "on_final": list(on_final),
        }
        self._warned: set[tuple[str, int]] = set()  # (event, listener) pairs already reported
        for name, fns in self.listeners.items():
            for fn in fns:
                if not callable(fn):
                    raise TypeError(f"{name} must be callable, got {fn!r}")

    def add(self, listener) -> None:
        """Listen with ``listener``'s ``on_iteration`` / ``on_subcall`` / ``on_final`` methods (those it has)."""
        for name, fns in self.listeners.items():
            fn = getattr(listener, name, None)
            if fn is not None:
                fns.append(fn)

    def __bool__(self) -> bool:
        return any(self.listeners.values())

    def iteration(self, event: IterationEvent) -> None:
        self._emit("on_iteration", event)

    def subcall(self, event: SubcallEvent) -> None:
        self._emit("on_subcall", event)

    def final(self, event: FinalEvent) -> None:
        self._emit("on_final", event)

    def _emit(self, name: str, event) -> None:
        for fn in self.listeners[name]:
            try:
                fn(event)
            except Exception as exc:  # a listener's bug must not end the run; say so once per listener
                if (name, id(fn)) not in self._warned:
                    self._warned.add((name, id(fn)))
                    warnings.warn(
                        f"RLM callback {name}={getattr(fn, '__qualname__', fn)!r} raised "
                        f"{type(exc).__name__}: {exc} (the run goes on; later failures of it are not reported)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
