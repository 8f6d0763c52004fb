"""DataProto: every operation, every error, and zero-copy transfer through Ray."""

import pickle

import numpy as np
import pytest
import torch

from dataproto import DataProto, pad_dataproto_to_divisor, unpad_dataproto


def make(n=6, meta=None):
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n * 3).view(n, 3), "score": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "info": [{"row": i} for i in range(n)]},
        meta_info=meta or {"temperature": 1.0},
    )


def rows(data):
    return data.non_tensor_batch["uid"].tolist()


# ---------------------------------------------------------------- construction and validation
def test_from_dict_and_len_and_item():
    data = make(4)
    assert len(data) == 4
    item = data[2]
    assert torch.equal(item.batch["ids"], torch.tensor([6, 7, 8]))
    assert item.non_tensor_batch["info"] == {"row": 2}
    assert item.meta_info == {"temperature": 1.0}
    assert data[-1].non_tensor_batch["uid"] == "u3"
    with pytest.raises(IndexError, match="out of range"):
        data[4]


def test_from_single_dict_splits_tensors_and_objects():
    data = DataProto.from_single_dict({"x": torch.zeros(2, 5), "name": np.array(["a", "b"], dtype=object)})
    assert list(data.batch) == ["x"] and list(data.non_tensor_batch) == ["name"]
    with pytest.raises(TypeError, match="'bad'"):
        DataProto.from_single_dict({"bad": 3})


def test_non_tensor_lists_of_lists_stay_one_object_per_row():
    data = DataProto.from_dict(non_tensors={"turns": [[1, 2], [3, 4]]})
    assert len(data) == 2 and data.non_tensor_batch["turns"][1] == [3, 4]


