"""Errors a worker-group call raises on the controller."""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class WorkerGroupError(RuntimeError):
    """A worker raised, died or timed out during a group call.

    ``role`` is the group's name (its name_prefix), ``rank`` the first failing rank, ``method`` the
    worker method, ``remote_traceback`` the worker-side traceback (or Ray's death report). ``kind`` says what
    happened: ``raised`` (the method raised), ``died`` (the process is gone: killed, out of memory),
    ``constructor`` (it raised while starting), ``timeout`` (no answer in time), ``ray`` (another Ray error),
    ``mismatch`` (the ranks' results disagree). A death or a timeout is a fault a restart can mend
    (``is_fault``); a raised error would only be raised again.
    """

    def __init__(
        self,
        role: str,
        rank: int | None,
        method: str,
        reason: str,
        remote_traceback: str = "",
        kind: str = "raised",
    ):
        self.role, self.rank, self.method = role, rank, method
        self.reason, self.kind = reason, kind
        self.remote_traceback = _ANSI.sub("", remote_traceback)
        msg = self.summary()
        if self.remote_traceback:
            msg += f"\n--- remote ({role} rank {rank}) ---\n{self.remote_traceback}"
        super().__init__(msg)

    @property
    def is_fault(self) -> bool:
        """The worker died or hung (not: raised), so a fresh worker may well succeed."""
        return self.kind in ("died", "timeout")

    def summary(self) -> str:
        """One line: who failed where and why (no traceback)."""
        where = f"rank {self.rank}" if self.rank is not None else "group"
        return f"worker group {self.role!r} {where} failed in {self.method!r}: {self.reason}"

    def __reduce__(self):
        return type(self), (self.role, self.rank, self.method, self.reason, self.remote_traceback, self.kind)


class WorkerGroupTimeoutError(WorkerGroupError):
    """Some ranks did not answer within the call's timeout."""

    def __init__(
        self,
        role: str,
        method: str,
        pending_ranks: list[int],
        timeout_s: float,
        elapsed_s: float | None = None,
    ):
        self.pending_ranks = list(pending_ranks)
        self.timeout_s = timeout_s
        self.elapsed_s = timeout_s if elapsed_s is None else elapsed_s
        super().__init__(
            role,
            self.pending_ranks[0] if self.pending_ranks else None,
            method,
            f"no result after {timeout_s:g}s from rank(s) {self.pending_ranks}, still running "
            f"{method!r} {self.elapsed_s:.1f}s after the call started",
            kind="timeout",
        )

    def __reduce__(self):
        return type(self), (self.role, self.method, self.pending_ranks, self.timeout_s, self.elapsed_s)


class DispatchError(ValueError):
    """The arguments of a group call cannot be dispatched (wrong type, length, mesh info...)."""
