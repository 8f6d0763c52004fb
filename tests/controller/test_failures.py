"""A worker that raises, one that dies mid-call while its peer is blocked, one that is too slow, and one
whose constructor raises: the controller raises WorkerGroupError naming role, rank and method, promptly."""

import os
import pickle
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from controller import (
    Dispatch,
    RayClassWithInitArgs,
    RayWorkerGroup,
    Worker,
    WorkerGroupError,
    WorkerGroupTimeoutError,
    create_colocated_worker_cls,
    register,
    wait,
)
from dataproto import DataProto
from resource_pools import ResourcePool

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FlakyWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def boom(self):
        if self.rank == 1:
            raise ValueError("bad input on rank 1 (marker-7f3a)")
        return self.rank

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def boom_async(self, data):
        if self.rank == 1:
            raise KeyError("missing key 'values' (marker-19c2)")
        return data

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        time.sleep(seconds * (self.rank + 1))
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def die(self):
        if self.rank == 1:
            os._exit(7)
        time.sleep(120)  # stands in for a rank blocked in a collective on the dead peer

    @register(Dispatch.ONE_TO_ALL)
    def die_after_peer_error(self):
        if self.rank == 1:
            time.sleep(0.3)
            os._exit(7)
        # rank 0's collective breaks first (gloo: "Connection reset by peer") while rank 1 is still dying
        raise RuntimeError("collective broken: connection reset by peer")

    @register(Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


class BrokenInitWorker(Worker):
    def __init__(self):
        if self.rank == 1:
            raise RuntimeError("cannot load weights (marker-c0de)")


class SlowInitWorker(Worker):
    """Its constructor leaves a file in ``meeting`` and returns once ``expected`` constructors have (or after 30 s),
    recording when it ran (wall clock: the ranks are processes). Constructors that run one after another never
    meet, however loaded the machine: the first gives up before the second begins."""

    def __init__(self, meeting: str, expected: int):
        self.started = time.time()
        Path(meeting, str(os.getpid())).touch()
        deadline = time.monotonic() + 30
        while len(os.listdir(meeting)) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        self.finished = time.time()

    @register(Dispatch.ONE_TO_ALL)
    def span(self):
        return self.started, self.finished


@pytest.fixture(scope="module")
def pool(ray_session):
    # Three groups share the same two bundles (a third of a CPU each).
    pool = ResourcePool([2], max_colocate_count=3, name="test_failures_pool")
    yield pool
    pool.remove()


@pytest.fixture(scope="module")
def flaky(pool):
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(FlakyWorker), name_prefix="flaky")
    yield wg
    wg.shutdown()


@pytest.mark.timeout(60)
def test_worker_exception_names_role_rank_method_and_traceback(flaky):
    with pytest.raises(WorkerGroupError) as info:
        flaky.boom()
    err = info.value
    assert (err.role, err.rank, err.method) == ("flaky", 1, "boom")
    assert "ValueError: bad input on rank 1 (marker-7f3a)" in err.reason
    assert "in boom" in err.remote_traceback and "marker-7f3a" in err.remote_traceback
    assert "worker group 'flaky' rank 1 failed in 'boom'" in str(err)
    assert flaky.nap(0) == [0, 1]  # a raising method leaves the actors usable


@pytest.mark.timeout(60)
def test_failed_future_raises_on_get(flaky):
    fut = flaky.boom_async(DataProto.from_dict({"x": torch.arange(4)}))
    with pytest.raises(WorkerGroupError, match=r"'flaky' rank 1 failed in 'boom_async'.*marker-19c2"):
        fut.get()


@pytest.mark.timeout(60)
def test_call_timeout_names_pending_ranks(flaky):
    start = time.monotonic()
    with pytest.raises(WorkerGroupTimeoutError) as info:
        flaky.nap.with_options(timeout_s=1.0)(1.5)  # rank 0 sleeps 1.5 s, rank 1 3 s
    assert time.monotonic() - start < 2.0
    assert info.value.pending_ranks == [0, 1] and info.value.method == "nap"
    assert "no result after 1s from rank(s) [0, 1]" in str(info.value)


@pytest.mark.timeout(60)
def test_worker_killed_mid_call_fails_fast(pool):
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(FlakyWorker), name_prefix="doomed")
    try:
        start = time.monotonic()
        with pytest.raises(WorkerGroupError) as info:
            wg.die()  # rank 1 exits, rank 0 would block for 120 s
        assert time.monotonic() - start < 20
        err = info.value
        assert (err.role, err.rank, err.method) == ("doomed", 1, "die")
        assert err.reason == "the worker actor died" and "died" in err.remote_traceback
        with pytest.raises(WorkerGroupError, match="rank 1 failed in 'pid': the worker actor died"):
            wg.pid()
    finally:
        wg.shutdown()


