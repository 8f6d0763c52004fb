"""Wall-clock time of worker-group calls, as seen by the controller (dispatch + compute + collect)."""

from __future__ import annotations


class CallTimings:
    """Per method: seconds of the last call, total seconds and number of calls."""

    def __init__(self):
        self.last: dict[str, float] = {}
        self.total: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def record(self, method: str, seconds: float) -> None:
        self.last[method] = seconds
        self.total[method] = self.total.get(method, 0.0) + seconds
        self.count[method] = self.count.get(method, 0) + 1

    def metrics(self, prefix: str = "timing_s/") -> dict[str, float]:
        """``{prefix + method: seconds of the last call}``, ready to log next to the step's metrics."""
        return {f"{prefix}{method}": seconds for method, seconds in self.last.items()}

    def mean(self, method: str) -> float:
        if method not in self.count:
            raise KeyError(f"no timed calls of {method!r}; timed: {sorted(self.count)}")
        return self.total[method] / self.count[method]

    def reset(self) -> None:
        self.last.clear()
        self.total.clear()
        self.count.clear()

    def __repr__(self) -> str:
        return f"CallTimings(last={self.last}, count={self.count})"
