"""Host side of the REPL sandbox: a fork-server zygote per :class:`ReplSandbox`, one process per REPL.

The zygote (``_child.py``) runs in its own interpreter with the common modules imported, inside
bubblewrap (``isolation="bwrap"``) or inside namespaces it sets up itself (``"rlimits"``). Creating a
REPL is one fork of the zygote; the REPL then drops to a uid of its own, applies its rlimits and
serves code blocks over a Unix socketpair whose other end the host holds. The host alone measures
the wall clock of a block and, on overrun, has the zygote SIGKILL every process of that REPL's uid.

Everything is asynchronous inside (``aexecute``, ``acreate`` ...); the synchronous methods run the
same coroutines on a private event-loop thread owned by the sandbox.
"""

import asyncio
import concurrent.futures
import contextlib
import fcntl
import inspect
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from workers.event_loop import LoopThread
from workers.sandbox import _child, _seccomp
from workers.sandbox.config import ExecResult, SandboxConfig
from workers.sandbox.tools import Tool, ToolSpec, as_tools, tool_record

SubcallHandler = Callable[[str, dict], Awaitable[str] | str]
"""``handler(kind, payload) -> str``: kind is "llm_query" or "rlm_query"; payload holds "prompt",
"model" and, for rlm_query, "context". Batched calls from the REPL reach the handler as concurrent
single calls. May be a coroutine function (awaited on the caller's loop) or a plain function (run in
a thread). An exception becomes an "Error: ..." string in the REPL. (Custom tools do not go through the
handler: the REPL runs them itself, see ``workers.sandbox.tools``.)"""

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
SECCOMP_MODULE = os.path.join(os.path.dirname(CHILD_SCRIPT), "_seccomp.py")
SANDBOX_SCRIPT = "/opt/hyflow-sandbox/child.py"  # where the sandbox's root shows the script
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}  # the zygote's whole environment
BWRAP_SCRATCH = "/scratch"
BWRAP_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL")
BWRAP_ETC = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
)
UID_BASE = 1_500_000_000  # slot uids: UID_BASE + block * 4096 + slot, block claimed by a lock file
UID_BLOCKS = 1 << 17
STATE_LOST = "The REPL was restarted with the original context; variables from earlier steps are lost."


class SandboxError(RuntimeError):
    """Misuse (a closed REPL, concurrent use of one REPL) or a sandbox that cannot start at all."""


class _Timeout(Exception):
    pass


class _Died(Exception):
    pass


class _ProtocolError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _python_paths() -> list[str]:
    """Directories the interpreter needs inside the sandbox (prefixes, site-packages)."""
    cands = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    cands.append(os.path.dirname(os.path.realpath(sys.executable)))
    cands += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    out: list[str] = []
    for p in sorted({os.path.abspath(c) for c in cands if c and os.path.isdir(c)}, key=len):
        if not any(p == q or p.startswith(q + "/") for q in out) and not p.startswith("/usr/"):
            out.append(p)
    return out


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _bwrap_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


def _root_plan() -> list[tuple[str, ...]]:
    """The sandbox's root filesystem, the same in both modes (bubblewrap builds it from its argv, the
    zygote of the "rlimits" mode with mount(2)): ("dir", path), ("symlink", target, path),
    ("ro-bind", src, dst), ("ro-bind-try", src, dst). Every other host path is absent."""
    plan: list[tuple[str, ...]] = []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            plan.append(("symlink", os.readlink(top), top))
        elif os.path.isdir(top):
            plan.append(("ro-bind", top, top))
    # Parents of mount points are made traversable (bwrap would create them with mode 0700).
    made: set[str] = set()
    for p in _python_paths() + ["/etc/", os.path.dirname(SANDBOX_SCRIPT) + "/"]:
        parts = p.split("/")
        for i in range(2, len(parts)):
            anc = "/".join(parts[:i])
            if anc not in made:
                made.add(anc)
                plan.append(("dir", anc))
    plan += [("ro-bind", p, p) for p in _python_paths()]
    plan += [("ro-bind-try", p, p) for p in BWRAP_ETC]
    plan.append(("ro-bind", CHILD_SCRIPT, SANDBOX_SCRIPT))
    plan.append(("ro-bind", SECCOMP_MODULE, os.path.join(os.path.dirname(SANDBOX_SCRIPT), "_seccomp.py")))
    return plan