@pytest.mark.timeout(60)
def test_a_death_is_named_before_the_peer_errors_it_caused(pool, monkeypatch):
    """Rank 0 raises at once because its peer is dying; rank 1 dies 0.3 s later: the error names the death (a
    fault a restart can mend), not rank 0's broken collective (which would end the run as a raised error).
    The grace is widened: on a loaded machine Ray may report the death later than 2 s, and the wait returns as
    soon as it lands anyway."""
    monkeypatch.setattr(wait, "DEATH_GRACE_S", 30.0)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(FlakyWorker), name_prefix="doomed")
    try:
        with pytest.raises(WorkerGroupError) as info:
            wg.die_after_peer_error()
        err = info.value
        assert (err.rank, err.kind, err.is_fault) == (1, "died", True), err
    finally:
        wg.shutdown()


@pytest.mark.timeout(60)
def test_a_colocated_process_that_dies_is_named_with_every_role_it_held(ray_session):
    """A process of a colocated pool holds several roles; the role whose call saw the death first is only one
    of them (a SIGKILLed trainer process was reported as "worker group 'reward' rank 1 failed in
    'compute_rm_score'"). The error names the process: its pid, its pool and every role it held."""
    pool = ResourcePool([2], name="fault_naming_pool")
    fused = create_colocated_worker_cls(
        {"actor": RayClassWithInitArgs(FlakyWorker), "reward": RayClassWithInitArgs(FlakyWorker)}
    )
    group = RayWorkerGroup(pool, fused, name_prefix="actor_reward")
    try:
        roles = group.spawn(prefix_set={"actor", "reward"})
        pids = roles["reward"].pid()
        with pytest.raises(WorkerGroupError) as err:
            roles["reward"].die()
        assert err.value.kind == "died" and (err.value.role, err.value.rank) == ("reward", 1)
        named = f"its process (pid {pids[1]}, pool 'fault_naming_pool') held the roles 'actor', 'reward'"
        assert err.value.summary().endswith(named), err.value.summary()
        assert named in str(err.value)
        assert pickle.loads(pickle.dumps(err.value)).summary() == err.value.summary()  # as Ray ships it
    finally:
        group.shutdown()
        pool.remove()


def test_ray_kill_mid_call_fails_fast(flaky):
    pending = flaky.nap.with_options(blocking=False)(30)
    ray.kill(flaky.actors[0])
    start = time.monotonic()
    with pytest.raises(WorkerGroupError, match="'flaky' rank 0 failed in 'nap': the worker actor died"):
        pending.get()
    assert time.monotonic() - start < 20


@pytest.mark.timeout(60)
def test_constructor_error_names_rank_and_init(pool):
    with pytest.raises(WorkerGroupError) as info:
        RayWorkerGroup(pool, RayClassWithInitArgs(BrokenInitWorker), name_prefix="broken")
    err = info.value
    assert (err.role, err.rank, err.method) == ("broken", 1, "__init__")
    assert err.reason == "the worker's constructor raised" and "marker-c0de" in err.remote_traceback


@pytest.mark.timeout(90)
def test_groups_started_without_waiting_construct_at_once_and_a_failure_names_its_group(pool, tmp_path):
    one = ResourcePool([1], max_colocate_count=2, name="test_failures_start_together")
    try:
        first, second = (
            RayWorkerGroup(
                one, RayClassWithInitArgs(SlowInitWorker, str(tmp_path), 2), name_prefix=n, wait=False
            )
            for n in ("first", "second")
        )
        RayWorkerGroup.wait_ready([first, second])
        (first_span,), (second_span,) = first.span(), second.span()
        # each constructor began before the other ended: the two groups' processes started together
        assert max(first_span[0], second_span[0]) < min(first_span[1], second_span[1])
        second.shutdown()

        broken = RayWorkerGroup(
            pool, RayClassWithInitArgs(BrokenInitWorker), name_prefix="broken", wait=False
        )
        with pytest.raises(WorkerGroupError) as info:
            RayWorkerGroup.wait_ready([first, broken])  # first is ready already: broken's failure decides
        assert (info.value.role, info.value.rank, info.value.method) == ("broken", 1, "__init__")
        assert "marker-c0de" in info.value.remote_traceback
    finally:
        one.remove()
