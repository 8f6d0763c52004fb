"""The life of one in-process ``sglang.Engine``: its processes, its death, its idle state, its shutdown.

``sglang.Engine`` runs its scheduler (one per TP rank) and detokenizer as child processes. Left to
itself, SGLang answers a dead child by killing the whole process tree *including the parent*
(``SIGQUIT`` -> ``kill_process_tree(os.getpid())``: the rollout worker exits 137, and a request in
flight never returns), and ``Engine.shutdown()`` kills every child of the calling process -- in a
driver that started Ray, Ray's own processes too. ``EngineLifecycle`` replaces both:

* it records the processes the engine started (and only those) and shuts down exactly them;
* it takes over ``SIGQUIT`` (sent by SGLang's scheduler on an exception and by its subprocess
  watchdog when a child dies): the engine is marked dead, its leftover processes are killed, a
  blocking call in flight is interrupted (its loop is stopped: SGLang's uvloop swallows exceptions
  raised in signal handlers) and raises ``SGLangEngineDied`` naming the engine and the last request,
  async callers get the same error, and every later call raises it at once;
* ``wait_idle`` polls ``flush_cache`` until the scheduler reports idle: SGLang *asserts* idleness
  in ``release_memory_occupation`` (the scheduler dies otherwise), and right after ``generate``
  returns the scheduler may still hold the finished batch.

Signal handlers can be installed only from the main thread; elsewhere a warning says so and a dead
child leaves the process to SGLang's default behaviour.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psutil  # SGLang's requirement: imported where a process is looked at, so the adapter imports without it

logger = logging.getLogger(__name__)


class SGLangEngineDied(RuntimeError):
    """The SGLang engine's scheduler or detokenizer process is gone."""


def _children() -> dict[int, psutil.Process]:
    import psutil

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):  # multiprocessing's, shared by the process
                out[p.pid] = p
        except psutil.NoSuchProcess:
            pass
    return out


