"""`WeightSync` picks its strategy from the placement and refuses the inconsistent ones (no Ray needed: the
groups are stand-ins; the syncs themselves run in tests/recipes/test_weight_sync_roles.py and
tests/workers/roles/)."""

import pytest

from workers.weight_sync import WeightSync


class Sent:
    """Stands in for the DataProtoFuture of a ``blocking=False`` call (the call has run)."""

    def __init__(self, result):
        self.result, self.clock_restarted = result, False

    def restart_clock(self):
        self.clock_restarted = True

    def get(self):
        # a sync queued behind the update: its time limit must count from the wait, not from the send
        assert self.clock_restarted, "waited for a queued sync without restarting its clock"
        return self.result


class SyncMethod:
    """Stands in for a group method: a plain call waits, ``with_options(blocking=False)`` returns a future."""

    def __init__(self, group):
        self.group = group

    def __call__(self, version=None):
        return self.group.run_sync(version)

    def with_options(self, blocking=True):
        return self if blocking else (lambda version=None: Sent(self.group.run_sync(version)))


class Group:
    """Stands in for a RayWorkerGroup whose in-process sync returns rank 0's metrics."""

    def __init__(self):
        self.calls = []
        self.sync_weights = SyncMethod(self)

    def shares_processes_with(self, other) -> bool:
        """A colocated role pair runs on the same actors; here the same stand-in stands for that."""
        return other is self

    def run_sync(self, version):
        self.calls.append("sync_weights")
        self.versions = [*getattr(self, "versions", []), version]
        return {"perf/weight_sync_bytes": 12, "timing_s/update_weights": 0.0}


def test_strategy_follows_the_placement():
    hybrid, trainer, rollout = Group(), Group(), Group()
    assert WeightSync.for_groups(hybrid, hybrid).strategy == "colocated"
    assert WeightSync.for_groups(hybrid, hybrid, rollout_tp=2).strategy == "resharded"
    assert WeightSync.for_groups(trainer, rollout, rollout_tp=2).strategy == "disaggregated"


def test_inconsistent_strategies_are_refused():
    a, b = Group(), Group()
    with pytest.raises(ValueError, match="'disaggregated' needs a separate rollout group"):
        WeightSync(a, a, "disaggregated")
    with pytest.raises(ValueError, match="'colocated' needs the actor group as its rollout group"):
        WeightSync(a, b, "colocated")
    with pytest.raises(ValueError, match="must be one of"):
        WeightSync(a, a, "nccl")
    with pytest.raises(ValueError, match="bucket_bytes applies to the disaggregated"):
        WeightSync(a, a, "colocated").sync(bucket_bytes=1024)
    with pytest.raises(ValueError, match="abort_running applies to the disaggregated"):
        WeightSync(a, a, "colocated").sync(abort_running=True)  # no generation runs beside an in-process sync
    assert a.calls == []


def test_colocated_sync_reports_bytes_and_controller_time():
    group = Group()
    sync = WeightSync(group, group, "colocated")
    m = sync.sync()
    assert group.calls == ["sync_weights"]
    assert m["perf/weight_sync_bytes"] == 12.0 and m["timing_s/update_weights"] > 0
    assert sync.syncs == 1 and sync.last == m and sync.link is None
    sync.sync(version=4)  # the policy version the rollout engines tag their tokens with
    assert group.versions == [None, 4]


def test_submitted_sync_is_sent_at_once_and_waited_for_later():
    """The chained form (recipes: update, then the sync queued behind it): sent without waiting; the metrics
    come from the wait. A disaggregated sync has no such form."""
    group = Group()
    sync = WeightSync(group, group, "colocated")
    wait = sync.submit(version=3)
    assert wait is not None and group.calls == ["sync_weights"] and sync.syncs == 0
    m = wait()
    assert m["perf/weight_sync_bytes"] == 12.0 and m["timing_s/update_weights"] >= 0 and group.versions == [3]
    assert sync.syncs == 1 and sync.last == m
    assert WeightSync(Group(), Group(), "disaggregated").submit(version=1) is None
