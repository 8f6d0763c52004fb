"""Host side of the REPL sandbox: a fork-server zygote per :class:`ReplSandbox`, one process per REPL.

The zygote (``_child.py``) runs in its own interpreter with the common modules imported, inside
bubblewrap (``isolation="bwrap"``) or inside namespaces it sets up itself (``"rlimits"``). Creating a
REPL is one fork of the zygote; the REPL then drops to a uid of its own, applies its rlimits and
serves code blocks over a Unix socketpair whose other end the host holds. The host alone measures
the wall clock of a block and, on overrun, has the zygote SIGKILL every process of that REPL's uid.

Everything is asynchronous inside (``aexecute``, ``acreate`` ...); the synchronous methods run the
same coroutines on a private event-loop thread owned by the sandbox.

This module holds :class:`ReplSandbox`, the factory of REPLs; the rest of the host side lies beside it:
``isolation.py`` (the sandbox's root filesystem, bubblewrap's argv, uid blocks), ``zygote_client.py``
(the zygote process and its control socket), ``repl.py`` (one REPL), ``protocol.py`` (the REPL's
messages as the host reads them) and ``subcalls.py`` (answering the REPL's sub-calls and tool calls).
"""

import asyncio
import concurrent.futures
import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from workers.event_loop import LoopThread
from workers.sandbox import _seccomp, _wire
from workers.sandbox.config import SandboxConfig, SandboxError
from workers.sandbox.isolation import (
    BWRAP_SCRATCH,
    SANDBOX_ENV,
    _bwrap_argv,
    _bwrap_version,
    _python_paths,
    _root_plan,
    _UidBlock,
    bwrap_path,
)
from workers.sandbox.memory_cgroup import MemoryCgroups
from workers.sandbox.protocol import _Died, _ProtocolError, _ReplSpec, _Timeout
from workers.sandbox.repl import Repl
from workers.sandbox.subcalls import SubcallHandler
from workers.sandbox.tools import as_tools
from workers.sandbox.zygote_client import _ZygoteClient