class EngineLifecycle:
    """Wraps calls into one engine; see the module docstring."""

    def __init__(self, engine: Any, name: str, processes: list[psutil.Process]):
        """``processes``: the engine's own; with none (an engine built elsewhere) signals are left alone."""
        self.engine = engine
        self.name = name
        self.processes = processes
        self._names = {p.pid: _name(p) for p in processes}
        self.last_request = "none yet"
        self._death: str | None = None
        self._closed = False
        self._in_sync_call = False
        self._waiters: set[asyncio.Future] = set()
        sglang_shutdown = getattr(engine, "shutdown", None)
        if sglang_shutdown is not None:
            atexit.unregister(sglang_shutdown)  # SGLang's kills every child of this process
        atexit.register(self.shutdown)
        if processes:
            self._take_over_sigquit()

    @classmethod
    def start(cls, make_engine: Callable[..., Any], name: str) -> EngineLifecycle:
        """Build the engine with ``make_engine(custom_sigquit_handler=...)`` and record the processes it
        started. The handler replaces SGLang's launch-phase one, which kills this process when an engine
        process fails to start; then the engine's constructor raises instead, and its processes are killed."""
        before = set(_children())
        try:
            engine = make_engine(custom_sigquit_handler=_launch_failed)
        except BaseException as err:
            cls._kill([p for pid, p in _children().items() if pid not in before], name)
            _close_zmq(_traceback_locals(err.__traceback__))  # the half-built engine's channels
            raise
        started = [p for pid, p in _children().items() if pid not in before]
        return cls(engine, name, started)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # ------------------------------------------------------------------ calls
    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run a blocking engine call; ``what`` names it in the error if the engine dies meanwhile."""
        self._check_alive()
        self.last_request = what
        self._in_sync_call = True
        try:
            return fn()
        except RuntimeError as err:  # "Event loop stopped before Future completed": see _on_sigquit
            if self._death is not None:
                raise SGLangEngineDied(self._death) from err
            raise
        finally:
            self._in_sync_call = False

    async def acall(self, what: str, coro: Any) -> Any:
        """Await an engine coroutine, or raise ``SGLangEngineDied`` as soon as the engine dies."""
        self._check_alive()
        self.last_request = what
        loop = asyncio.get_running_loop()
        task = loop.create_task(coro)
        died = loop.create_future()
        self._waiters.add(died)
        try:
            await asyncio.wait({task, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiters.discard(died)
        if not task.done():
            task.cancel()
            self._check_alive()
        return task.result()

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Block until the scheduler is idle (its ``flush_cache`` succeeds), or raise after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            result = self.call("flush_cache (waiting for the engine to be idle)", self.engine.flush_cache)
            if getattr(result, "success", True) is not False:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"SGLang engine {self.name} still has requests in flight after {timeout_s:.0f} s "
                    f"(last request: {self.last_request}); release/flush need an idle engine"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    # ------------------------------------------------------------------ death and shutdown
    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError(f"SGLang engine {self.name} was shut down")
        if self._death is not None:
            raise SGLangEngineDied(self._death)

    def _take_over_sigquit(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "SGLang engine %s was built off the main thread: if one of its processes dies, "
                "SGLang's own handler ends this process",
                self.name,
            )
            return
        tokenizer_manager = getattr(self.engine, "tokenizer_manager", None)
        loop = getattr(self.engine, "loop", None)
        if tokenizer_manager is not None and loop is not None:
            # SGLang registers its SIGQUIT handler on the engine's loop at the first request; make that
            # happen now (inside the loop, as a request would), then register ours in its place. The loop
            # runs it on its next turn: at once during a call, else when the next call starts.
            async def create_handle_loop():
                tokenizer_manager.auto_create_handle_loop()

            loop.run_until_complete(create_handle_loop())
            loop.add_signal_handler(signal.SIGQUIT, self._on_sigquit)
        else:
            signal.signal(signal.SIGQUIT, self._on_sigquit)

    def _on_sigquit(self, *_signal_args) -> None:
        if self._closed or self._death is not None:
            return
        states = ", ".join(f"{self._names[p.pid]} (pid {p.pid}) {_state(p)}" for p in self.processes)
        self._death = (
            f"SGLang engine {self.name} died: one of its processes exited or reported a fatal error "
            f"(at that moment: {states}; all are killed now); last request: {self.last_request}. "
            "The engine's log above has the cause."
        )
        logger.error(self._death)
        self._stop_watchdog()
        self._kill_processes()
        for waiter in list(self._waiters):
            waiter.get_loop().call_soon_threadsafe(_set_done, waiter)
        loop = getattr(self.engine, "loop", None)
        if self._in_sync_call and loop is not None:  # the blocking call would wait forever for its answer
            loop.call_soon_threadsafe(loop.stop)

    def _stop_watchdog(self) -> None:
        watchdog = getattr(getattr(self.engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()

    def _kill_processes(self) -> None:
        self._kill(self.processes, self.name)

    @staticmethod
    def _kill(processes: list[psutil.Process], name: str) -> None:
        """SIGKILL, as SGLang's own shutdown does: its scheduler does not exit on SIGTERM while serving."""
        import psutil

        for p in processes:
            try:
                p.kill()
            except psutil.NoSuchProcess:  # gone, or a zombie that wait_procs reaps
                pass
        _, alive = psutil.wait_procs(processes, timeout=10.0)
        if alive:
            logger.error("SGLang engine %s: processes %s did not exit after SIGKILL", name, alive)

    def shutdown(self) -> None:
        """Stop the engine's processes (and only those); idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._stop_watchdog()
        self._kill_processes()
        _close_zmq([self.engine, getattr(self.engine, "tokenizer_manager", None)])
        loop = getattr(self.engine, "loop", None)
        if self.processes and loop is not None and threading.current_thread() is threading.main_thread():
            loop.remove_signal_handler(signal.SIGQUIT)


def _close_zmq(objects) -> None:
    """Close the zmq sockets among ``objects`` and their attributes (the engine's channels in this process),
    with their contexts, without lingering. Left to the garbage collector, a context whose socket still holds
    a message for a dead engine blocks the collecting thread in ``Context.term`` forever (seen: a test session
    hung in a later test's model construction)."""
    import zmq  # sglang's dependency: present wherever an engine ran

    contexts = set()
    for obj in objects:
        for value in [obj, *(vars(obj).values() if hasattr(obj, "__dict__") else ())]:
            if isinstance(value, zmq.Socket):
                contexts.add(value.context)
    for context in contexts:
        context.destroy(linger=0)


def _traceback_locals(tb) -> list:
    """The local variables of every frame of a traceback (a constructor's half-built ``self`` among them)."""
    out = []
    while tb is not None:
        out += list(tb.tb_frame.f_locals.values())
        tb = tb.tb_next
    return out


def _launch_failed(*_signal_args) -> None:
    """SIGQUIT while an engine starts (module level: SGLang pickles its server args to its processes)."""
    logger.error("SGLang: an engine process failed while starting (its log is above)")


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _name(process: psutil.Process) -> str:
    import psutil

    try:
        return process.name()
    except psutil.NoSuchProcess:
        return "process"


def _state(process: psutil.Process) -> str:
    import psutil

    try:
        return "gone" if process.status() == psutil.STATUS_ZOMBIE else "still running"
    except psutil.NoSuchProcess:
        return "gone"
