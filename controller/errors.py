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
        process: str = "",
    ):
        self.role, self.rank, self.method = role, rank, method
        self.reason, self.kind = reason, kind
        self.remote_traceback = _ANSI.sub("", remote_traceback)
        self.process = process  # for a death: the lost process, its pool and every role it held
        super().__init__(self._message())

    def _message(self) -> str:
        msg = self.summary()
        if self.remote_traceback:
            msg += f"\n--- remote ({self.role} rank {self.rank}) ---\n{self.remote_traceback}"
        return msg

    def name_process(self, process: str) -> None:
        """Say which process died (``RayWorkerGroup.process_of``): the role that saw the death first is only one
        of the roles a colocated process held."""
        self.process = process
        self.args = (self._message(),)

    @property
    def is_fault(self) -> bool:
        """The worker died or hung (not: raised), so a fresh worker may well succeed."""
        return self.kind in ("died", "timeout")

    def summary(self) -> str:
        """One line: who failed where and why (no traceback)."""
        where = f"rank {self.rank}" if self.rank is not None else "group"
        line = f"worker group {self.role!r} {where} failed in {self.method!r}: {self.reason}"
        return f"{line}; {self.process}" if self.process else line

    def __reduce__(self):
        args = (
            self.role,
            self.rank,
            self.method,
            self.reason,
            self.remote_traceback,
            self.kind,
            self.process,
        )
        return type(self), args


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
