"""The host's handle on one zygote process (the sandbox's fork server): it starts the zygote with its
command line (bubblewrap's argv, or the bare script in the "rlimits" mode), sends it requests over the
control socket and routes its replies and REPL exit notices.
"""

import concurrent.futures
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import cast

from workers.sandbox import _wire
from workers.sandbox.config import SandboxError
from workers.sandbox.isolation import CHILD_SCRIPT, SANDBOX_ENV, SANDBOX_SCRIPT
from workers.sandbox.protocol import _ProtocolError


class _ZygoteClient:
    """One zygote process and its control socket. A reader thread starts the process (so that the
    parent-death signal is tied to a thread that lives exactly as long as the zygote) and routes
    replies to futures and "exited" notices to the watching REPLs."""

    def __init__(self, argv_prefix: list[str], args: dict, mode: str):
        self.argv_prefix, self.args, self.mode = argv_prefix, args, mode
        self.proc: subprocess.Popen | None = None
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self.report: dict = {}
        self.alive = False
        self._send_lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._watchers: dict[tuple[int, int], Callable[[dict], None]] = {}
        self._rid = 0
        self._lock = threading.Lock()
        self._errlog = tempfile.TemporaryFile()
        self.sock, self._child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.thread = threading.Thread(target=self._run, name="repl-sandbox-zygote", daemon=True)

    def start(self, timeout: float) -> dict:
        self.thread.start()
        try:
            return self.ready.result(timeout)
        except concurrent.futures.TimeoutError:
            self.kill()
            raise SandboxError(
                f"the sandbox zygote did not start within {timeout} s: {self.stderr()}"
            ) from None

    def stderr(self) -> str:
        try:
            self._errlog.seek(0)
            return self._errlog.read().decode(errors="replace").strip()[-2000:]
        except (OSError, ValueError):
            return ""

    def _run(self) -> None:
        fd = self._child_sock.fileno()
        args = dict(self.args, ctrl_fd=fd)
        script = SANDBOX_SCRIPT if self.mode == "bwrap" else CHILD_SCRIPT
        argv = self.argv_prefix + ["--", sys.executable, "-I", "-B", script, json.dumps(args)]
        if self.mode != "bwrap":
            argv = [sys.executable, "-I", "-B", script, json.dumps(args)]
        try:
            self.proc = subprocess.Popen(
                argv,
                env=SANDBOX_ENV,  # nothing of the host's environment reaches the sandbox
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._errlog,
                start_new_session=True,
            )
        except OSError as exc:
            self.ready.set_exception(SandboxError(f"could not start the zygote: {exc}"))
            return
        finally:
            self._child_sock.close()
        try:
            first = _wire.recv_frame(self.sock)
            if first.get("op") != "ready":
                raise _ProtocolError(f"unexpected first message {first!r}")
            self.report = first.get("report") or {}
            self.alive = True
            self.ready.set_result(self.report)
            while True:
                self._dispatch(_wire.recv_frame(self.sock))
        except (EOFError, OSError, ValueError, _ProtocolError) as exc:
            if not self.ready.done():
                code = self.proc.poll()
                self.ready.set_exception(
                    SandboxError(f"the sandbox zygote failed to start ({exc}; exit {code}): {self.stderr()}")
                )
        finally:
            self._on_death()

    def _dispatch(self, msg: dict) -> None:
        # The zygote's frames carry ints here; a malformed one just matches no watcher or request.
        if msg.get("op") == "exited":
            key = cast(tuple[int, int], (msg.get("slot"), msg.get("gen")))
            with self._lock:
                cb = self._watchers.pop(key, None)
            if cb is not None:
                cb(msg)
            return
        with self._lock:
            fut = self._pending.pop(cast(int, msg.get("rid")), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _on_death(self) -> None:
        self.alive = False
        with self._lock:
            pending, self._pending = self._pending, {}
            watchers, self._watchers = self._watchers, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(SandboxError("the sandbox zygote died"))
        for cb in watchers.values():
            cb({"zygote_died": True})
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)

    def watch(self, slot: int, gen: int, cb: Callable[[dict], None]) -> None:
        with self._lock:
            self._watchers[(slot, gen)] = cb

    def unwatch(self, slot: int, gen: int) -> None:
        with self._lock:
            self._watchers.pop((slot, gen), None)

    def request(self, msg: dict, fds: tuple[int, ...] = ()) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                fut.set_exception(SandboxError("the sandbox zygote is not running"))
                return fut
            self._rid += 1
            rid = self._rid
            self._pending[rid] = fut
        data = _wire.encode_frame(dict(msg, rid=rid))
        try:
            with self._send_lock:
                if fds:
                    sent = socket.send_fds(self.sock, [data], list(fds))
                    if sent < len(data):
                        self.sock.sendall(data[sent:])
                else:
                    self.sock.sendall(data)
        except OSError as exc:
            with self._lock:
                self._pending.pop(rid, None)
            if not fut.done():
                fut.set_exception(SandboxError(f"the sandbox zygote is unreachable: {exc}"))
        return fut

    def kill(self) -> None:
        """Take the whole sandbox down (all its REPLs die with the zygote's pid namespace)."""
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self.alive:
            with contextlib.suppress(Exception):
                self.request({"op": "shutdown"}).result(timeout)
        self.kill()
        self.thread.join(timeout)
        with contextlib.suppress(OSError):
            self._errlog.close()
