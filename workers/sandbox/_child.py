"""Sandbox side of the REPL sandbox: the zygote (fork server) and the REPL runtime it forks.

This file runs as a script in its own interpreter, started by ``workers/sandbox/sandbox.py``
(inside bubblewrap where available, else inside namespaces it sets up itself). It uses the
standard library and ``_seccomp.py`` (beside it) only and does nothing on import, so the host may
import it for the wire format and the reserved names.

Processes (inside the sandbox's pid namespace):

    zygote (pid 1: root with a few capabilities, or the only uid of a user namespace)
      +-- REPL slot 0   (own session, own uid where available, rlimits, scratch dir as cwd)
      |     +-- whatever the REPL's code forks (same uid, same limits)
      +-- REPL slot 1 ...

Wire format on every socket: a 4-byte big-endian length, then that many bytes of JSON (UTF-8).
Nothing is ever unpickled: the host parses what a REPL sends as untrusted JSON.
"""

import ast
import builtins
import ctypes
import ctypes.util
import gc
import io
import json
import linecache
import os
import re
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import types

if __package__:
    from workers.sandbox import _seccomp
else:  # run as a script (the zygote): the module lies beside this file; keep it off the REPL's path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _seccomp

    del sys.path[0]

RESERVED_NAMES = (
    "context",
    "llm_query",
    "llm_query_batched",
    "rlm_query",
    "rlm_query_batched",
    "FINAL",
    "FINAL_VAR",
    "SHOW_VARS",
)
CONTEXT_NAME = re.compile(r"context_[0-9]+")  # several contexts: context_0, context_1, ... (also reserved)
MAX_FRAME = 64 << 20  # bytes; a bigger frame from a REPL is a protocol violation
MAX_VARS_LISTED = 200
_HDR = struct.Struct("!I")

# Linux constants (x86_64 / aarch64 agree on these).
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 32, 1024, 2048, 4096, 8192, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38

_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, arg: int) -> None:
    _check(_lib().prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def unshare(flags: int) -> None:
    _check(_lib().unshare(flags), "unshare")


def mount(source, target, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    rc = _lib().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(rc, f"mount {target}")


def umount(target: str, flags: int = 0) -> None:
    _check(_lib().umount2(target.encode(), flags), f"umount {target}")


# ---------------------------------------------------------------------------------------------
# Framing
# ---------------------------------------------------------------------------------------------


def encode_frame(obj) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=_json_default)
    raw = data.encode("utf-8", "surrogatepass")
    return _HDR.pack(len(raw)) + raw


def decode_payload(raw) -> object:
    return json.loads(bytes(raw).decode("utf-8", "surrogatepass"))


def _json_default(obj):
    return repr(obj)


def _recv_exact(sock: socket.socket, n: int, fds: list | None = None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if fds is not None:
            data, anc, _flags, _addr = sock.recvmsg(n - got, socket.CMSG_SPACE(16 * 4))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4]))
            k = len(data)
            view[got : got + k] = data
        else:
            k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the socket")
        got += k
    return buf


def recv_frame(sock: socket.socket, fds: list | None = None):
    (n,) = _HDR.unpack(_recv_exact(sock, 4, fds))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds the limit")
    return decode_payload(_recv_exact(sock, n))


def send_frame(sock: socket.socket, obj) -> None:
    sock.sendall(encode_frame(obj))


# ---------------------------------------------------------------------------------------------
# REPL runtime (runs in the forked, limited process)
# ---------------------------------------------------------------------------------------------


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

    @property
    def encoding(self):
        return "utf-8"

    @property
    def errors(self):
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


