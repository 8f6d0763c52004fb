"""Two ways synchronous code drives async code: ``LoopThread``, a private asyncio event loop on a daemon thread,
and ``CallerLoop``, a loop that the calling thread runs (an engine's own loop).

Shared by the REPL sandbox (its synchronous API) and the agent environments (engines and sandboxes stay bound
to one loop across calls); it lives here, beside both, so neither imports the other for it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["CallerLoop", "LoopThread"]

T = TypeVar("T")


class LoopThread:
    """``run(coro)`` from any thread (also one whose own loop is running, as in a Ray actor or a notebook)
    waits for the result on this object's loop. ``run`` from the loop's own thread would wait for itself
    forever, so it raises ``RuntimeError`` instead."""

    def __init__(self, name: str = "event-loop"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(
                f"LoopThread.run called from its own thread ({self.thread.name}) would deadlock"
            )
        if not self.thread.is_alive():
            coro.close()
            raise RuntimeError("the loop thread is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


class CallerLoop:
    """An event loop that the calling thread drives (``run`` = ``run_until_complete``), for an engine whose replies
    are read on its own loop between calls: SGLang's adapter (its async calls must run on ``engine.loop``, where
    SGLang's reply reader lives; a loop on another thread would send requests whose replies nobody reads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def stop(self) -> None:  # the engine owns the loop
        pass
