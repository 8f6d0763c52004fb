"""A block's output and errors in the REPL process: stdout / stderr captured with a cap (Python-level
writes, then what was written to the fds themselves), and the traceback of the user's own frames.

Standard library only; a module of the zygote (see ``_child.py``).
"""

import io
import os
import traceback


class _Capture(io.TextIOBase):
    """sys.stdout / sys.stderr of a REPL step: counts everything, keeps only the first ``limit``
    characters, so a huge print costs no memory and never reaches the host."""

    def __init__(self, limit: int, fd: int):
        super().__init__()
        self.limit, self.fd = limit, fd
        self.parts: list[str] = []
        self.kept = 0
        self.total = 0

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        n = len(s)
        self.total += n
        room = self.limit - self.kept
        if room > 0:
            piece = s[:room]
            self.parts.append(piece)
            self.kept += len(piece)
        return n

    def writable(self):
        return True

    def isatty(self):
        return False

    def fileno(self):
        return self.fd

    # typeshed declares TextIOBase.encoding / .errors as writable attributes; in CPython they are
    # read-only properties, as here
    @property
    def encoding(self):  # type: ignore[override]
        return "utf-8"

    @property
    def errors(self):  # type: ignore[override]
        return "strict"

    @property
    def buffer(self):
        return _BytesToText(self)

    def text(self) -> str:
        return "".join(self.parts)


class _BytesToText:
    def __init__(self, target: _Capture):
        self.target = target

    def write(self, b) -> int:
        self.target.write(bytes(b).decode("utf-8", "replace"))
        return len(b)

    def flush(self) -> None:
        pass


def _truncate(text: str, total: int, limit: int) -> str:
    if total <= limit and len(text) <= limit:
        return text
    return text[:limit] + f"\n... [truncated {max(total, len(text)) - limit} chars]"


def _drain(capture: _Capture, stream, limit: int) -> tuple[str, int]:
    """Python-level output of a step followed by what was written to the fd itself (subprocesses,
    C code, sys.__stdout__); returns (kept text, total length in characters, approximately for
    multi-byte fd output)."""
    fd = capture.fd
    try:
        stream.flush()
    except Exception:
        pass
    text, total = capture.text(), capture.total
    try:
        size = os.fstat(fd).st_size
        if size:
            want = max(0, limit - len(text)) * 4 + 4
            raw = os.pread(fd, min(size, want), 0)
            extra = raw.decode("utf-8", "replace")
            text += extra
            total += len(extra) + (size - len(raw))
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        pass
    return text, total


def _format_exception(exc: BaseException) -> str:
    try:
        tb = exc.__traceback__
        # Drop the runtime's own frames: keep the frames from the first user cell on.
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<repl-"):
            tb = tb.tb_next
        return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()
    except BaseException:  # noqa: B036 - a hostile __str__ must not take the runtime down
        return f"{type(exc).__name__} (the exception could not be formatted)"