class _Repl:
    def __init__(self, sock: socket.socket, limits: dict):
        self.sock = sock
        self.limits = limits
        self.max_output = int(limits.get("max_output_chars", 20000))
        self.max_answer = int(limits.get("max_answer_chars", 1_000_000))
        self.show_vars = bool(limits.get("show_vars", True))
        self.echo = bool(limits.get("echo_last_expr", False))
        self.call_lock = threading.Lock()
        self.in_step = False
        self.step = 0
        self.final_answer = None
        self.reserve = bytearray(4 << 20)  # released to report a MemoryError cleanly
        self.real_out, self.real_err = sys.__stdout__, sys.__stderr__
        self.main_pid = os.getpid()
        self.ns: dict = {}
        self.reserved: dict = {}  # helpers and tool stubs, rebound after every block
        self.reserved_values: dict = {}  # e.g. context = None when no context was given
        self.contexts: list = []  # the original of each context (never handed to the code)
        self.live: list = []  # what the code sees, a copy of each original sharing its immutable leaves
        self.context_names: list[list[str]] = []  # names bound to each context

    # -- helpers injected into the namespace -------------------------------------------------

    def _channel(self, kind: str, payloads: list) -> list:
        """Send one call frame to the host and wait for its reply's results (one per payload); raises
        _ChannelError with the reason when the call cannot be made."""
        if os.getpid() != self.main_pid:
            raise _ChannelError("sub-calls are only available in the REPL's main process")
        with self.call_lock:
            if not self.in_step:
                raise _ChannelError("sub-calls are only available while a code block is running")
            try:
                send_frame(self.sock, {"op": "call", "kind": kind, "payloads": payloads})
                reply = recv_frame(self.sock)
            except Exception as exc:  # the host went away or the socket was tampered with
                raise _ChannelError(f"sub-call channel failed: {type(exc).__name__}: {exc}") from None
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or len(results) != len(payloads):
            raise _ChannelError("malformed sub-call reply")
        return results

    def _subcall(self, kind: str, payloads: list) -> list:
        """llm_query / rlm_query: strings only; a failure is an "Error: ..." string, never an exception."""
        try:
            results = self._channel(kind, payloads)
        except _ChannelError as exc:
            return [f"Error: {exc}"] * len(payloads)
        return [r if isinstance(r, str) else str(r) for r in results]

    def _tool_call(self, name: str, args: tuple, kwargs: dict):
        """A custom tool, run by the host: JSON arguments out, a JSON result back; a failure raises
        ToolError naming the tool."""
        payload = {"name": name, "args": list(args), "kwargs": kwargs}
        try:
            json.dumps(payload)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"tool {name!r}: arguments must be JSON-able ({exc})") from None
        try:
            (reply,) = self._channel("tool", [payload])
        except _ChannelError as exc:
            raise ToolError(f"tool {name!r}: {exc}") from None
        if isinstance(reply, dict) and isinstance(reply.get("error"), str):
            raise ToolError(reply["error"])
        if not isinstance(reply, dict) or "ok" not in reply:
            raise ToolError(f"tool {name!r}: malformed reply from the host")
        return reply["ok"]

    def _make_tool(self, name: str, doc: str):
        call = self._tool_call

        def tool(*args, **kwargs):
            return call(name, args, kwargs)

        tool.__name__ = tool.__qualname__ = name
        tool.__doc__ = doc
        return tool

    def _make_helpers(self) -> dict:
        subcall = self._subcall

        def llm_query(prompt, model=None):
            """Ask a plain sub-LM; returns its reply as a string (an 'Error: ...' string on failure)."""
            return subcall("llm_query", [{"prompt": prompt, "model": model}])[0]

        def llm_query_batched(prompts, model=None):
            """llm_query for several prompts at once (answered concurrently); returns a list of str."""
            prompts = list(prompts)
            if not prompts:
                return []
            return subcall("llm_query", [{"prompt": p, "model": model} for p in prompts])

        def as_value(answer):
            # SkyRL's habit: a child that answers "[1, 2]" gives the parent a list; anything that is not a
            # Python literal (prose, an "Error: ..." string) stays the string it was
            try:
                return ast.literal_eval(answer)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return answer

        def rlm_query(prompt, context=None, model=None, literal=False):
            """Ask a child RLM agent (its own REPL holding ``context``); returns its answer string, or with
            ``literal=True`` the answer parsed as a Python literal (list, dict, number...) when it is one."""
            answer = subcall("rlm_query", [{"prompt": prompt, "context": context, "model": model}])[0]
            return as_value(answer) if literal else answer

        def rlm_query_batched(prompts, contexts=None, model=None, literal=False):
            """rlm_query for several prompts at once; ``contexts`` is None or one context per prompt."""
            prompts = list(prompts)
            if contexts is None:
                contexts = [None] * len(prompts)
            contexts = list(contexts)
            if len(contexts) != len(prompts):
                raise ValueError("rlm_query_batched: contexts must be None or have one entry per prompt")
            if not prompts:
                return []
            payloads = [{"prompt": p, "context": c, "model": model} for p, c in zip(prompts, contexts)]
            answers = subcall("rlm_query", payloads)
            return [as_value(a) for a in answers] if literal else answers

        def FINAL(answer):
            """Record ``answer`` (converted to str) as the final answer of this trajectory."""
            self.final_answer = str(answer)
            return self.final_answer

        def FINAL_VAR(name):
            """Record the value of the REPL variable called ``name`` as the final answer."""
            if not isinstance(name, str):
                self.final_answer = str(name)
                return self.final_answer
            key = name.strip().strip("\"'")
            if key in self.ns and key not in ("__builtins__",):
                self.final_answer = str(self.ns[key])
                return self.final_answer
            names = [n for n, _ in self.user_variables()]
            msg = (
                f"Error: FINAL_VAR: variable {key!r} not found. User variables: {names}. "
                "Assign the variable in a code block before calling FINAL_VAR on it."
            )
            print(msg, file=sys.stderr)
            return msg

        def SHOW_VARS():
            """Return a string listing the user variables and their types."""
            listed = self.user_variables()
            if not listed:
                return "No user variables yet."
            return "Available variables: " + ", ".join(f"{n}: {t}" for n, t in listed)

        return {
            "llm_query": llm_query,
            "llm_query_batched": llm_query_batched,
            "rlm_query": rlm_query,
            "rlm_query_batched": rlm_query_batched,
            "FINAL": FINAL,
            "FINAL_VAR": FINAL_VAR,
            "SHOW_VARS": SHOW_VARS,
        }

    def user_variables(self) -> list:
        out = []
        for name, value in list(self.ns.items()):
            kind = type(value)  # never value.__class__: a hostile property must not run here
            reserved = name in self.reserved or any(name in names for names in self.context_names)
            if name.startswith("_") or reserved or issubclass(kind, types.ModuleType):
                continue
            out.append((name, kind.__name__))
        return out

    def _restore_reserved(self) -> None:
        """Rebind every reserved name; a context the code rebound or changed in place (at any depth of
        its lists and dicts) gets a fresh copy of the original."""
        for name, value in self.reserved.items():
            self.ns[name] = value
        for i, pristine in enumerate(self.contexts):
            live = self.live[i]
            names = self.context_names[i]
            if not all(self.ns.get(n, _MISSING) is live for n in names) or not _unchanged(live, pristine):
                live = self.live[i] = _fresh(pristine)
            for n in names:
                self.ns[n] = live

    # -- lifecycle ------------------------------------------------------------------------------

    def setup(self, init: dict) -> dict:
        """Build the namespace from the init message (contexts, setup variables, tool stubs), then run the
        setup code; returns what the ready message reports (its error, the variables it defined)."""
        contexts = init.get("contexts")
        if isinstance(contexts, list):  # several: context_0, context_1, ... and context = context_0
            self.contexts = contexts
            self.context_names = [[f"context_{i}"] for i in range(len(contexts))]
            if contexts:
                self.context_names[0].append("context")
            else:
                self.reserved_values = {"context": None}
        else:
            self.contexts = [init.get("context")]
            self.context_names = [["context"]]
        constants = init.get("constants")
        for name, value in constants.items() if isinstance(constants, dict) else ():
            if name.isidentifier() and name not in RESERVED_NAMES and not CONTEXT_NAME.fullmatch(name):
                self.contexts.append(value)  # restored like a context
                self.context_names.append([name])
        self.live = [_fresh(c) for c in self.contexts]
        self.ns = {"__name__": "__main__", "__builtins__": builtins}
        self.reserved = self._make_helpers()
        for spec in init.get("tools") or ():
            name, doc = spec.get("name"), spec.get("doc")
            ok = isinstance(name, str) and name.isidentifier() and not CONTEXT_NAME.fullmatch(name)
            if ok and name not in self.reserved and name != "context":
                self.reserved[name] = self._make_tool(name, doc if isinstance(doc, str) else "")
        self.reserved.update(self.reserved_values)
        reserved = set(self.reserved).union(*self.context_names)
        for name, value in (init.get("setup_vars") or {}).items():
            if isinstance(name, str) and name.isidentifier() and name not in reserved:
                self.ns[name] = value
        self._restore_reserved()
        code = init.get("setup_code")
        if not isinstance(code, str) or not code.strip():
            return {}
        out = _Capture(self.max_output, 1)
        sys.stdout, sys.stderr = out, out
        error = None
        try:
            filename = "<repl-setup_code>"
            linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
            exec(compile(code, filename, "exec", dont_inherit=True), self.ns)
        except BaseException as exc:  # noqa: B036 - reported to the host, which fails the REPL's start
            error = _format_exception(exc)
        finally:
            sys.stdout, sys.stderr = self.real_out, self.real_err
        for fd, stream in ((1, self.real_out), (2, self.real_err)):
            _drain(_Capture(0, fd), stream, 0)  # setup output is not shown: empty the fds for the first block
        self._restore_reserved()
        if error is not None:
            return {"setup_error": _truncate(error, len(error), self.max_output)}
        return {"variables": [[n, t] for n, t in self.user_variables()[:MAX_VARS_LISTED]]}

    def serve(self) -> None:
        init = recv_frame(self.sock)
        report = self.setup(init)
        send_frame(self.sock, {"op": "ready", "pid": os.getpid(), **report})
        while True:
            try:
                msg = recv_frame(self.sock)
            except (EOFError, OSError, ValueError):
                return
            if not isinstance(msg, dict) or msg.get("op") != "exec":
                return
            result = self.run(str(msg.get("code", "")))
            if os.getpid() != self.main_pid:
                os._exit(0)  # a process the block forked ran off the end of the block: it must not reply
            with self.call_lock:
                self.in_step = False
                send_frame(self.sock, result)

    def run(self, code: str) -> dict:
        self.step += 1
        self.final_answer = None
        out = _Capture(self.max_output, 1)
        err = _Capture(self.max_output, 2)
        error = None
        filename = f"<repl-{self.step}>"
        self.in_step = True
        sys.stdout, sys.stderr = out, err
        try:
            linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
            self._exec(code, filename)
        except BaseException as exc:  # noqa: B036 - everything the code raises is an observation
            error = _format_exception(exc)
        finally:
            sys.stdout, sys.stderr = self.real_out, self.real_err
        try:
            return self._result(out, err, error)
        except BaseException as exc:  # noqa: B036 - e.g. MemoryError while building the result
            self.reserve = None
            out.parts.clear()
            err.parts.clear()
            gc.collect()
            self.reserve = bytearray(4 << 20)
            try:
                self._restore_reserved()
            except BaseException:  # noqa: B036
                pass
            note = f"{type(exc).__name__} while collecting the block's output (output dropped)"
            return {"op": "result", "stdout": "", "stderr": "", "error": error or note, "variables": []}

    def _exec(self, code: str, filename: str) -> None:
        tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        last = None
        if self.echo and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec", dont_inherit=True), self.ns)
        if last is not None:
            value = eval(compile(last, filename, "eval", dont_inherit=True), self.ns)
            if value is not None:
                print(repr(value))

    def _result(self, out: _Capture, err: _Capture, error) -> dict:
        try:
            self._restore_reserved()
        except Exception as exc:  # pragma: no cover - defensive
            error = (error or "") + f"\n(restoring reserved names failed: {exc})"
        stdout, stdout_total = _drain(out, self.real_out, self.max_output)
        stderr, stderr_total = _drain(err, self.real_err, self.max_output)
        variables = []
        if self.show_vars:
            variables = [[n, t] for n, t in self.user_variables()[:MAX_VARS_LISTED]]
        answer = self.final_answer
        if answer is not None and len(answer) > self.max_answer:
            answer = _truncate(answer, len(answer), self.max_answer)
        if error is not None and len(error) > self.max_output:
            error = _truncate(error, len(error), self.max_output)
        return {
            "op": "result",
            "stdout": _truncate(stdout, stdout_total, self.max_output),
            "stderr": _truncate(stderr, stderr_total, self.max_output),
            "error": error,
            "variables": variables,
            "final_answer": answer,
        }


