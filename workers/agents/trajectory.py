"""The record of a multi-turn agent run, shared by every environment (RLM REPL, math tool, your own).

A :class:`Trajectory` is one agent's run: its turns (:class:`TrajectoryTurn`: the text the model saw since its
previous response, the engine's exact response tokens and log-probs, what the environment ran for it), how it
ended (``status``, one of ``STATUSES``), its final answer, and free-form ``metadata`` an environment fills
(sub-calls, tool statistics, PRM steps). Recursive environments add children: ``depth``, ``parent_id``,
``children``; every trajectory of a tree carries the root prompt's ``root_uid``.
``Trajectory.token_sequence()`` rebuilds the whole token sequence with its loss mask, which
``workers.agents.batch`` turns into training rows. JSONL in and out: ``dump_jsonl`` / ``load_jsonl``.

Pure dataclasses: no sandbox, engine or Ray.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = [
    "STATUSES",
    "CodeResult",
    "FinalCall",
    "Trajectory",
    "TrajectoryTurn",
    "dump_jsonl",
    "load_jsonl",
]

STATUSES = ("running", "finished", "max_iterations", "budget", "error")


@dataclass(frozen=True)
class FinalCall:
    """An answer line outside code: the RLM protocol's ``FINAL(answer)`` / ``FINAL_VAR(name)``
    (``workers.rlm.protocol`` parses it; recorded on the turn that wrote it)."""

    kind: str  # "FINAL" or "FINAL_VAR"
    argument: str  # the raw text between the parentheses
    answer: str | None = None  # FINAL: the answer text
    var_name: str | None = None  # FINAL_VAR: the REPL variable to answer with

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping | None) -> FinalCall | None:
        return None if d is None else cls(**dict(d))


@dataclass
class CodeResult:
    """What running one code block produced (the sandbox fills it; a mapping with these keys works too).

    ``variables`` maps each user variable's name to a short description of its type (``"str"``,
    ``"str, 8000 chars"``; a list of ``[name, type]`` pairs is accepted by ``from_dict``);
    ``final_answer`` is set when the block called FINAL/FINAL_VAR successfully.
    """

    code: str = ""
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    variables: dict[str, str] = field(default_factory=dict)
    final_answer: str | None = None
    elapsed_s: float = 0.0
    timed_out: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of_execution(cls, code: str, res: Any) -> CodeResult:
        """The record of running ``code`` in a sandbox REPL (``res``: its ``workers.sandbox.ExecResult``)."""
        return cls(
            code=code,
            stdout=res.stdout,
            stderr=res.stderr,
            error=res.error,
            variables={str(n): str(t) for n, t in res.variables},
            final_answer=res.final_answer,
            elapsed_s=res.elapsed_s,
            timed_out=res.timed_out,
        )

    @classmethod
    def from_dict(cls, d: Mapping) -> CodeResult:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        variables = known.get("variables")
        if variables is not None and not isinstance(variables, Mapping):
            known["variables"] = {str(v[0]): str(v[1]) for v in variables}
        return cls(**known)


@dataclass
class TrajectoryTurn:
    """One model turn: the text shown before it, the engine's response, what its code did.

    ``prompt_text`` is what the model saw since its previous response (the initial chat prompt for
    turn 0, the observation plus chat-template text after that) and ``prompt_token_ids`` its
    tokens; ``response_token_ids`` / ``response_logprobs`` / ``response_versions`` are exactly what the
    engine produced (the versions: of the weights that sampled each token, when the engine tracks them).
    """

    index: int
    prompt_text: str = ""
    response_text: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    response_token_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[int] = field(default_factory=list)  # weight version per token (async RL)
    code_results: list[CodeResult] = field(default_factory=list)
    final: FinalCall | None = None  # the answer line outside code, if any (RLM)
    child_ids: list[str] = field(default_factory=list)  # child agents started by this turn (RLM)
    timings: dict[str, float] = field(default_factory=dict)  # e.g. gen_s, exec_s
    # the call's usage: {"prompt_tokens": whole request, "completion_tokens": response, "model": name}
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = ""  # the engine's: "stop", "length" (the response was cut at max_new_tokens), ...
    # ``prompt_token_ids`` is the whole prompt the engine was fed, not a continuation of the previous turn: the
    # chat template rewrote the history (``workers.agents.chat_format``), so this turn starts a new segment
    full_prompt: bool = False
    # mixture of experts: the engine's expert routes of the call's whole prompt and response ([prompt + response
    # - 1, layers, k], `GenerationOutput.routes`); None for a dense model. Kept out of to_dict (no JSON log needs it)
    routes: Any = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict:
        d = asdict(replace(self, routes=None))
        d.pop("routes")
        d["response_token_ids"] = [int(t) for t in self.response_token_ids]
        d["prompt_token_ids"] = [int(t) for t in self.prompt_token_ids]
        d["response_logprobs"] = [float(x) for x in self.response_logprobs]
        d["response_versions"] = [int(v) for v in self.response_versions]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> TrajectoryTurn:
        d = dict(d)
        d["code_results"] = [CodeResult.from_dict(r) for r in d.get("code_results", [])]
        d["final"] = FinalCall.from_dict(d.get("final"))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class Trajectory:
    """One agent's run: a root (depth 0) or, in a recursive environment (RLM's ``rlm_query``), a child.

    ``root_uid`` is the uid of the root prompt in the RL batch (children inherit it); ``children``
    lists child trajectory ids in start order; ``status`` is one of ``STATUSES``.
    """

    id: str
    query: str
    root_uid: str = ""
    depth: int = 0
    parent_id: str | None = None
    turns: list[TrajectoryTurn] = field(default_factory=list)
    final_answer: str | None = None
    status: str = "running"
    children: list[str] = field(default_factory=list)
    error: str | None = None
    context_info: dict[str, Any] = field(default_factory=dict)  # e.g. {"type": "str", "length": 8000}
    metadata: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["turns"] = [t.to_dict() for t in self.turns]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> Trajectory:
        d = dict(d)
        d["turns"] = [TrajectoryTurn.from_dict(t) for t in d.get("turns", [])]
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        return cls.from_dict(json.loads(line))

    @property
    def rewritten(self) -> bool:
        """Whether a turn after the first was fed a whole new prompt (the template rewrote the history): the
        turns are then no single growing sequence, and train one row per turn (``workers.agents.batch``)."""
        return any(t.full_prompt for t in self.turns[1:])

    def segment_start(self) -> int:
        """The first turn of the last segment: 0, or the last turn fed a whole prompt."""
        return max([k for k, t in enumerate(self.turns) if t.full_prompt] + [0])

    def token_sequence(self) -> tuple[list[int], list[int], list[float]]:
        """(token ids, loss mask, log-probs) of the multi-turn sequence the engine was last fed: the whole
        trajectory, or its last segment when it is ``rewritten``.

        Each turn contributes its prompt tokens (mask 0, log-prob 0.0) then its response tokens
        (mask 1, the engine's log-probs; 0.0 where none were recorded).
        """
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        for t in self.turns[self.segment_start() :]:
            ids += t.prompt_token_ids
            mask += [0] * len(t.prompt_token_ids)
            logprobs += [0.0] * len(t.prompt_token_ids)
            ids += t.response_token_ids
            mask += [1] * len(t.response_token_ids)
            lp = list(t.response_logprobs)
            logprobs += lp + [0.0] * (len(t.response_token_ids) - len(lp))
        return ids, mask, logprobs


def dump_jsonl(trajectories: Iterable[Trajectory], path: str | os.PathLike, append: bool = False) -> str:
    """Write one trajectory per line; returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(t.to_json() + "\n")
    return path


def load_jsonl(path: str | os.PathLike) -> list[Trajectory]:
    with open(os.fspath(path), encoding="utf-8") as f:
        return [Trajectory.from_json(line) for line in f if line.strip()]