def test_mismatched_lengths_name_the_keys():
    with pytest.raises(ValueError, match=r"batch\['b'\] has 3 rows but batch\['a'\] has 2"):
        DataProto.from_dict({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"non_tensor_batch\['s'\] has 1 rows"):
        DataProto.from_dict({"a": torch.zeros(2)}, {"s": ["x"]})


def test_wrong_types_name_the_key():
    with pytest.raises(TypeError, match=r"batch\['a'\] must be a torch.Tensor"):
        DataProto(batch={"a": [1, 2]})
    with pytest.raises(TypeError, match="non_tensor_batch\\['t'\\] is a torch.Tensor"):
        DataProto.from_dict(non_tensors={"t": torch.zeros(2)})
    with pytest.raises(ValueError, match="0-d tensor"):
        DataProto.from_dict({"s": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="meta_info must be a dict"):
        DataProto(meta_info=[1])


# ---------------------------------------------------------------- indexing
def test_slicing_and_index_arrays():
    data = make(6)
    assert rows(data[1:4]) == ["u1", "u2", "u3"]
    assert rows(data[::2]) == ["u0", "u2", "u4"]
    assert rows(data[[5, 0]]) == ["u5", "u0"]
    assert rows(data[np.array([True, False] * 3)]) == ["u0", "u2", "u4"]
    assert rows(data[torch.tensor([3, 3])]) == ["u3", "u3"]
    assert torch.equal(data[[5, 0]].batch["score"], torch.tensor([5.0, 0.0]))
    with pytest.raises(ValueError, match="boolean mask has length 2"):
        data.select_idxs(np.array([True, False]))
    with pytest.raises(IndexError, match="index 9 out of range"):
        data[[9]]
    with pytest.raises(TypeError, match="DataProto indices"):
        data["ids"]


# ---------------------------------------------------------------- key operations
def test_select_pop_and_unknown_keys():
    data = make(3, meta={"a": 1, "b": 2})
    sub = data.select(batch_keys=["ids"], non_tensor_batch_keys=["uid"], meta_info_keys=["a"])
    assert list(sub.batch) == ["ids"] and list(sub.non_tensor_batch) == ["uid"] and sub.meta_info == {"a": 1}
    assert sub.batch["ids"].data_ptr() == data.batch["ids"].data_ptr()  # shared, not copied
    deep = data.select(batch_keys=["ids"], deepcopy=True)
    assert deep.batch["ids"].data_ptr() != data.batch["ids"].data_ptr()
    with pytest.raises(KeyError, match=r"batch key\(s\) \['nope'\] not found"):
        data.select(batch_keys=["nope"])
    with pytest.raises(KeyError, match="meta_info"):
        data.select(meta_info_keys=["zzz"])

    popped = data.pop(batch_keys=["score"], non_tensor_batch_keys=["info"], meta_info_keys=["b"])
    assert list(popped.batch) == ["score"] and list(data.batch) == ["ids"]
    assert list(data.non_tensor_batch) == ["uid"] and data.meta_info == {"a": 1}
    with pytest.raises(KeyError, match="score"):
        data.pop(batch_keys=["score"])


def test_rename():
    data = make(2).rename("score", "reward")
    assert "reward" in data.batch and "score" not in data.batch
    with pytest.raises(KeyError, match="already exist"):
        data.rename("reward", "ids")
    with pytest.raises(ValueError, match="as many new keys"):
        data.rename(["ids"], ["a", "b"])


def test_union_merges_and_rejects_conflicts():
    data = make(3)
    extra = DataProto.from_dict({"adv": torch.ones(3), "ids": data.batch["ids"].clone()}, {"uid": rows(data)})
    data.union(extra)
    assert torch.equal(data.batch["adv"], torch.ones(3))
    with pytest.raises(ValueError, match="batch key 'adv' exists in both with different values"):
        data.union(DataProto.from_dict({"adv": torch.zeros(3)}))
    with pytest.raises(ValueError, match="non_tensor_batch key 'uid'"):
        data.union(DataProto.from_dict(non_tensors={"uid": ["x", "y", "z"]}))
    with pytest.raises(ValueError, match="meta_info key 'temperature'"):
        data.union(DataProto(meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="3 and 2 rows"):
        data.union(DataProto.from_dict({"new": torch.zeros(2)}))


def test_union_combines_the_metrics_of_each_call():
    data = make(2)
    data.meta_info["metrics"] = {"env/turns": 2.0, "reward/errors": 1.0}
    update = DataProto(meta_info={"metrics": {"actor/pg_loss": 0.5, "reward/errors": 0.0}})
    data.union(update)
    assert data.meta_info["metrics"] == {"env/turns": 2.0, "reward/errors": 0.0, "actor/pg_loss": 0.5}
    assert update.meta_info["metrics"] == {"actor/pg_loss": 0.5, "reward/errors": 0.0}  # other is not changed
    fresh = make(2).union(update)  # no metrics before: taken as they are
    assert fresh.meta_info["metrics"] == update.meta_info["metrics"]


# ---------------------------------------------------------------- split and join
def test_chunk_split_concat_roundtrip():
    data = make(6)
    chunks = data.chunk(3)
    assert [rows(c) for c in chunks] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    back = DataProto.concat(chunks)
    assert torch.equal(back.batch["ids"], data.batch["ids"]) and rows(back) == rows(data)
    assert [len(p) for p in data.split(4)] == [4, 2]
    with pytest.raises(ValueError, match="cannot chunk 6 rows into 4"):
        data.chunk(4)
    with pytest.raises(KeyError, match="part 1 has batch keys"):
        DataProto.concat([data, data.select(batch_keys=["ids"])])
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])


def test_repeat_interleave_and_tile():
    data = make(2)
    inter = data.repeat(3, interleave=True)
    assert rows(inter) == ["u0"] * 3 + ["u1"] * 3
    assert torch.equal(inter.batch["score"], torch.tensor([0.0, 0, 0, 1, 1, 1]))
    tiled = data.repeat(2, interleave=False)
    assert rows(tiled) == ["u0", "u1", "u0", "u1"]
    assert torch.equal(tiled.batch["ids"][2], data.batch["ids"][0])


def test_reorder():
    data = make(4)
    data.reorder(torch.tensor([3, 1, 0, 2]))
    assert rows(data) == ["u3", "u1", "u0", "u2"]
    assert data.batch["score"].tolist() == [3.0, 1.0, 0.0, 2.0]
    with pytest.raises(ValueError, match="permutation"):
        data.reorder([0, 0, 1, 2])


def test_pad_and_unpad():
    data = make(5)
    padded, pad = pad_dataproto_to_divisor(data, 4)
    assert pad == 3 and len(padded) == 8 and rows(padded)[5:] == ["u0", "u1", "u2"]
    assert rows(unpad_dataproto(padded, pad)) == rows(data)
    same, zero = pad_dataproto_to_divisor(data, 5)
    assert zero == 0 and same is data
    # padding longer than the data cycles through it
    tiny, pad = pad_dataproto_to_divisor(make(1), 4)
    assert pad == 3 and rows(tiny) == ["u0"] * 4
    with pytest.raises(ValueError, match="pad_size 9 out of range"):
        unpad_dataproto(data, 9)


def test_make_iterator_covers_every_row_each_epoch():
    data = make(8)
    batches = list(data.make_iterator(mini_batch_size=4, epochs=2, seed=0))
    assert len(batches) == 4
    assert sorted(rows(batches[0]) + rows(batches[1])) == sorted(rows(data))
    with pytest.raises(ValueError, match="does not divide"):
        next(data.make_iterator(mini_batch_size=3))


def test_to_and_clone():
    data = make(2).to("cpu")
    clone = data.clone()
    clone.batch["score"].add_(1)
    assert data.batch["score"].tolist() == [0.0, 1.0]


# ---------------------------------------------------------------- serialisation
def test_save_and_load(tmp_path):
    data = make(3)
    data.batch["half"] = torch.randn(3, 2).bfloat16()
    path = tmp_path / "batch.pkl"
    data.save_to_disk(path)
    back = DataProto.load_from_disk(path)
    assert torch.equal(back.batch["half"], data.batch["half"]) and back.batch["half"].dtype == torch.bfloat16
    assert back.non_tensor_batch["info"][2] == {"row": 2} and back.meta_info == data.meta_info
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        DataProto.load_from_disk(path)
    with pytest.raises(FileNotFoundError, match="missing.pkl"):
        DataProto.load_from_disk(tmp_path / "missing.pkl")


def test_pickle5_ships_tensor_bytes_out_of_band():
    data = DataProto.from_dict(
        {
            "ids": torch.zeros(256, 4096, dtype=torch.int64),
            "lp": torch.zeros(256, 4096, dtype=torch.bfloat16),
        },
        {"uid": ["x"] * 256},
    )
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 2
    assert sum(memoryview(b).nbytes for b in buffers) == 256 * 4096 * (8 + 2)
    assert len(payload) < 10_000  # only keys, dtypes and the small object column are in-band
    back = pickle.loads(payload, buffers=buffers)
    assert back.batch["lp"].dtype == torch.bfloat16 and back.batch["ids"].shape == (256, 4096)


def test_ray_transfer_is_zero_copy(ray_session):
    ray = ray_session
    data = make(4)
    data.batch["big"] = torch.arange(1 << 20, dtype=torch.float32).view(4, -1)
    ref = ray.put(data)
    first, second = ray.get(ref), ray.get(ref)
    # Two gets of the same object are views of the same shared-memory buffer: nothing was copied.
    assert first.batch["big"].data_ptr() == second.batch["big"].data_ptr()
    assert torch.equal(first.batch["big"], data.batch["big"])
    assert rows(first) == rows(data) and first.meta_info == data.meta_info

    @ray.remote
    def total(batch):
        return float(batch.batch["big"].sum())

    assert ray.get(total.remote(ref)) == float(data.batch["big"].sum())