_MISSING = object()


class _ChannelError(Exception):
    pass


class ToolError(RuntimeError):
    """Raised in REPL code when a custom tool fails, times out or returns something that is not JSON."""


def _unchanged(live, pristine) -> bool:
    """Is ``live`` still an untouched copy of ``pristine`` (a JSON value)? Identity and exact-type checks
    only, so no method of whatever the code put there runs; iterative, so depth costs no stack."""
    stack = [(live, pristine)]
    while stack:
        a, b = stack.pop()
        if a is b:
            continue
        kind = type(b)
        if kind is list:
            if type(a) is not list or len(a) != len(b):
                return False
            stack.extend(zip(a, b))
        elif kind is dict:
            if type(a) is not dict or len(a) != len(b):
                return False
            for (ka, va), (kb, vb) in zip(a.items(), b.items()):
                if ka is not kb:
                    return False
                stack.append((va, vb))
        else:
            return False
    return True


def _fresh(pristine):
    """A copy of a JSON value's lists and dicts that shares its immutable leaves (strings, numbers)."""
    if type(pristine) not in (list, dict):
        return pristine
    root = [] if type(pristine) is list else {}
    stack = [(pristine, root)]
    while stack:
        src, dst = stack.pop()
        items = enumerate(src) if type(src) is list else src.items()
        for key, value in items:
            copy = [] if type(value) is list else {} if type(value) is dict else value
            if copy is not value:
                stack.append((value, copy))
            if type(dst) is list:
                dst.append(copy)
            else:
                dst[key] = copy
    return root


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