def _bwrap_argv(bwrap: str, scratch_mb: int, root: bool) -> list[str]:
    argv = [bwrap, "--die-with-parent", "--as-pid-1", "--new-session"]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not root:
        argv.append("--unshare-user")
    for kind, *paths in _root_plan():
        argv += (["--perms", "0755", "--dir"] if kind == "dir" else [f"--{kind}"]) + paths
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "0711", "--size", str(int(scratch_mb) << 20), "--tmpfs", BWRAP_SCRATCH]
    argv += ["--remount-ro", "/", "--chdir", "/", "--clearenv"]
    for key, value in SANDBOX_ENV.items():
        argv += ["--setenv", key, value]
    if root:
        argv += ["--cap-drop", "ALL"]
        for cap in BWRAP_CAPS:
            argv += ["--cap-add", cap]
    return argv


class _UidBlock:
    """A block of 4096 host uids held by this sandbox for as long as it lives (a flock on a file in
    the temp dir), so two sandboxes on one machine never share slot uids."""

    def __init__(self):
        d = os.path.join(tempfile.gettempdir(), "hyflow-sandbox-uids")
        os.makedirs(d, exist_ok=True)
        rng = random.SystemRandom()
        for _ in range(64):
            block = rng.randrange(UID_BLOCKS)
            path = os.path.join(d, f"{block}.lock")
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(path).st_ino != os.fstat(fd).st_ino:  # unlinked by its last holder meanwhile
                    raise OSError("stale lock file")
            except OSError:
                os.close(fd)
                continue
            self.fd, self.path, self.base = fd, path, UID_BASE + block * 4096
            return
        raise SandboxError("could not claim a block of sandbox uids")

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still locked, so no one else holds this inode
        with contextlib.suppress(OSError):
            os.close(self.fd)


class _FrameBuffer:
    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data

    def take(self):
        if len(self.buf) < 4:
            return None
        n = int.from_bytes(self.buf[:4], "big")
        if n > _child.MAX_FRAME:
            raise _ProtocolError(f"the REPL sent a message of {n} bytes")
        if len(self.buf) < 4 + n:
            return None
        raw = bytes(self.buf[4 : 4 + n])
        del self.buf[: 4 + n]
        try:
            msg = _child.decode_payload(raw)
        except (ValueError, RecursionError) as exc:
            raise _ProtocolError(f"the REPL sent malformed JSON ({exc})") from None
        if not isinstance(msg, dict):
            raise _ProtocolError("the REPL sent a message that is not an object")
        return msg


def _variables(raw: Any) -> list[tuple[str, str]]:
    """(name, type) pairs from a REPL's (untrusted) variable listing."""
    out = []
    if isinstance(raw, list):
        for item in raw[: _child.MAX_VARS_LISTED]:
            if isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item):
                out.append((item[0][:200], item[1][:200]))
    return out


FAULT_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGSYS)


