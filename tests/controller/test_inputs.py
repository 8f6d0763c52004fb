"""Declared inputs: ``@register(..., inputs=Inputs(...))`` sends only the columns a method reads (selected on the
controller before the object store), checks the required ones on arrival, and makes an undeclared read fail
with the method and the column named."""

import sys

import numpy as np
import pytest
import ray
import torch

from controller import (
    Dispatch,
    Inputs,
    RayClassWithInitArgs,
    RayWorkerGroup,
    Worker,
    WorkerGroupError,
    register,
)
from dataproto import DataProto
from resource_pools import ResourcePool

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

READS = Inputs(batch=("ids",), non_tensor=("uid",), optional=("mask", "hint"))


class ReaderWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO, inputs=READS)
    def columns(self, data: DataProto) -> DataProto:
        """What arrived: the column names (as a row each) and the meta_info keys."""
        seen = sorted(data.batch) + sorted(data.non_tensor_batch)
        meta = sorted(data.meta_info)
        return DataProto.from_dict(
            {"ids": data.batch["ids"] * 2},
            non_tensors={"seen": [seen] * len(data), "meta": [meta] * len(data)},
        )

    @register(Dispatch.DP_COMPUTE_PROTO, inputs=READS)
    def reads_undeclared(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["trajectory_ids"]})

    @register(Dispatch.DP_COMPUTE_PROTO, inputs=READS)
    def returns_its_input(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.DP_COMPUTE_PROTO)
    def everything(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(
            non_tensors={"seen": [sorted(data.batch) + sorted(data.non_tensor_batch)] * len(data)}
        )


def _batch(rows: int = 4, **extra_tensors) -> DataProto:
    return DataProto.from_dict(
        {
            "ids": torch.arange(rows),
            "mask": torch.ones(rows),
            "trajectory_ids": torch.zeros(rows, 64),
            **extra_tensors,
        },
        non_tensors={"uid": [f"u{i}" for i in range(rows)], "trajectory": ["{...}" * 100] * rows},
        meta_info={"temperature": 0.7},
    )


def test_select_keeps_declared_columns_present_and_all_meta_info():
    data = _batch()
    out = READS.select(data)
    assert sorted(out.batch) == ["ids", "mask"] and sorted(out.non_tensor_batch) == ["uid"]
    assert out.meta_info == {"temperature": 0.7} and len(out) == 4
    assert out.batch["ids"] is data.batch["ids"]  # shared, not copied


def test_inputs_reject_a_bare_string():
    with pytest.raises(TypeError, match="sequence of column names"):
        Inputs(batch="ids")
    with pytest.raises(TypeError, match="must be an Inputs"):
        register(Dispatch.DP_COMPUTE_PROTO, inputs=("ids",))


def test_direct_call_sees_only_declared_columns_and_names_an_undeclared_read():
    worker = ReaderWorker()
    out = worker.columns(_batch())
    assert out.non_tensor_batch["seen"][0] == ["ids", "mask", "uid"]
    assert out.non_tensor_batch["meta"][0] == ["temperature"]
    with pytest.raises(
        KeyError, match=r"ReaderWorker rank 0/1: reads_undeclared read batch\['trajectory_ids'\]"
    ):
        worker.reads_undeclared(_batch())
    with pytest.raises(KeyError, match=r"reads_undeclared needs batch key\(s\) \['ids'\]"):
        worker.reads_undeclared(DataProto.from_dict({"mask": torch.ones(2)}, non_tensors={"uid": ["a", "b"]}))
    with pytest.raises(KeyError, match=r"columns needs non_tensor_batch key 'uid'"):
        worker.columns(DataProto.from_dict({"ids": torch.ones(2)}))
    returned = worker.returns_its_input(_batch())
    assert type(returned.batch) is dict and type(returned.non_tensor_batch) is dict


def test_optional_input_absent_says_so():
    class OptionalReader(Worker):
        @register(Dispatch.DP_COMPUTE_PROTO, inputs=READS)
        def hint(self, data):
            return data.non_tensor_batch["hint"]

    with pytest.raises(
        KeyError, match=r"read optional input non_tensor_batch\['hint'\], which this batch lacks"
    ):
        OptionalReader().hint(_batch())


@pytest.fixture(scope="module")
def readers(ray_session):
    pool = ResourcePool([2], name="test_inputs")
    wg = RayWorkerGroup(
        pool, RayClassWithInitArgs(ReaderWorker), name_prefix="readers", chunks_by_value=False
    )
    yield wg
    wg.shutdown()
    pool.remove()


def _record_puts(monkeypatch) -> list:
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda v, **kw: puts.append(v) or real_put(v, **kw))
    return puts


def test_group_puts_only_declared_columns(readers, monkeypatch):
    puts = _record_puts(monkeypatch)
    out = readers.columns(_batch(5))
    assert out.batch["ids"].tolist() == [0, 2, 4, 6, 8]
    assert len(puts) == 2 and all(isinstance(p, DataProto) for p in puts)
    for chunk in puts:  # selected before the object store: the trajectory columns never left the controller
        assert sorted(chunk.batch) == ["ids", "mask"] and sorted(chunk.non_tensor_batch) == ["uid"]
        assert chunk.meta_info == {"temperature": 0.7}
    assert all(seen == ["ids", "mask", "uid"] for seen in out.non_tensor_batch["seen"])


def test_future_resolved_on_the_controller_ships_only_declared_columns(readers, monkeypatch):
    """A chained call's future from a group of another size (3 chunks for 2 ranks) is fetched and re-chunked
    here: the re-chunked batch carries only the columns the method declares, like a plain batch."""
    pool = ResourcePool([3], name="test_inputs_3")
    three = RayWorkerGroup(pool, RayClassWithInitArgs(ReaderWorker), name_prefix="readers3")
    try:
        future = three.echo.with_options(blocking=False)(_batch(6))
        puts = _record_puts(monkeypatch)
        out = readers.columns(future)
        assert out.batch["ids"].tolist() == [0, 2, 4, 6, 8, 10]
        assert len(puts) == 2
        for chunk in puts:
            assert sorted(chunk.batch) == ["ids", "mask"] and sorted(chunk.non_tensor_batch) == ["uid"]
        assert "trajectory" in future.get().non_tensor_batch  # the future itself keeps every column
    finally:
        three.shutdown()
        pool.remove()


def test_undeclared_method_gets_the_whole_batch(readers):
    out = readers.everything(_batch(2))
    assert list(out.non_tensor_batch["seen"][0]) == ["ids", "mask", "trajectory_ids", "trajectory", "uid"]


def test_group_call_reading_an_undeclared_column_fails_naming_method_and_column(readers):
    with pytest.raises(
        WorkerGroupError, match=r"reads_undeclared read batch\['trajectory_ids'\], which its "
    ):
        readers.reads_undeclared(_batch(2))


def test_non_tensor_columns_stay_object_arrays():
    out = READS.select(_batch())
    assert isinstance(out.non_tensor_batch["uid"], np.ndarray) and out.non_tensor_batch["uid"].dtype == object