logger = logging.getLogger(__name__)


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
        self._trajectories = 0
        self._memcg: MemoryCgroups | None = None
        self._memcg_why = "not asked for (SandboxConfig.memory_cgroup=False)"
        if self.config.memory_cgroup:
            self._memcg, self._memcg_why = MemoryCgroups.probe()
        # Cleanup and kill-path health: released scratch dirs removed / not removed (each failure is also
        # logged), and kill helpers found stuck and killed by the zygote (see _zygote._kill_uid).
        self.stats = {"cleanups": 0, "cleanup_failures": 0, "stuck_kill_helpers": 0}
        self._closed = False
        try:
            self._ensure_zygote()
        except BaseException:
            if self._uid_block is not None:
                self._uid_block.release()
            if self._host_scratch is not None:
                shutil.rmtree(self._host_scratch, ignore_errors=True)
            if self._memcg is not None:
                self._memcg.close()
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
        if uid_sep:
            # the zygote separates uids only when given a uid_base, i.e. the uid block (_ensure_zygote)
            assert self._uid_block is not None
            base = self._uid_block.base
            report["uid_separation"] = (
                f"each REPL runs as its own unprivileged uid (from {base}), scratch dir mode 0700"
            )
        else:
            report["uid_separation"] = f"none ({zr.get('uid_separation')}): all REPLs share one uid"
        if uid_sep:
            procs = f"RLIMIT_NPROC {cfg.max_procs} (processes + threads) on the REPL's own uid: enforced"
        elif not root:
            procs = f"RLIMIT_NPROC {cfg.max_procs} counted in the REPL's own user namespace (where permitted)"
        else:
            procs = f"RLIMIT_NPROC {cfg.max_procs} set but NOT enforced (REPL runs as root): fork bombs uncontained"
        kill = (
            "SIGKILL of every process of the REPL's uid (one kill(-1) as that uid, atomic against fork bombs, "
            "by a helper whose real uid the REPL cannot signal; a helper still running after 1 s is killed "
            "and replaced)"
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
        report.update(self._containment_report(zr.get("seccomp") == "ok", ns.get("ipc", False)))
        report["notes"] = list(zr.get("notes", []))
        return report

    def _containment_report(self, seccomp: bool, ipc_ns: bool) -> dict[str, str]:
        """Memory outside the address space, IPC, cleanup and messages to the host (issue 57's classes)."""
        cfg = self.config
        memcg = self._memcg
        return {
            "memory": (
                f"RLIMIT_AS {cfg.memory_mb} MB per process; "
                + (
                    f"a memory cgroup per REPL (cgroup {memcg.version}): everything it holds, its files in the "
                    f"scratch tmpfs included, counts against {cfg.memory_mb} MB (no swap); over it the kernel's "
                    "OOM killer kills inside that REPL only; "
                    if memcg is not None
                    else f"no memory cgroup per REPL ({self._memcg_why}); "
                )
                + (
                    "memory outside the address space is refused: memfd_create, SysV shared memory and POSIX "
                    "message queues (seccomp), and /dev/shm is not writable; "
                    if seccomp
                    else "NOT refused without seccomp: memfd files and SysV segments escape RLIMIT_AS; "
                )
                + f"the scratch tmpfs holds {cfg.scratch_mb} MB at most, shared by the sandbox's REPLs"
            ),
            "ipc": (
                "SysV IPC and POSIX message queues refused (seccomp)"
                + ("; a private IPC namespace for the sandbox" if ipc_ns else "")
                if seccomp
                else "NOT refused: REPLs of the sandbox share "
                + ("its IPC namespace" if ipc_ns else "the host's IPC namespace")
            ),
            "cleanup": (
                "each trajectory has a scratch dir of its own name (a restart after a kill keeps it); on close its "
                "processes are killed and the dir removed by rm -rf (any depth, count, names or permissions); a "
                "failed removal is logged and counted in ReplSandbox.stats, and the dir is left to root, never reused"
            ),
            "messages": (
                f"a REPL's message to the host is bounded before it is parsed: {cfg.max_message_mb} MiB "
                f"(max_message_mb), {_wire.MAX_ITEMS:,} items, {_wire.MAX_DEPTH} levels of nesting; over them "
                "a sub-call fails in the REPL's code with the reason, and a frame written by other means is "
                "refused and the REPL restarted"
            ),
        }

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
        if self._memcg is not None:
            self._memcg.close()

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

    def _next_trajectory(self) -> int:
        with self._lock:
            self._trajectories += 1
            return self._trajectories

    def _release(self, zygote: _ZygoteClient, slot: int, trajectory: int) -> concurrent.futures.Future:
        """Ask the zygote to kill a slot's processes and remove the trajectory's scratch dir. The
        outcome is counted in ``stats`` (a failed removal is logged too) whoever waits for it, before
        the returned future completes."""
        counted: concurrent.futures.Future = concurrent.futures.Future()

        def count(fut: concurrent.futures.Future) -> None:
            if fut.cancelled() or fut.exception() is not None:
                counted.set_exception(fut.exception() or SandboxError("release cancelled"))
                return
            cleanup = fut.result().get("cleanup")
            if cleanup is not None and cleanup != "ok":
                logger.warning("REPL slot %d: its scratch dir's cleanup %s", slot, cleanup)
            if cleanup is not None:
                with self._lock:
                    self.stats["cleanups"] += 1
                    self.stats["cleanup_failures"] += cleanup != "ok"
            counted.set_result(fut.result())

        zygote.request({"op": "release", "slot": slot, "trajectory": trajectory}).add_done_callback(count)
        return counted

    def _release_slot(self, slot: int) -> None:
        with self._lock:
            self._repls.pop(slot, None)
            self._free.append(slot)
