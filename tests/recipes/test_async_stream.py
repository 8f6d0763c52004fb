"""The rollout stream's own rules (``recipes/trainer/async_rl.py``) on real Ray actors whose generation is
scripted (a stand-in for the engine: its version, speed and failures are set by the test): the buffer bound,
whole groups, staleness drops that regenerate, and a failing generation that stops the trainer with the
rank's error instead of a hang."""

import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch

from controller import Dispatch, RayClassWithInitArgs, RayWorkerGroup, Worker, WorkerGroupError, register
from dataproto import DataProto
from recipes.config import load_config
from recipes.trainer.async_rl import RolloutStream
from resource_pools import ResourcePool

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
N = 2  # samples per prompt


class ScriptedRollout(Worker):
    """``generate_sequences``: N rows per prompt whose 3 response tokens carry the worker's current version."""

    def __init__(self):
        self.version, self.calls, self.fail_at, self.delay_s = 0, 0, None, 0.0

    @register(Dispatch.ONE_TO_ALL)
    def script(self, version=None, fail_at=None, delay_s=None):
        self.version = self.version if version is None else version
        self.fail_at = fail_at
        self.delay_s = self.delay_s if delay_s is None else delay_s
        return self.calls

    @register(Dispatch.DP_SPLIT_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("engine died")
        time.sleep(self.delay_s)
        out = prompts.repeat(N, interleave=True)
        rows = len(out)
        out.batch["responses"] = torch.ones(rows, 3, dtype=torch.long)
        out.batch["response_mask"] = torch.ones(rows, 3)
        out.batch["rollout_versions"] = torch.full((rows, 3), self.version)
        out.batch["rollout_aborted"] = torch.zeros(rows, dtype=torch.bool)
        return out


@pytest.fixture
def rollout(ray_session):
    pool = ResourcePool([1], name="test_async_stream_pool")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ScriptedRollout), name_prefix="rollout")
    yield wg
    wg.shutdown()
    pool.remove()


def prompt_batches(batch_size: int):
    """Endless prompt batches with distinct uids p0, p1, ..."""
    k = 0
    while True:
        uids = np.array([f"p{k + i}" for i in range(batch_size)], dtype=object)
        yield DataProto.from_dict({"input_ids": torch.ones(batch_size, 4, dtype=torch.long)}, {"uid": uids})
        k += batch_size


def stream(rollout, *overrides):
    cfg = load_config(
        "grpo_async", ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2", f"rollout.n={N}", *overrides]
    )
    # stands in for the weight sync: the scripted engine takes the new version at once
    weight_sync = SimpleNamespace(sync=lambda version, abort_running: rollout.script(version=version) and {})
    roles = SimpleNamespace(generator=rollout, weight_sync=weight_sync)  # the group that generates
    return RolloutStream(cfg, roles, prompt_batches(2), poll_s=0.005)


def settle(s: RolloutStream, timeout_s: float = 30.0) -> None:
    """Wait until the stream has no call in flight and holds as many groups as its bounds let it start: it
    starts nothing more until a take or a weight update (a fixed sleep was a race on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with s._cond:
            if not s._inflight and s._room() <= 0:
                return
        time.sleep(0.005)
    raise AssertionError(f"the stream did not settle in {timeout_s} s")


def test_the_buffer_holds_at_most_buffer_batches_and_groups_stay_whole(rollout):
    overrides = ["async_rl.buffer_batches=2", "async_rl.groups_per_call=1", "async_rl.max_staleness=5"]
    with stream(rollout, *overrides) as s:
        batch, metrics = s.take(0)
        assert list(batch.non_tensor_batch["uid"]) == ["p0", "p0", "p1", "p1"]  # whole groups, in order
        settle(s)  # the stream fills the buffer up to 2 batches = 4 groups, then waits
        assert rollout.script()[0] == 2 + 4
        assert s.take(0)[1]["async/buffer_groups"] == 2.0
    assert metrics["async/staleness_max"] == 0.0 and metrics["async/trainer_idle_s"] >= 0


def test_generation_runs_ahead_only_as_far_as_max_staleness_allows(rollout):
    """Taken in order, a batch per version: after the trainer took batch 1 (version 0) and before version 1
    reaches the engines, a group started now would be trained at version 1 at the earliest, so with
    max_staleness=1 only one more batch is started; the next once the new weights are in."""
    with stream(rollout, "async_rl.max_staleness=1", "async_rl.buffer_batches=4") as s:
        s.take(0)
        settle(s)
        assert rollout.script()[0] == 2  # p0 p1 | p2 p3 (groups_per_call=2): one batch ahead, not four
        s.sync_weights(1)
        settle(s)
        assert rollout.script()[0] == 3  # now a second batch ahead (trained at version 2 at the latest)
        batch, metrics = s.take(1)
    assert metrics["async/staleness_max"] == 1.0 and metrics["async/dropped_stale_groups"] == 0.0


def test_stale_groups_are_dropped_and_generated_again(rollout):
    with stream(rollout, "async_rl.max_staleness=1", "async_rl.buffer_batches=2") as s:
        s.take(0)
        settle(s)  # p2, p3 of version 0 wait in the buffer
        with s._cond:  # no new groups between the update and the take's drop (the lock is re-entrant)
            s.sync_weights(3)  # three updates at once, as if the trainer had moved on
            batch, metrics = s.take(3)  # version 0 is 3 behind: dropped, their prompts generated again by v3
    assert metrics["async/dropped_stale_groups"] == 2.0
    assert list(batch.non_tensor_batch["uid"]) == ["p2", "p2", "p3", "p3"]  # requeued first, in order
    assert set(batch.batch["rollout_versions"].flatten().tolist()) == {3}


def test_a_failed_generation_stops_the_trainer_with_the_ranks_error(rollout):
    rollout.script(fail_at=2)
    with stream(rollout) as s:
        s.take(0)
        with pytest.raises(
            WorkerGroupError, match=r"(?s)'rollout' rank 0 failed in 'generate_sequences'.*engine died"
        ):
            for _ in range(3):
                s.take(0)