def _describe_exit(info: dict | None, cpu_s: int) -> str:
    """The REPL process's end, with its cause: a limit (the process's CPU time at death, from the
    zygote's wait4), the kernel's OOM killer (its kill count rose meanwhile), a fault of the process,
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
    if sig == signal.SIGKILL and info.get("oom_kills"):
        return f"killed by {name}: the kernel's out-of-memory killer ran while it lived"
    if sig == signal.SIGKILL and used is not None and used >= cpu_s:
        return f"killed by {name}: CPU hard limit of {cpu_s + 1} s exceeded ({used:g} s used)"
    if sig in FAULT_SIGNALS:
        return f"killed by {name} (a fault or abort in the process itself, e.g. a bad pointer from ctypes)"
    sender = "its own code" if info.get("uid_separation") else "its own code or another REPL of its uid"
    cpu = f"{used:g} s of CPU used of {cpu_s} s" if used is not None else "CPU use unknown"
    return (
        f"killed by {name}, sent from inside the sandbox by {sender} (e.g. os.kill or os.killpg on itself "
        f"or its process group); not a limit ({cpu}, no out-of-memory kill)"
    )


# ---------------------------------------------------------------------------------------------
# Zygote client
# ---------------------------------------------------------------------------------------------


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
            first = _child.recv_frame(self.sock)
            if first.get("op") != "ready":
                raise _ProtocolError(f"unexpected first message {first!r}")
            self.report = first.get("report") or {}
            self.alive = True
            self.ready.set_result(self.report)
            while True:
                self._dispatch(_child.recv_frame(self.sock))
        except (EOFError, OSError, ValueError, _ProtocolError) as exc:
            if not self.ready.done():
                code = self.proc.poll()
                self.ready.set_exception(
                    SandboxError(f"the sandbox zygote failed to start ({exc}; exit {code}): {self.stderr()}")
                )
        finally:
            self._on_death()

    def _dispatch(self, msg: dict) -> None:
        if msg.get("op") == "exited":
            key = (msg.get("slot"), msg.get("gen"))
            with self._lock:
                cb = self._watchers.pop(key, None)
            if cb is not None:
                cb(msg)
            return
        with self._lock:
            fut = self._pending.pop(msg.get("rid"), None)
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
        data = _child.encode_frame(dict(msg, rid=rid))
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


# ---------------------------------------------------------------------------------------------
# Sandbox and REPL
# ---------------------------------------------------------------------------------------------


class ReplSandbox:
    """A factory of sandboxed persistent Python REPLs sharing one zygote (fork server).

    >>> with ReplSandbox(SandboxConfig(timeout_s=5)) as sb:
    ...     repl = sb.create(context="some long text")
    ...     repl.execute("n = len(context)\\nprint(n)").stdout
    '14\\n'

    ``handler`` (optional) answers sub-calls made by REPL code (``llm_query``, ``rlm_query`` ...);
    each REPL may get its own in :meth:`create`. An env worker holds one sandbox and many REPLs and
    drives them with the async methods (``acreate``, ``Repl.aexecute``) from one event loop.
    """

    def __init__(self, config: SandboxConfig | None = None, handler: SubcallHandler | None = None):
        self.config = config or SandboxConfig()
        self.handler = handler
        self._lock = threading.RLock()
        self._zygote: _ZygoteClient | None = None
        self._mode: str | None = None
        self._fallback_reason: str | None = None
        self._uid_block: _UidBlock | None = None
        self._host_scratch: str | None = None
        self._free = list(range(self.config.max_repls - 1, -1, -1))
        self._repls: weakref.WeakValueDictionary[int, Repl] = weakref.WeakValueDictionary()
        self._loop: LoopThread | None = None
        self._zygote_starts = 0
        self._closed = False
        try:
            self._ensure_zygote()
        except BaseException:
            if self._uid_block is not None:
                self._uid_block.release()
            if self._host_scratch is not None:
                shutil.rmtree(self._host_scratch, ignore_errors=True)
            raise

    # -- zygote lifecycle -------------------------------------------------------------------------

    def _ensure_zygote(self) -> _ZygoteClient:
        with self._lock:
            if self._closed:
                raise SandboxError("the sandbox is closed")
            if self._zygote is not None and self._zygote.alive:
                return self._zygote
            if self._zygote is not None:
                self._zygote.shutdown(timeout=1.0)
            if os.geteuid() == 0 and self._uid_block is None:
                self._uid_block = _UidBlock()
            if self._mode is None:
                self._zygote = self._first_start()
            else:
                self._zygote = self._start(self._mode)
            self._zygote_starts += 1
            return self._zygote

    def _first_start(self) -> _ZygoteClient:
        iso = self.config.isolation
        if iso in ("auto", "bwrap"):
            path = bwrap_path()
            if path is None:
                reason = "bubblewrap (bwrap) is not installed"
            else:
                try:
                    z = self._start("bwrap")
                    self._mode = "bwrap"
                    return z
                except SandboxError as exc:
                    reason = f"bubblewrap failed to start here: {exc}"
            if iso == "bwrap":
                raise SandboxError(f"isolation='bwrap' requested but {reason}")
            self._fallback_reason = reason
        z = self._start("rlimits")
        self._mode = "rlimits"
        return z

    def _start(self, mode: str) -> _ZygoteClient:
        cfg = self.config
        root = os.geteuid() == 0
        if mode == "bwrap":
            scratch_root = BWRAP_SCRATCH
            prefix = _bwrap_argv(bwrap_path() or "bwrap", cfg.scratch_mb, root)
        else:
            if self._host_scratch is None:
                self._host_scratch = tempfile.mkdtemp(prefix="hyflow-sandbox-")
            scratch_root = self._host_scratch
            prefix = []
        args = {
            "mode": mode,
            "scratch_root": scratch_root,
            "scratch_mb": cfg.scratch_mb,
            "uid_base": self._uid_block.base if (root and self._uid_block) else None,
            "preimport": list(cfg.preimport),
            "python_paths": _python_paths(),
            "root_plan": _root_plan() if mode == "rlimits" else None,  # bwrap gets it as argv
        }
        z = _ZygoteClient(prefix, args, mode)
        z.start(cfg.start_timeout_s)
        return z

    async def _azygote(self) -> _ZygoteClient:
        z = self._zygote
        if z is not None and z.alive:
            return z
        return await asyncio.to_thread(self._ensure_zygote)

    def _restart_zygote(self, bad: _ZygoteClient) -> None:
        with self._lock:
            if self._zygote is bad:
                bad.alive = False  # the next spawn starts a new zygote at once
                bad.kill()

    # -- public API -------------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """The isolation in force: "bwrap" or "rlimits"."""
        return self._mode or "none"

    def create(
        self,
        context: Any = None,
        setup_vars: dict[str, Any] | None = None,
        handler: SubcallHandler | None = None,
        **kwargs: Any,
    ) -> "Repl":
        """:meth:`acreate` from sync code."""
        return self._sync(self.acreate(context, setup_vars, handler, **kwargs))

    async def acreate(
        self,
        context: Any = None,
        setup_vars: dict[str, Any] | None = None,
        handler: SubcallHandler | None = None,
        *,
        contexts: list | None = None,
        tools: Mapping[str, Any] | None = None,
        setup_code: str | None = None,
    ) -> "Repl":
        """A fresh REPL holding ``context`` (any JSON value: a str, a list of documents, a dict ...) as
        ``context``, or several ``contexts`` as ``context_0``, ``context_1``, ... (``context`` is
        ``context_0``), and the JSON-able ``setup_vars`` as ordinary variables; ``tools`` are host functions
        callable from its code (``workers.sandbox.tools``); ``setup_code`` runs before the first block (and
        again in a REPL restarted after a kill). ``handler`` overrides the sandbox's sub-call handler.
        Raises ValueError for a context that is not JSON-able or a bad tool name, and SandboxError when
        the REPL cannot start or ``setup_code`` raises or runs past ``start_timeout_s``."""
        if contexts is not None:
            if context is not None:
                raise ValueError("pass context= (one context) or contexts= (several), not both")
            contexts = list(contexts)
        for i, c in enumerate([context] if contexts is None else contexts):
            try:
                json.dumps(c)
            except (TypeError, ValueError) as exc:
                where = "context" if contexts is None else f"contexts[{i}]"
                raise ValueError(f"{where} must be JSON-able (str, list, dict, numbers): {exc}") from None
        if setup_code is not None and not isinstance(setup_code, str):
            raise ValueError(f"setup_code must be a str, got {type(setup_code).__name__}")
        spec = _ReplSpec(context, contexts, dict(setup_vars or {}), as_tools(tools), setup_code)
        with self._lock:
            if self._closed:
                raise SandboxError("the sandbox is closed")
            if not self._free:
                raise SandboxError(f"all {self.config.max_repls} REPL slots of this sandbox are in use")
            slot = self._free.pop()
        repl = Repl(self, slot, spec, handler)
        with self._lock:
            self._repls[slot] = repl
        try:
            await repl._spawn()
        except (_ProtocolError, _Died, _Timeout, OSError) as exc:
            await repl.aclose()
            raise SandboxError(f"could not start a REPL: {type(exc).__name__}: {exc}") from None
        except BaseException:
            await repl.aclose()
            raise
        return repl

    def isolation_report(self) -> dict:
        """What isolation is in force, as set up on this machine (the README quotes it)."""
        cfg = self.config
        z = self._ensure_zygote()
        zr = z.report
        uid_sep = zr.get("uid_separation") == "ok"
        root = os.geteuid() == 0
        report: dict[str, Any] = {"mode": self._mode}
        bw = bwrap_path()
        report["bwrap"] = {"path": bw, "version": _bwrap_version(bw)} if bw else None
        if self._fallback_reason:
            report["bwrap_not_used"] = self._fallback_reason
        if self._mode == "bwrap":
            ns = {"pid": True, "net": True, "ipc": True, "uts": True, "mount": True, "user": not root}
        else:
            ns = zr.get("namespaces", {})
        if self._mode == "bwrap" or zr.get("filesystem") == "minimal root":
            fs = (
                "minimal root: read-only binds of /usr (+ /bin, /lib* links) and the Python installation "
                f"({', '.join(_python_paths())}), a few /etc files, fresh /proc and /dev; every other host "
                f"path (files, unix sockets) is absent; writable: the REPL's own scratch dir on a "
                f"{cfg.scratch_mb} MB tmpfs shared by the sandbox's REPLs"
            )
        else:
            fs = zr.get("filesystem", "host filesystem as is")
        report["namespaces"] = ns
        report["network"] = (
            "none: a private network namespace (own loopback only; host ports unreachable)"
            if ns.get("net")
            else "NOT isolated: the REPL shares the host network"
        )
        report["filesystem"] = fs
        report["uid_separation"] = (
            f"each REPL runs as its own unprivileged uid (from {self._uid_block.base}), scratch dir mode 0700"
            if uid_sep
            else f"none ({zr.get('uid_separation')}): all REPLs share one uid"
        )
        if uid_sep:
            procs = f"RLIMIT_NPROC {cfg.max_procs} (processes + threads) on the REPL's own uid: enforced"
        elif not root:
            procs = f"RLIMIT_NPROC {cfg.max_procs} counted in the REPL's own user namespace (where permitted)"
        else:
            procs = f"RLIMIT_NPROC {cfg.max_procs} set but NOT enforced (REPL runs as root): fork bombs uncontained"
        kill = (
            "SIGKILL of every process of the REPL's uid (one kill(-1) as that uid, atomic against fork bombs)"
            if uid_sep
            else "SIGKILL of the REPL's process group (processes that leave it survive until the sandbox closes)"
        )
        report["limits"] = {
            "timeout": f"{cfg.timeout_s} s wall clock per block, measured by the host (time blocked in "
            f"host sub-calls excluded; each sub-call limited to {cfg.subcall_timeout_s} s); on overrun: "
            f"{kill}, then a fresh REPL with the same context and an error observation",
            "memory": f"RLIMIT_AS {cfg.memory_mb} MB per process (allocation fails with MemoryError)",
            "cpu": f"RLIMIT_CPU {cfg.cpu_s} s per process lifetime (SIGXCPU, SIGKILL at {cfg.cpu_s + 1} s)",
            "processes": procs,
            "file_size": f"RLIMIT_FSIZE {cfg.max_file_mb} MB per file (write fails with EFBIG)",
            "open_files": f"RLIMIT_NOFILE {cfg.max_open_files}",
            "output": f"stdout/stderr each truncated to {cfg.max_output_chars} chars inside the REPL",
        }
        report["process"] = (
            "each REPL is forked from a zygote that is pid 1 of the sandbox's pid namespace; a REPL "
            "cannot signal the zygote, the host or other REPLs"
            if ns.get("pid") and uid_sep
            else "each REPL is forked from the zygote; processes share a pid namespace"
            + ("" if ns.get("pid") else " with the host")
        )
        report["environment"] = (
            f"the zygote starts with {SANDBOX_ENV} only; nothing of the host's environment"
        )
        report["seccomp"] = (
            _seccomp.describe()
            if zr.get("seccomp") == "ok"
            else f"none ({zr.get('seccomp')}): the kernel's full syscall surface is reachable"
        )
        report["python_level"] = (
            "none: full builtins and imports; containment is the process boundary and the kernel "
            "limits above, not Python-level restrictions"
        )
        report["notes"] = list(zr.get("notes", []))
        return report

    def close(self) -> None:
        """Close every REPL and stop the zygote (all processes of the sandbox die)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            repls = list(self._repls.values())
        for r in repls:
            r._closed = True
            r._drop_socket()
        if self._zygote is not None:
            self._zygote.shutdown()
        if self._loop is not None:
            self._loop.stop()
        if self._uid_block is not None:
            self._uid_block.release()
        if self._host_scratch is not None:
            shutil.rmtree(self._host_scratch, ignore_errors=True)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> "ReplSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "ReplSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    @property
    def num_repls(self) -> int:
        return len(self._repls)

    # -- internals --------------------------------------------------------------------------------

    def _sync(self, coro):
        with self._lock:
            if self._loop is None:
                self._loop = LoopThread(name="repl-sandbox-loop")
            loop = self._loop
        if loop.in_loop_thread():
            coro.close()
            raise SandboxError("synchronous sandbox call from a sub-call handler; use the async API")
        return loop.run(coro)

    @staticmethod
    def _reclaim(sandbox_ref, slot: int, holder: dict) -> None:
        """Finalizer of a Repl that was never closed: kill its processes, free its slot."""
        sb = sandbox_ref()
        if sb is None or sb._closed:
            return
        zyg = holder.get("zygote")
        if zyg is not None and zyg.alive:
            zyg.request({"op": "release", "slot": slot})  # in order before any later spawn of the slot
        sb._release_slot(slot)

    def _release_slot(self, slot: int) -> None:
        with self._lock:
            self._repls.pop(slot, None)
            self._free.append(slot)


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


