"""``workers.event_loop.LoopThread``: the one private event-loop thread (the sandbox's and the agent envs')."""

from __future__ import annotations

import asyncio

import pytest

from workers.event_loop import LoopThread


def test_runs_coroutines_from_any_thread_and_refuses_its_own():
    loop = LoopThread(name="test-loop")
    try:

        async def add(a, b):
            await asyncio.sleep(0)
            return a + b

        assert loop.run(add(1, 2)) == 3

        async def reenter():
            return loop.run(add(1, 1))  # from the loop's own thread: would wait for itself forever

        with pytest.raises(RuntimeError, match="deadlock"):
            loop.run(reenter())
    finally:
        loop.stop()
    assert loop.loop.is_closed()
    with pytest.raises(RuntimeError, match="stopped"):
        loop.run(add(1, 2))
