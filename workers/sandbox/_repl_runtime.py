"""The REPL runtime of a forked, limited REPL process: it builds the code's namespace (contexts, setup
variables, the helpers ``llm_query`` ... ``FINAL``, tool stubs), serves code blocks from its socket,
runs each with its output captured, carries the code's sub-calls and tool calls to the host, and
rebinds the reserved names and restores the contexts after every block.

Standard library only; a module of the zygote (see ``_child.py``).
"""

import ast
import builtins
import gc
import json
import linecache
import os
import socket
import sys
import threading
import types

# Type checkers treat a name TYPE_CHECKING as true, so they read only the package imports below (the
# zygote's copies are the same modules); a constant, not typing's, keeps the zygote's imports minimal.
TYPE_CHECKING = False

if TYPE_CHECKING or __package__:
    from workers.sandbox._repl_namespace import (
        CONTEXT_NAME,
        MAX_VARS_LISTED,
        RESERVED_NAMES,
        _fresh,
        _unchanged,
    )
    from workers.sandbox._repl_output import _Capture, _drain, _format_exception, _truncate
    from workers.sandbox._wire import bounds_error, encode_frame, recv_frame, send_frame
else:  # in the zygote, which imports its modules from its own folder (see _child.py)
    from _repl_namespace import CONTEXT_NAME, MAX_VARS_LISTED, RESERVED_NAMES, _fresh, _unchanged
    from _repl_output import _Capture, _drain, _format_exception, _truncate
    from _wire import bounds_error, encode_frame, recv_frame, send_frame


class _Repl:
    def __init__(self, sock: socket.socket, limits: dict):
        self.sock = sock
        self.limits = limits
        self.max_output = int(limits.get("max_output_chars", 20000))
        self.max_answer = int(limits.get("max_answer_chars", 1_000_000))
        self.max_message = int(limits.get("max_message_mb", 16)) << 20
        self.show_vars = bool(limits.get("show_vars", True))
        self.echo = bool(limits.get("echo_last_expr", False))
        self.call_lock = threading.Lock()
        self.in_step = False
        self.step = 0
        self.final_answer: str | None = None
        self.reserve: bytearray | None = bytearray(4 << 20)  # released to report a MemoryError cleanly
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
            frame = encode_frame({"op": "call", "kind": kind, "payloads": payloads})
            why = bounds_error(frame[4:])
            if len(frame) - 4 > self.max_message:
                why = f"{(len(frame) - 4) / 2**20:.1f} MiB, over the limit of {self.max_message >> 20} MiB"
            if why is not None:  # the host would refuse it: say why here, and keep the REPL
                raise _ChannelError(f"the call's message to the host is {why} (SandboxConfig.max_message_mb)")
            try:
                self.sock.sendall(frame)
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
        assert isinstance(tree, ast.Module)  # what compile returns for "exec" with PyCF_ONLY_AST
        last = None
        if self.echo and tree.body and isinstance(tail := tree.body[-1], ast.Expr):
            tree.body.pop()
            last = ast.Expression(tail.value)
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

    __module__ = "__main__"  # tracebacks name it bare, as when this class lived in the zygote's script
