"""Token usage and cost of an RLM run, per call, per depth and per model.

Every model call is recorded where it happened: a turn's ``turn.usage``, a sub-call's
``traj.metadata["subcalls"][i]["usage"]`` and a compaction's ``traj.metadata["compactions"][i]["usage"]``
(all ``{"prompt_tokens", "completion_tokens", "model"}``; ``prompt_tokens`` is the whole request, as a
provider bills it). :func:`tree_usage` sums them over a run's trajectories: ``total``, ``by_depth`` and
``by_model``, each a :class:`UsageTotals` (prompt and completion tokens, calls, and ``cost_usd`` under a price
table -- None without one, or when a model has no price).

Depth is where the call sits in the tree: a trajectory's turns count at its depth, its ``llm_query`` calls (and
an ``rlm_query`` at the depth cap, which is one) one level below, as a child agent's turns would.

The root stores ``Usage.to_dict()`` as ``root.metadata["usage"]`` (JSON keys: ``total``, ``by_depth`` with
string depths, ``by_model``); ``Usage.from_dict`` reads it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.agents.limits import Prices, call_cost
from workers.agents.trajectory import Trajectory

__all__ = ["Usage", "UsageTotals", "calls_of", "tree_usage"]


@dataclass
class UsageTotals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0
    cost_usd: float | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, prompt_tokens: int, completion_tokens: int, cost: float | None) -> None:
        """Count one call; ``cost`` None (no price) makes ``cost_usd`` None for good: the sum is unknown."""
        first = self.calls == 0
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.calls += 1
        if cost is None:
            self.cost_usd = None
        elif first:
            self.cost_usd = cost
        elif self.cost_usd is not None:
            self.cost_usd += cost

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "calls": self.calls,
            "cost_usd": self.cost_usd,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> UsageTotals:
        return cls(int(d["prompt_tokens"]), int(d["completion_tokens"]), int(d["calls"]), d.get("cost_usd"))


@dataclass
class Usage:
    """A run's usage: ``total``, ``by_depth`` (int depth -> totals) and ``by_model`` (name -> totals)."""

    total: UsageTotals = field(default_factory=UsageTotals)
    by_depth: dict[int, UsageTotals] = field(default_factory=dict)
    by_model: dict[str, UsageTotals] = field(default_factory=dict)

    @property
    def cost_usd(self) -> float | None:
        return self.total.cost_usd

    @property
    def total_tokens(self) -> int:
        return self.total.total_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total.to_dict(),
            "by_depth": {str(d): t.to_dict() for d, t in sorted(self.by_depth.items())},
            "by_model": {m: t.to_dict() for m, t in self.by_model.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Usage:
        return cls(
            UsageTotals.from_dict(d["total"]),
            {int(k): UsageTotals.from_dict(v) for k, v in d.get("by_depth", {}).items()},
            {str(k): UsageTotals.from_dict(v) for k, v in d.get("by_model", {}).items()},
        )


def calls_of(traj: Trajectory) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """``(depth, usage)`` of every model call ``traj`` made: its turns, the summary calls that compacted its
    conversation (a persistent session's ``metadata["compactions"]``), then its sub-calls that reached a model."""
    for turn in traj.turns:
        if turn.usage:
            yield traj.depth, turn.usage
    for record in traj.metadata.get("compactions", []):
        if record.get("usage"):
            yield traj.depth, record["usage"]
    for record in traj.metadata.get("subcalls", []):
        if record.get("usage"):
            yield traj.depth + 1, record["usage"]


def tree_usage(trajectories: Iterable[Trajectory], prices: Prices | None = None) -> Usage:
    """Sum the usage of every model call of ``trajectories`` (a run's whole tree); costs under ``prices``."""
    usage = Usage()
    for traj in trajectories:
        for depth, u in calls_of(traj):
            p, c, model = (
                int(u.get("prompt_tokens", 0)),
                int(u.get("completion_tokens", 0)),
                str(u.get("model", "")),
            )
            cost = call_cost(prices, model, p, c) if prices else None
            buckets = (
                usage.total,
                usage.by_depth.setdefault(depth, UsageTotals()),
                usage.by_model.setdefault(model, UsageTotals()),
            )
            for bucket in buckets:
                bucket.add(p, c, cost)
    return usage
