"""One sandboxed persistent Python REPL as the host sees it (:class:`Repl`): its process's lifecycle (spawn
through the zygote, kill, restart with the original context), its channel, and running code blocks
against the host's wall clock.
"""

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import threading
import time
import weakref
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from workers.sandbox import _wire
from workers.sandbox.config import ExecResult, SandboxConfig, SandboxError
from workers.sandbox.memory_cgroup import MemoryCgroups
from workers.sandbox.protocol import (
    _describe_exit,
    _Died,
    _exec_result,
    _FrameBuffer,
    _ProtocolError,
    _ReplSpec,
    _Timeout,
    _variables,
)
from workers.sandbox.subcalls import SubcallHandler, _answer_calls
from workers.sandbox.zygote_client import _ZygoteClient

_T = TypeVar("_T")


class _Owner(Protocol):
    """What a REPL uses of the sandbox that owns it (``workers/sandbox/sandbox.py:ReplSandbox``): its config,
    zygote, memory cgroups, event loop and slot bookkeeping. Written here so this module need not import that one,
    which imports this one."""

    config: SandboxConfig
    handler: SubcallHandler | None
    stats: dict[str, int]
    _memcg: MemoryCgroups | None
    _closed: bool

    async def _azygote(self) -> _ZygoteClient: ...
    def _restart_zygote(self, bad: _ZygoteClient) -> None: ...
    def _sync(self, coro: Coroutine[Any, Any, _T]) -> _T: ...
    def _next_trajectory(self) -> int: ...
    def _release(self, zygote: _ZygoteClient, slot: int, trajectory: int) -> concurrent.futures.Future: ...
    def _release_slot(self, slot: int) -> None: ...


STATE_LOST = "The REPL was restarted with the original context; variables from earlier steps are lost."


class Repl:
    """One persistent sandboxed Python REPL (a process of its own). Use it from one task at a time."""

    def __init__(self, sandbox: _Owner, slot: int, spec: _ReplSpec, handler):
        self._sb = sandbox
        self.slot = slot
        self._spec = spec
        self._handler = handler
        self.setup_variables: list[tuple[str, str]] = []  # (name, type) of what setup_code defined
        self._tool_calls: list[dict] = []  # the running block's tool calls
        self._gen = 0
        self._sock: socket.socket | None = None
        self._buf = _FrameBuffer(sandbox.config.max_message_mb << 20)
        self._exit_info: dict | None = None
        self._oom_kills_at_spawn = 0  # the slot's memory cgroup's OOM kill count when this process started
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
        self._trajectory = sandbox._next_trajectory()  # names the scratch dir: the slot's next gets another
        self._holder: dict = {"zygote": None}
        self._finalizer = weakref.finalize(
            self, _reclaim, weakref.ref(sandbox), slot, self._trajectory, self._holder
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
            self._sock, self._buf, self._exit_info, self._zygote = (
                host,
                _FrameBuffer(cfg.max_message_mb << 20),
                None,
                zyg,
            )
            self._holder["zygote"] = zyg
        me = weakref.ref(self)

        def on_exit(info: dict, g: int = gen) -> None:
            repl = me()
            if repl is not None:
                repl._on_exit(g, info)

        zyg.watch(self.slot, gen, on_exit)
        fds = [child.fileno()]
        try:
            if self._sb._memcg is not None:  # the slot's memory cgroup, entered by the REPL process itself
                fds.append(self._sb._memcg.procs_fd(self.slot, cfg.memory_mb << 20))
                self._oom_kills_at_spawn = self._sb._memcg.oom_kills(self.slot)
            spawn = {"op": "spawn", "slot": self.slot, "gen": gen, "trajectory": self._trajectory}
            fut = zyg.request(dict(spawn, limits=cfg.limits()), tuple(fds))
            reply = await asyncio.wait_for(asyncio.wrap_future(fut), cfg.start_timeout_s)
        finally:
            child.close()
            for fd in fds[1:]:
                os.close(fd)
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
            memcg = self._sb._memcg
            if memcg is not None and info.get("signal") is not None:  # its own cgroup's count, exactly
                info = dict(info, oom_kills=memcg.oom_kills(self.slot) - self._oom_kills_at_spawn)
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
                self._sb.stats["stuck_kill_helpers"] = int(reply.get("stuck_helpers") or 0)
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
                loop.sock_sendall(sock, _wire.encode_frame(obj)), max(0.0, deadline - loop.time())
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
                    handler = self._handler or self._sb.handler
                    results = await _answer_calls(
                        msg, handler, cfg.subcall_timeout_s, self._spec, self._tool_calls
                    )
                    deadline += loop.time() - paused
                    await self._send({"op": "reply", "results": results}, max(deadline, loop.time() + 5))
                elif op == "result":
                    res = _exec_result(msg, notice, cfg)
                    if res.final_answer is not None:
                        self.final_answer = res.final_answer
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
                self._sb._release(zyg, self.slot, self._trajectory).result(15)
        self._sb._release_slot(self.slot)

    async def aclose(self) -> None:
        """``close`` without blocking the event loop."""
        if not self._finalizer.alive:
            return
        zyg = self._begin_close()
        if zyg is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.wrap_future(self._sb._release(zyg, self.slot, self._trajectory)), 15
                )
        self._sb._release_slot(self.slot)

    def __enter__(self) -> "Repl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Repl(slot={self.slot}, pid={self.pid}, restarts={self.restarts}, closed={self._closed})"


def _reclaim(sandbox_ref, slot: int, trajectory: int, holder: dict) -> None:
    """Finalizer of a Repl that was never closed: kill its processes, free its slot."""
    sb = sandbox_ref()
    if sb is None or sb._closed:
        return
    zyg = holder.get("zygote")
    if zyg is not None and zyg.alive:
        sb._release(zyg, slot, trajectory)  # in order before any later spawn of the slot
    sb._release_slot(slot)
