"""The host's side of the REPL protocol, where everything a REPL sends is untrusted: the init message a
REPL is created with, frames cut from its byte stream, its variable listings and results turned into
an :class:`ExecResult`, the zygote's exit notices turned into a cause, and the channel's failures.
"""

import signal
from dataclasses import dataclass
from typing import Any

from workers.sandbox import _wire
from workers.sandbox._repl_namespace import MAX_VARS_LISTED
from workers.sandbox.config import ExecResult, SandboxConfig
from workers.sandbox.tools import Tool, ToolSpec


class _Timeout(Exception):
    pass


class _Died(Exception):
    pass


class _ProtocolError(Exception):
    pass


@dataclass(frozen=True)
class _ReplSpec:
    """What a REPL is created with (and re-created with after a kill)."""

    context: Any
    contexts: list | None
    setup_vars: dict
    tools: dict[str, ToolSpec]
    setup_code: str | None

    def init_message(self) -> dict:
        return {
            "op": "init",
            "context": self.context,
            "contexts": self.contexts,
            "setup_vars": self.setup_vars,
            "tools": [
                {"name": n, "doc": f"{t.signature(n)}\n\n{t.doc()}".strip()}
                for n, t in self.tools.items()
                if isinstance(t, Tool)
            ],
            "constants": {n: t.value for n, t in self.tools.items() if not isinstance(t, Tool)},
            "setup_code": self.setup_code,
        }

    @property
    def tool_context(self) -> Any:
        """What a ``pass_context`` tool gets: the context; several as ``{"context_0": c0, ...}``."""
        if self.contexts is None:
            return self.context
        return {f"context_{i}": c for i, c in enumerate(self.contexts)}


class _FrameBuffer:
    """Frames cut from a REPL's byte stream, each bounded before it is parsed: its size (refused from
    its header, before its bytes are read), then its items and nesting (``_wire.bounds_error``), so that
    what a REPL sends never costs the host more than ``max_bytes`` and one parse of that size."""

    def __init__(self, max_bytes: int = _wire.MAX_FRAME):
        self.max_bytes = max_bytes
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data

    def take(self):
        if len(self.buf) < 4:
            return None
        n = int.from_bytes(self.buf[:4], "big")
        if n > self.max_bytes:
            raise _ProtocolError(
                f"the REPL's message of {n / 2**20:.1f} MiB was refused: over the limit of "
                f"{self.max_bytes / 2**20:g} MiB on a message to the host (SandboxConfig.max_message_mb)"
            )
        if len(self.buf) < 4 + n:
            return None
        raw = bytes(memoryview(self.buf)[4 : 4 + n])
        del self.buf[: 4 + n]
        why = _wire.bounds_error(raw)
        if why is not None:
            raise _ProtocolError(f"the REPL's message was refused: {why}")
        try:
            msg = _wire.decode_payload(raw)
        except (ValueError, RecursionError) as exc:
            raise _ProtocolError(f"the REPL sent malformed JSON ({exc})") from None
        if not isinstance(msg, dict):
            raise _ProtocolError("the REPL sent a message that is not an object")
        return msg


def _variables(raw: Any) -> list[tuple[str, str]]:
    """(name, type) pairs from a REPL's (untrusted) variable listing."""
    out = []
    if isinstance(raw, list):
        for item in raw[:MAX_VARS_LISTED]:
            if isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item):
                out.append((item[0][:200], item[1][:200]))
    return out


FAULT_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGSYS)


def _describe_exit(info: dict | None, cpu_s: int) -> str:
    """The REPL process's end, with its cause: a limit (the process's CPU time at death, from the
    zygote's wait4), the kernel's OOM killer (the machine's kill count rose meanwhile), a fault of the process,
    or else a signal sent from inside the sandbox (the sandbox's own kills are never reported here)."""
    if not info:
        return "it closed its channel to the host"
    if info.get("zygote_died"):
        return "the sandbox's zygote process died"
    sig = info.get("signal")
    if sig is None:
        return f"it exited with code {info.get('code')}"
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
    used = info.get("cpu_s")
    if sig == signal.SIGXCPU:
        return f"killed by {name}: CPU time limit of {cpu_s} s exceeded"
    if sig == signal.SIGXFSZ:
        return f"killed by {name}: file size limit exceeded"
    # The CPU time is the process's own; the OOM count is the whole machine's (another process's OOM
    # kill raises it too), so a process that reached its CPU limit is reported for that first.
    if sig == signal.SIGKILL and used is not None and used >= cpu_s:
        return f"killed by {name}: CPU hard limit of {cpu_s + 1} s exceeded ({used:g} s used)"
    if sig == signal.SIGKILL and info.get("oom_kills"):
        return f"killed by {name}: the kernel's out-of-memory killer ran while it lived"
    if sig in FAULT_SIGNALS:
        return f"killed by {name} (a fault or abort in the process itself, e.g. a bad pointer from ctypes)"
    sender = "its own code" if info.get("uid_separation") else "its own code or another REPL of its uid"
    cpu = f"{used:g} s of CPU used of {cpu_s} s" if used is not None else "CPU use unknown"
    return (
        f"killed by {name}, sent from inside the sandbox by {sender} (e.g. os.kill or os.killpg on itself "
        f"or its process group); not a limit ({cpu}, no out-of-memory kill)"
    )


def _exec_result(msg: dict, notice: str | None, config: SandboxConfig) -> ExecResult:
    """The ExecResult of a REPL's result message (texts capped, made UTF-8 safe); ``notice`` goes first
    in its stderr and marks it restarted."""
    limit = config.max_output_chars

    def text(key, cap):
        v = msg.get(key)
        if not isinstance(v, str):
            return ""
        if len(v) > cap + 64:
            v = v[:cap] + f"\n... [truncated {len(v) - cap} chars]"
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: make the text safe for tokenizers and JSON
            v = v.encode("utf-8", "replace").decode("utf-8")
        return v

    variables = _variables(msg.get("variables"))
    error = msg.get("error")
    error = text("error", limit) if isinstance(error, str) else None
    answer = msg.get("final_answer")
    answer = text("final_answer", config.max_answer_chars) if isinstance(answer, str) else None
    stderr = text("stderr", limit)
    if notice:
        stderr = notice + ("\n" + stderr if stderr else "")
    return ExecResult(
        stdout=text("stdout", limit),
        stderr=stderr,
        error=error,
        restarted=notice is not None,
        variables=variables,
        final_answer=answer,
    )