# ---------------------------------------------------------------------------------------------
# Zygote
# ---------------------------------------------------------------------------------------------


class _Zygote:
    def __init__(self, args: dict):
        self.args = args
        self.ctrl = socket.socket(fileno=int(args["ctrl_fd"]))
        self.ctrl.setblocking(True)
        self.uid_base = args.get("uid_base")
        self.uid_sep = False
        self.seccomp = False
        self.scratch_root = args["scratch_root"]
        self.children: dict[int, tuple[int, int, int]] = {}  # pid -> (slot, gen, OOM kills at spawn)
        self.slot_pid: dict[int, int] = {}
        self.report: dict = dict(args.get("report") or {})
        self.wake_r, self.wake_w = os.pipe()

    # -- setup ----------------------------------------------------------------------------------

    def setup(self) -> None:
        for name in self.args.get("preimport", []):
            try:
                __import__(name)
            except Exception:
                pass
        self.report["uid_separation"] = self._probe_uid()
        self.uid_sep = self.report["uid_separation"] == "ok"
        self.report["seccomp"] = self._probe_seccomp()
        self.seccomp = self.report["seccomp"] == "ok"
        os.makedirs(self.scratch_root, exist_ok=True)
        os.chmod(self.scratch_root, 0o711)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: os._exit(0))

    def _probe_uid(self) -> str:
        """Can a forked child switch to the slot uids and still read the Python installation?"""
        if self.uid_base is None:
            return "not attempted (not root)"
        uid = int(self.uid_base)
        paths = [os.path.dirname(os.__file__)] + [p for p in self.args.get("python_paths", []) if p]
        paths = [p for p in paths if os.path.isdir(p)]  # as seen by the zygote
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            except OSError:
                code = 2
            if code == 0 and not all(os.access(p, os.R_OK | os.X_OK) for p in paths):
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        return {0: "ok", 2: "setresuid failed", 3: "python installation not readable by the slot uid"}.get(
            code, f"probe failed ({code})"
        )

    def _probe_seccomp(self) -> str:
        """Does the REPL's seccomp filter install here, and does it refuse a nested user namespace?"""
        try:
            _seccomp.prepare()
        except OSError as exc:
            return f"not available: {exc.strerror}"
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                prctl(PR_SET_NO_NEW_PRIVS, 1)
                _seccomp.install()
            except OSError:
                code = 2
            if code == 0 and _lib().unshare(CLONE_NEWUSER) == 0:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        return {0: "ok", 2: "the kernel refused the filter", 3: "installed but not enforced"}.get(
            code, f"probe failed ({code})"
        )

    # -- main loop ------------------------------------------------------------------------------

    def loop(self) -> None:
        send_frame(self.ctrl, {"op": "ready", "report": self.report, "pid": os.getpid()})
        while True:
            try:
                ready, _, _ = select.select([self.ctrl, self.wake_r], [], [])
            except InterruptedError:
                ready = []
            if self.wake_r in ready:
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass
            self._reap()
            if self.ctrl in ready:
                fds: list[int] = []
                try:
                    msg = recv_frame(self.ctrl, fds)
                except (EOFError, OSError, ValueError):
                    self._shutdown()
                    return
                try:
                    reply = self._handle(msg, fds)
                except Exception as exc:
                    for fd in fds:
                        _close(fd)
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                reply["rid"] = msg.get("rid")
                reply["op"] = "reply"
                send_frame(self.ctrl, reply)
                if msg.get("op") == "shutdown":
                    self._shutdown()
                    return

    def _handle(self, msg: dict, fds: list) -> dict:
        op = msg.get("op")
        if op == "spawn":
            return self._spawn(int(msg["slot"]), int(msg["gen"]), fds[0], msg.get("limits") or {})
        if op == "kill":
            return self._kill(int(msg["slot"]))
        if op == "release":
            out = self._kill(int(msg["slot"]))
            _rmtree(self._scratch(int(msg["slot"])))
            return out
        if op == "shutdown":
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _scratch(self, slot: int) -> str:
        return os.path.join(self.scratch_root, f"repl-{slot}")

    def _uid(self, slot: int):
        return int(self.uid_base) + slot if self.uid_sep else None

    def _spawn(self, slot: int, gen: int, sock_fd: int, limits: dict) -> dict:
        uid = self._uid(slot)
        scratch = self._scratch(slot)
        if not os.path.isdir(scratch):
            os.makedirs(scratch)
        if uid is not None:
            os.chown(scratch, uid, uid)
        os.chmod(scratch, 0o700)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                _repl_child(self, sock_fd, scratch, uid, limits)
                code = 0
            except BaseException:  # noqa: B036
                code = 71
            finally:
                os._exit(code)
        _close(sock_fd)
        self.children[pid] = (slot, gen, _oom_kills())
        self.slot_pid[slot] = pid
        return {"ok": True, "pid": pid, "scratch": scratch, "uid": uid}

    def _reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            owner = self.children.pop(pid, None)
            if owner is None:
                continue
            slot, gen, oom_at_start = owner
            if self.slot_pid.get(slot) == pid:
                del self.slot_pid[slot]
            info = {"op": "exited", "slot": slot, "gen": gen}
            if os.WIFSIGNALED(status):
                # What the host needs to name the cause: the process's own CPU time (RLIMIT_CPU) and
                # whether the kernel's OOM killer ran meanwhile; anything else came from inside.
                info["signal"] = os.WTERMSIG(status)
                info["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)
                info["oom_kills"] = _oom_kills() - oom_at_start
                info["uid_separation"] = self.uid_sep
            else:
                info["code"] = os.waitstatus_to_exitcode(status)
            try:
                send_frame(self.ctrl, info)
            except OSError:
                pass

    def _kill(self, slot: int) -> dict:
        """SIGKILL every process of the slot: all processes of its uid (one kill(-1) as that uid is
        atomic against fork bombs), or its process group where there is no uid separation."""
        uid = self._uid(slot)
        main = self.slot_pid.get(slot)
        deadline = time.monotonic() + 5.0
        remaining = True
        while time.monotonic() < deadline:
            if uid is not None:
                self._kill_uid(uid)
                self._reap()
                remaining = _uid_has_processes(uid)
            else:
                remaining = False
                if main is not None:
                    for target in (lambda: os.killpg(main, signal.SIGKILL), lambda: os.kill(main, 9)):
                        try:
                            target()
                            remaining = True
                        except OSError:
                            pass
            self._reap()
            if not remaining and slot not in self.slot_pid:
                return {"ok": True}
            time.sleep(0.002)
        return {"ok": False, "error": "processes of the slot survived SIGKILL for 5 s"}

    def _kill_uid(self, uid: int) -> None:
        """kill(-1, SIGKILL) from a helper running as ``uid``: it reaches exactly the processes of
        that uid in this pid namespace, all at once (a fork in progress cannot outrun it)."""
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            except BaseException:  # noqa: B036
                pass
            os._exit(0)
        os.waitpid(pid, 0)

    def _shutdown(self) -> None:
        for slot in list(self.slot_pid):
            try:
                self._kill(slot)
            except Exception:
                pass


def _oom_kills() -> int:
    """The kernel's count of out-of-memory kills since boot (0 where /proc/vmstat lacks it)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _uid_has_processes(uid: int) -> bool:
    """Is any process (zombies included) of real uid ``uid`` visible in /proc?"""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            return True
                        break
        except (OSError, ValueError, IndexError):
            continue
    return False


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _repl_child(zygote: _Zygote, sock_fd: int, scratch: str, uid, limits: dict) -> None:
    """In the freshly forked child: detach, limit, drop privileges, then serve the REPL."""
    os.setsid()
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Only the REPL socket survives: the zygote's control socket must not be reachable from here.
    zygote.ctrl.detach()
    keep = sorted({0, 1, 2, sock_fd})
    for lo, hi in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
        os.closerange(lo + 1, hi)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd in (1, 2):
        mfd = os.memfd_create(f"fd{fd}", 0)
        os.dup2(mfd, fd)
        os.close(mfd)
    os.chdir(scratch)
    os.environ.clear()
    os.environ.update(
        {"HOME": scratch, "TMPDIR": scratch, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    )
    import resource

    mb = 1 << 20
    cpu = int(limits.get("cpu_s", 300))
    wanted = [
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, int(limits.get("memory_mb", 1024)) * mb, None),
        (resource.RLIMIT_FSIZE, int(limits.get("max_file_mb", 64)) * mb, None),
        (resource.RLIMIT_NOFILE, int(limits.get("max_open_files", 256)), None),
        (resource.RLIMIT_NPROC, int(limits.get("max_procs", 64)), None),
    ]
    for res, soft, hard in wanted:
        resource.setrlimit(res, (soft, soft if hard is None else hard))
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    else:
        # No uid of its own (not root): shed the capabilities the zygote holds in its user namespace,
        # then enter a user namespace of its own, so RLIMIT_NPROC counts this REPL's processes only
        # (the count is kept per user namespace), where that is permitted.
        _drop_capabilities()
        _enter_userns()
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if zygote.seccomp:  # the zygote's probe installed it: from here on a failure is fatal
        _seccomp.install()
    import random

    random.seed()
    sock = socket.socket(fileno=sock_fd)
    sock.setblocking(True)
    _Repl(sock, limits).serve()


def _drop_capabilities() -> None:
    """capset(2) with empty effective, permitted and inheritable sets."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    try:
        _lib().capset(ctypes.byref(header), data)
    except (AttributeError, OSError):
        pass


def _enter_userns() -> None:
    uid, gid = os.getuid(), os.getgid()
    try:
        unshare(CLONE_NEWUSER)
    except OSError:
        return
    for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# Namespaces for the no-bubblewrap mode
# ---------------------------------------------------------------------------------------------


def _enter_namespaces(args: dict, report: dict) -> None:
    """Without bubblewrap: new user (when not root), mount, pid, net, ipc and uts namespaces and the
    same minimal root filesystem as bubblewrap's.
    Returns in the inner process (pid 1 of the new pid namespace); the outer process waits for it and
    exits with its status. Whatever cannot be set up is reported, not fatal."""
    ns = report.setdefault("namespaces", {})
    euid, egid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if euid != 0:
        flags |= CLONE_NEWUSER
    try:
        unshare(flags)
        entered = flags
    except OSError as exc:
        report.setdefault("notes", []).append(f"unshare of all namespaces failed ({exc}); trying net only")
        entered = 0
        for one in ((CLONE_NEWUSER | CLONE_NEWNET) if euid != 0 else CLONE_NEWNET,):
            try:
                unshare(one)
                entered = one
            except OSError as exc2:
                report.setdefault("notes", []).append(f"unshare(net) failed: {exc2}")
    if entered & CLONE_NEWUSER:
        for path, text in (
            ("setgroups", "deny"),
            ("uid_map", f"0 {euid} 1"),
            ("gid_map", f"0 {egid} 1"),
        ):
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
    for name, flag in (
        ("user", CLONE_NEWUSER),
        ("mount", CLONE_NEWNS),
        ("pid", CLONE_NEWPID),
        ("net", CLONE_NEWNET),
        ("ipc", CLONE_NEWIPC),
        ("uts", CLONE_NEWUTS),
    ):
        ns[name] = bool(entered & flag)
    if entered & CLONE_NEWPID:
        pid = os.fork()
        if pid != 0:  # outer: keep nothing open, wait for the inner zygote, exit like it
            os.close(int(args["ctrl_fd"]))
            try:
                prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            except OSError:
                pass
            while True:
                try:
                    _, status = os.waitpid(pid, 0)
                    break
                except InterruptedError:
                    continue
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if entered & CLONE_NEWNS:
        try:
            _setup_mounts(args, report)
        except (OSError, KeyError) as exc:  # KeyError: no pivot_root number for this machine
            os.makedirs(args["scratch_root"], exist_ok=True)
            report["filesystem"] = f"host filesystem as is (building the minimal root failed: {exc})"
    else:
        os.makedirs(args["scratch_root"], exist_ok=True)
        report["filesystem"] = "host filesystem as is (no mount namespace); scratch on the host disk"


def _mountinfo() -> list[tuple[str, int]]:
    out = []
    flag_of = {
        "nosuid": MS_NOSUID,
        "nodev": MS_NODEV,
        "noexec": MS_NOEXEC,
        "noatime": MS_NOATIME,
        "nodiratime": MS_NODIRATIME,
        "relatime": MS_RELATIME,
        "strictatime": MS_STRICTATIME,
    }
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            target = parts[4].encode().decode("unicode_escape")
            flags = 0
            for opt in parts[5].split(","):
                flags |= flag_of.get(opt, 0)
            out.append((target, flags))
    return out


def _setup_mounts(args: dict, report: dict) -> None:
    """Build the sandbox's root as bubblewrap does, from the host's plan (read-only binds of /usr, the
    Python installation and a few /etc files), add a fresh /proc, a minimal /dev and the scratch tmpfs,
    and pivot into it: every other host path, unix sockets included, is then gone from this view."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # The new root's tmpfs goes on the host's (empty) scratch dir; inside the new root the scratch
    # tmpfs sits at the same path, so the REPLs' scratch paths are what the host expects.
    scratch = new = args["scratch_root"]
    os.makedirs(new, exist_ok=True)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    os.umask(0o022)
    for kind, *rest in args["root_plan"]:
        if kind == "dir":
            os.makedirs(new + rest[0], exist_ok=True)
        elif kind == "symlink":
            os.symlink(rest[0], new + rest[1])
        elif kind == "ro-bind" or os.path.exists(rest[0]):  # "ro-bind-try" skips what is missing
            _bind(rest[0], new + rest[1])
    dev = new + "/dev"
    os.makedirs(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        if os.path.exists(f"/dev/{name}"):
            _bind(f"/dev/{name}", f"{dev}/{name}")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{dev}/{name}")
    os.symlink("/proc/self/fd", f"{dev}/fd")
    os.mkdir(f"{dev}/shm")
    os.makedirs(new + "/proc")
    if report.get("namespaces", {}).get("pid"):
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    else:
        mount("/proc", new + "/proc", None, MS_BIND | MS_REC)
    os.makedirs(new + scratch)
    size = int(args.get("scratch_mb", 1024)) << 20
    mount("tmpfs", new + scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=711,size={size}")
    for target, flags in _mountinfo():  # all read-only but /proc and the scratch tmpfs
        inside = target == new or target.startswith(new + "/")
        if inside and not any(
            target == w or target.startswith(w + "/") for w in (new + "/proc", new + scratch)
        ):
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
    os.chdir(new)
    _check(_lib().syscall(ctypes.c_long(_seccomp.syscall_numbers()["pivot_root"]), b".", b"."), "pivot_root")
    umount(".", MNT_DETACH)  # the old root, stacked on "." by pivot_root
    os.chdir("/")
    report["filesystem"] = "minimal root"


def _bind(src: str, target: str) -> None:
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(src, target, None, MS_BIND | MS_REC)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    args = json.loads(sys.argv[1])
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the host (or bwrap) is our parent
    except OSError:
        pass
    report = {"mode": args["mode"]}
    if args["mode"] == "rlimits":
        _enter_namespaces(args, report)
    try:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError:
        pass
    args["report"] = report
    zygote = _Zygote(args)
    zygote.setup()
    zygote.loop()


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        sys.stderr.write(f"sandbox zygote failed: {type(exc).__name__}: {exc}\n")
        sys.exit(1)