class Repl:
    """One persistent sandboxed Python REPL (a process of its own). Use it from one task at a time."""

    def __init__(self, sandbox: ReplSandbox, slot: int, spec: _ReplSpec, handler):
        self._sb = sandbox
        self.slot = slot
        self._spec = spec
        self._handler = handler
        self.setup_variables: list[tuple[str, str]] = []  # (name, type) of what setup_code defined
        self._tool_calls: list[dict] = []  # the running block's tool calls
        self._gen = 0
        self._sock: socket.socket | None = None
        self._buf = _FrameBuffer()
        self._exit_info: dict | None = None
        self._zygote: _ZygoteClient | None = None
        self._busy = threading.Lock()
        self._io_lock = threading.Lock()
        self._closed = False
        self.pid: int | None = None  # inside the sandbox's pid namespace
        self.scratch_dir: str | None = None  # inside the sandbox's filesystem view
        self.restarts = 0
        self.final_answer: str | None = None
        self._stop_reason: str | None = None
        # A REPL dropped without close() still gets its processes killed and its slot back.
        self._holder: dict = {"zygote": None}
        self._finalizer = weakref.finalize(
            self, ReplSandbox._reclaim, weakref.ref(sandbox), slot, self._holder
        )

    # -- process lifecycle ------------------------------------------------------------------------

    async def _spawn(self) -> None:
        cfg = self._sb.config
        zyg = await self._sb._azygote()
        self._gen += 1
        gen = self._gen
        host, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        host.setblocking(False)
        with self._io_lock:
            self._sock, self._buf, self._exit_info, self._zygote = host, _FrameBuffer(), None, zyg
            self._holder["zygote"] = zyg
        me = weakref.ref(self)

        def on_exit(info: dict, g: int = gen) -> None:
            repl = me()
            if repl is not None:
                repl._on_exit(g, info)

        zyg.watch(self.slot, gen, on_exit)
        try:
            fut = zyg.request(
                {"op": "spawn", "slot": self.slot, "gen": gen, "limits": cfg.limits()}, (child.fileno(),)
            )
            reply = await asyncio.wait_for(asyncio.wrap_future(fut), cfg.start_timeout_s)
        finally:
            child.close()
        if not reply.get("ok"):
            raise SandboxError(f"spawn failed: {reply.get('error')}")
        self.scratch_dir = reply.get("scratch")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.start_timeout_s
        await self._send(self._spec.init_message(), deadline)
        try:
            msg = await self._recv(deadline)
        except _Timeout:
            if not self._spec.setup_code:
                raise
            raise SandboxError(
                f"setup_code did not finish within start_timeout_s ({cfg.start_timeout_s:g} s)"
            ) from None
        if msg.get("op") != "ready":
            raise _ProtocolError(f"unexpected first message {msg.get('op')!r}")
        if msg.get("setup_error") is not None:
            raise SandboxError(f"setup_code failed:\n{str(msg['setup_error'])[: cfg.max_output_chars]}")
        self.setup_variables = _variables(msg.get("variables"))
        self.pid = msg.get("pid")

    def _on_exit(self, gen: int, info: dict) -> None:
        """From the zygote reader thread: the REPL's main process is gone; wake any reader."""
        with self._io_lock:
            if gen != self._gen:
                return
            self._exit_info = info
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def _drop_socket(self) -> None:
        with self._io_lock:
            if self._zygote is not None:
                self._zygote.unwatch(self.slot, self._gen)
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
            self._sock = None

    async def _kill(self) -> None:
        """SIGKILL every process of this REPL (through the zygote); if that fails, restart the zygote,
        which takes every REPL of the sandbox down with it (they restart on their next block)."""
        self._drop_socket()
        zyg = self._zygote
        if zyg is None or not zyg.alive:
            return
        try:
            reply = await asyncio.wait_for(
                asyncio.wrap_future(zyg.request({"op": "kill", "slot": self.slot})), 15
            )
            if reply.get("ok"):
                return
        except (TimeoutError, SandboxError):
            pass
        self._sb._restart_zygote(zyg)

    async def _restarted(self, error: str, t0: float, timed_out: bool = False) -> ExecResult:
        """The result of a block whose REPL process was killed (or died): a fresh process, and ``error`` saying
        the state is lost (or why the restart failed)."""
        failed = await self._respawn()
        return ExecResult(
            error=error + (STATE_LOST if not failed else f"Restart failed: {failed}"),
            timed_out=timed_out,
            killed=True,
            restarted=not failed,
            elapsed_s=time.perf_counter() - t0,
            tool_calls=self._tool_calls,
        )

    async def _respawn(self) -> str | None:
        """A fresh REPL in this slot; returns None on success, else why it failed."""
        await self._kill()
        self.restarts += 1
        try:
            await self._spawn()
            return None
        except (SandboxError, _ProtocolError, _Died, _Timeout, OSError) as exc:
            self._drop_socket()
            return f"{type(exc).__name__}: {exc}"

    # -- channel ----------------------------------------------------------------------------------

    async def _send(self, obj: dict, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        sock = self._sock
        if sock is None:
            raise _Died()
        try:
            await asyncio.wait_for(
                loop.sock_sendall(sock, _child.encode_frame(obj)), max(0.0, deadline - loop.time())
            )
        except TimeoutError:
            raise _Timeout() from None
        except OSError:
            raise _Died() from None

    async def _recv(self, deadline: float) -> dict:
        loop = asyncio.get_running_loop()
        while True:
            msg = self._buf.take()
            if msg is not None:
                return msg
            sock = self._sock
            if sock is None:
                raise _Died()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise _Timeout()
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), remaining)
            except TimeoutError:
                raise _Timeout() from None
            except OSError:
                raise _Died() from None
            if not data:
                raise _Died()
            self._buf.feed(data)

    async def _death_info(self) -> dict | None:
        for _ in range(100):
            if self._exit_info is not None:
                return self._exit_info
            await asyncio.sleep(0.01)
        return self._exit_info

    # -- sub-calls --------------------------------------------------------------------------------

    async def _answer_tools(self, payloads: list) -> list[dict]:
        """Run the REPL's tool calls here, on the host; each result is {"ok": json} or {"error": text}."""
        tools = self._spec.tools

        async def one(payload) -> dict:
            started = time.perf_counter()
            if not isinstance(payload, dict):
                return {"error": "malformed tool call"}
            name, args, kwargs = payload.get("name"), payload.get("args"), payload.get("kwargs")
            tool = tools.get(name) if isinstance(name, str) else None
            if not isinstance(tool, Tool):
                return {"error": f"no tool named {str(name)[:100]!r}"}
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                outcome = {"error": f"tool {name!r}: malformed arguments"}
            else:
                outcome = await tool.acall(name, args, kwargs, self._spec.tool_context)
            self._tool_calls.append(tool_record(name, args, kwargs, outcome, started))
            return outcome

        return list(await asyncio.gather(*(one(p) for p in payloads)))

    async def _answer_calls(self, msg: dict) -> list:
        kind, payloads = msg.get("kind"), msg.get("payloads")
        if kind == "tool" and isinstance(payloads, list):
            return await self._answer_tools(payloads)
        if kind not in ("llm_query", "rlm_query") or not isinstance(payloads, list):
            return ["Error: malformed sub-call"] * (len(payloads) if isinstance(payloads, list) else 1)
        handler = self._handler or self._sb.handler
        if handler is None:
            return [f"Error: {kind} is not available (no sub-call handler is configured)"] * len(payloads)
        timeout = self._sb.config.subcall_timeout_s
        is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)

        async def one(payload) -> str:
            if not isinstance(payload, dict):
                return "Error: malformed sub-call payload"
            try:
                if is_async:
                    result = await asyncio.wait_for(handler(kind, payload), timeout)
                else:
                    result = await asyncio.wait_for(asyncio.to_thread(handler, kind, payload), timeout)
                    if inspect.isawaitable(result):
                        result = await asyncio.wait_for(result, timeout)
                return result if isinstance(result, str) else str(result)
            except TimeoutError:
                return f"Error: {kind} timed out after {timeout} s"
            except Exception as exc:
                return f"Error: {kind} failed: {type(exc).__name__}: {exc}"

        return list(await asyncio.gather(*(one(p) for p in payloads)))

    # -- execution --------------------------------------------------------------------------------

    def execute(self, code: str, timeout_s: float | None = None) -> ExecResult:
        """Run one code block; see :meth:`aexecute`."""
        return self._sb._sync(self.aexecute(code, timeout_s))

    async def aexecute(self, code: str, timeout_s: float | None = None) -> ExecResult:
        """Run one code block in this REPL and return what it did. Never raises for anything the code
        or the REPL process does; raises :class:`SandboxError` only for misuse (closed REPL, two blocks
        at once on one REPL) and ValueError for a non-positive ``timeout_s``."""
        timeout = self._sb.config.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if self._closed:
            raise SandboxError("this REPL is closed")
        if not self._busy.acquire(blocking=False):
            raise SandboxError("this REPL is already running a block (use one task per REPL)")
        try:
            return await self._execute(str(code), timeout)
        finally:
            self._busy.release()

    async def _execute(self, code: str, timeout_s: float) -> ExecResult:
        cfg = self._sb.config
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        notice = None
        self._tool_calls = []
        if self._sock is None or self._exit_info is not None:
            if self._exit_info is not None:
                why = f"the REPL process had died since the last block ({_describe_exit(self._exit_info, cfg.cpu_s)})"
            else:
                why = self._stop_reason or "the REPL process was not running"
            failed = await self._respawn()
            if failed:
                return ExecResult(
                    error=f"SandboxError: the REPL could not be restarted: {failed}", killed=True
                )
            self._stop_reason = None
            notice = f"Note: {why}. {STATE_LOST}"
        deadline = loop.time() + timeout_s
        try:
            await self._send({"op": "exec", "code": code}, deadline)
            while True:
                msg = await self._recv(deadline)
                op = msg.get("op")
                if op == "call":
                    paused = loop.time()
                    results = await self._answer_calls(msg)
                    deadline += loop.time() - paused
                    await self._send({"op": "reply", "results": results}, max(deadline, loop.time() + 5))
                elif op == "result":
                    res = self._result(msg, notice)
                    res.elapsed_s = time.perf_counter() - t0
                    res.tool_calls = self._tool_calls
                    return res
                else:
                    raise _ProtocolError(f"unexpected message {op!r}")
        except _Timeout:
            return await self._restarted(
                f"TimeoutError: the code block exceeded the {timeout_s:g} s wall-clock limit and the REPL "
                "process was killed. ",
                t0,
                timed_out=True,
            )
        except _Died:
            why = _describe_exit(await self._death_info(), cfg.cpu_s)
            return await self._restarted(f"REPL process died during the block: {why}. ", t0)
        except _ProtocolError as exc:
            return await self._restarted(f"ProtocolError: {exc}; the REPL process was killed. ", t0)
        except asyncio.CancelledError:
            # The caller gave up mid-block: the REPL's state is unknown, so kill it now (without
            # waiting) and start a fresh one on the next block.
            zyg = self._zygote
            self._drop_socket()
            self._stop_reason = "the previous block was cancelled by the host and its REPL process killed"
            if zyg is not None and zyg.alive:
                zyg.request({"op": "kill", "slot": self.slot})
            raise

    def _result(self, msg: dict, notice: str | None) -> ExecResult:
        limit = self._sb.config.max_output_chars

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
        answer = text("final_answer", self._sb.config.max_answer_chars) if isinstance(answer, str) else None
        stderr = text("stderr", limit)
        if notice:
            stderr = notice + ("\n" + stderr if stderr else "")
        if answer is not None:
            self.final_answer = answer
        return ExecResult(
            stdout=text("stdout", limit),
            stderr=stderr,
            error=error,
            restarted=notice is not None,
            variables=variables,
            final_answer=answer,
        )

    # -- closing ----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        """Whether the REPL process is up (a dead one is replaced on the next block)."""
        return not self._closed and self._sock is not None and self._exit_info is None

    def _begin_close(self):
        """Mark closed and drop the socket; the zygote to ask for the slot's release, or None (idempotent:
        None also when already closed)."""
        if not self._finalizer.alive:
            return None
        self._finalizer.detach()
        self._closed = True
        zyg = self._zygote
        self._drop_socket()
        return zyg if zyg is not None and zyg.alive else None

    def close(self) -> None:
        """Kill the REPL's processes, delete its scratch dir and free its slot (idempotent)."""
        if not self._finalizer.alive:
            return
        zyg = self._begin_close()
        if zyg is not None:
            with contextlib.suppress(Exception):
                zyg.request({"op": "release", "slot": self.slot}).result(15)
        self._sb._release_slot(self.slot)

    async def aclose(self) -> None:
        """``close`` without blocking the event loop."""
        if not self._finalizer.alive:
            return
        zyg = self._begin_close()
        if zyg is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.wrap_future(zyg.request({"op": "release", "slot": self.slot})), 15
                )
        self._sb._release_slot(self.slot)

    def __enter__(self) -> "Repl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Repl(slot={self.slot}, pid={self.pid}, restarts={self.restarts}, closed={self._closed})"
