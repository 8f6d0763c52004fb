"""DataProto: the one batch type that crosses a process boundary.

A DataProto holds three things for B rows:
  * ``batch``: named torch tensors whose first dimension is B,
  * ``non_tensor_batch``: numpy object arrays of length B (strings, dicts, trajectories),
  * ``meta_info``: a plain dict that applies to the whole batch.

Method names and semantics follow verl's DataProto so recipes port over; there is no TensorDict.

Transfer through Ray: ``__getstate__`` turns every tensor into a numpy array (bf16/fp8 reinterpreted
as same-width integers). Ray's pickle-5 serializer ships numpy arrays as out-of-band buffers, so the
tensor bytes are never pickled and ``ray.get`` yields numpy views straight out of shared memory that
``__setstate__`` wraps with ``torch.from_numpy`` without a copy. Those tensors are therefore
read-only views of the object store: replace them (``data.batch[k] = new``) or ``clone()`` before
writing in place.
"""

from __future__ import annotations

import copy
import os
import pickle
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# torch dtypes numpy lacks travel as a same-width integer view and are viewed back on arrival.
_NUMPY_LESS_DTYPES = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}
_DTYPE_BY_NAME = {str(dt): dt for dt in _NUMPY_LESS_DTYPES}


def _as_object_array(name: str, values: Any) -> np.ndarray:
    """Non-tensor columns are 1-D numpy object arrays; lists and other arrays are converted."""
    if isinstance(values, torch.Tensor):
        raise TypeError(f"non_tensor_batch[{name!r}] is a torch.Tensor; put tensors in the tensor batch")
    if isinstance(values, np.ndarray):
        if values.dtype == object:
            return values
        arr = np.empty(len(values), dtype=object)
        arr[:] = list(values)
        return arr
    if isinstance(values, (list, tuple)):
        arr = np.empty(len(values), dtype=object)
        for i, v in enumerate(values):  # element-wise so lists of lists stay one object per row
            arr[i] = v
        return arr
    raise TypeError(f"non_tensor_batch[{name!r}] must be a numpy array or list, got {type(values).__name__}")


@dataclass
class DataProtoItem:
    """One row of a DataProto (what ``data[i]`` returns)."""

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


class DataProto:
    """A batch of B rows: tensors, per-row Python objects and batch-level meta information."""

    def __init__(
        self,
        batch: dict[str, torch.Tensor] | None = None,
        non_tensor_batch: Mapping[str, np.ndarray | list | tuple] | None = None,
        meta_info: dict | None = None,
    ):
        self.batch: dict[str, torch.Tensor] = dict(batch or {})
        self.non_tensor_batch: dict[str, np.ndarray] = {
            k: _as_object_array(k, v) for k, v in (non_tensor_batch or {}).items()
        }
        if meta_info is not None and not isinstance(meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(meta_info).__name__}")
        self.meta_info: dict = dict(meta_info or {})
        self.check_consistency()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
    ) -> DataProto:
        return cls(batch=tensors, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> DataProto:
        """Split one dict into tensors (torch.Tensor values) and non-tensors (arrays and lists)."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, (np.ndarray, list, tuple)):
                non_tensors[key] = value
            else:
                raise TypeError(
                    f"from_single_dict: value for {key!r} must be a torch.Tensor, numpy array or list, "
                    f"got {type(value).__name__}"
                )
        return cls(batch=tensors, non_tensor_batch=non_tensors, meta_info=meta_info)

    def check_consistency(self) -> None:
        """Every tensor and non-tensor column must have the same first dimension."""
        length, first_key = None, None
        for key, value in self.batch.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"batch[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
            if value.dim() == 0:
                raise ValueError(f"batch[{key!r}] is a 0-d tensor; batch tensors need a row dimension")
            if length is None:
                length, first_key = value.shape[0], key
            elif value.shape[0] != length:
                raise ValueError(
                    f"batch[{key!r}] has {value.shape[0]} rows but batch[{first_key!r}] has {length}"
                )
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(
                    f"non_tensor_batch[{key!r}] must be a numpy array, got {type(value).__name__}"
                )
            if length is None:
                length, first_key = len(value), f"non_tensor_batch[{key!r}]"
            elif len(value) != length:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] has {len(value)} rows but {first_key!r} has {length}"
                )
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")

    # ------------------------------------------------------------------ size and indexing
    def __len__(self) -> int:
        for value in self.batch.values():
            return value.shape[0]
        for value in self.non_tensor_batch.values():
            return len(value)
        return 0

    def __getitem__(self, item):
        if isinstance(item, (int, np.integer)):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"DataProto index {item} out of range for length {n}")
            return DataProtoItem(
                batch={k: v[item] for k, v in self.batch.items()},
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"DataProto indices must be int, slice, or index array, got {type(item).__name__}")

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        sl = slice(start, end, step)
        return DataProto(
            batch={k: v[sl] for k, v in self.batch.items()},
            non_tensor_batch={k: v[sl] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def select_idxs(self, idxs) -> DataProto:
        """Rows by integer indices or a boolean mask (list, numpy array or tensor)."""
        idx = idxs.cpu().numpy() if isinstance(idxs, torch.Tensor) else np.asarray(idxs)
        if idx.dtype == bool:
            if len(idx) != len(self):
                raise ValueError(f"boolean mask has length {len(idx)} but the batch has {len(self)} rows")
            idx = np.nonzero(idx)[0]
        idx = idx.astype(np.int64, copy=False)
        if idx.ndim != 1:
            raise ValueError(f"index array must be 1-D, got shape {idx.shape}")
        if len(idx) and (idx.max() >= len(self) or idx.min() < -len(self)):
            raise IndexError(f"index {int(idx.max())} out of range for length {len(self)}")
        t_idx = torch.from_numpy(idx)
        return DataProto(
            batch={k: v[t_idx.to(v.device)] for k, v in self.batch.items()},
            non_tensor_batch={k: v[idx] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    # ------------------------------------------------------------------ key operations
    def _check_keys(self, keys, available, what: str) -> list[str]:
        keys = list(keys)
        missing = [k for k in keys if k not in available]
        if missing:
            raise KeyError(f"{what} key(s) {missing} not found; available: {sorted(available)}")
        return keys

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the given keys (None keeps all of that kind). Tensors are shared."""
        keys = self._check_keys(batch_keys, self.batch, "batch") if batch_keys is not None else self.batch
        nt_keys = (
            self._check_keys(non_tensor_batch_keys, self.non_tensor_batch, "non_tensor_batch")
            if non_tensor_batch_keys is not None
            else self.non_tensor_batch
        )
        m_keys = (
            self._check_keys(meta_info_keys, self.meta_info, "meta_info")
            if meta_info_keys is not None
            else self.meta_info
        )
        out = DataProto(
            batch={k: self.batch[k] for k in keys},
            non_tensor_batch={k: self.non_tensor_batch[k] for k in nt_keys},
            meta_info={k: self.meta_info[k] for k in m_keys},
        )
        return copy.deepcopy(out) if deepcopy else out

    def pop(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from this DataProto and return them as a new one."""
        keys = self._check_keys(batch_keys or [], self.batch, "batch")
        nt_keys = self._check_keys(non_tensor_batch_keys or [], self.non_tensor_batch, "non_tensor_batch")
        m_keys = self._check_keys(meta_info_keys or [], self.meta_info, "meta_info")
        return DataProto(
            batch={k: self.batch.pop(k) for k in keys},
            non_tensor_batch={k: self.non_tensor_batch.pop(k) for k in nt_keys},
            meta_info={k: self.meta_info.pop(k) for k in m_keys},
        )

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename tensor keys in place (verl semantics); returns self."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"rename needs as many new keys as old ones: {old} -> {new}")
        self._check_keys(old, self.batch, "batch")
        clash = [k for k in new if k in self.batch and k not in old]
        if clash:
            raise KeyError(f"rename target key(s) {clash} already exist in batch")
        tensors = [self.batch.pop(k) for k in old]
        self.batch.update(zip(new, tensors))
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other`` into self in place (verl semantics). A key present in both with different
        values is an error naming the key; identical values are allowed. ``meta_info["metrics"]`` dicts
        combine, so a batch carries the metrics of every worker call merged into it."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"union of DataProtos with {len(self)} and {len(other)} rows")
        for key, value in other.batch.items():
            if key in self.batch:
                mine = self.batch[key]
                if mine.shape != value.shape or not torch.equal(mine, value.to(mine.device)):
                    raise ValueError(f"union: batch key {key!r} exists in both with different values")
            else:
                self.batch[key] = value
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch:
                if not _object_arrays_equal(self.non_tensor_batch[key], value):
                    raise ValueError(
                        f"union: non_tensor_batch key {key!r} exists in both with different values"
                    )
            else:
                self.non_tensor_batch[key] = value
        for key, value in other.meta_info.items():
            if key == "metrics":  # each call reports its own metrics: they add up, the later name wins
                self.meta_info["metrics"] = {**self.meta_info.get("metrics", {}), **value}
                continue
            if key in self.meta_info and not _values_equal(self.meta_info[key], value):
                raise ValueError(f"union: meta_info key {key!r} exists in both with different values")
            self.meta_info[key] = value
        self.check_consistency()
        return self

    # ------------------------------------------------------------------ splitting and joining
    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts; the length must divide (pad first otherwise)."""
        if chunks < 1:
            raise ValueError(f"chunk count must be >= 1, got {chunks}")
        if len(self) % chunks:
            raise ValueError(
                f"cannot chunk {len(self)} rows into {chunks} equal parts; use pad_dataproto_to_divisor first"
            )
        size = len(self) // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter)."""
        if split_size < 1:
            raise ValueError(f"split_size must be >= 1, got {split_size}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Rows of all parts in order. Keys must match; meta_info is taken from the first part."""
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        first = data[0]
        for i, part in enumerate(data[1:], start=1):
            if part.batch.keys() != first.batch.keys():
                raise KeyError(
                    f"concat: part {i} has batch keys {sorted(part.batch)} but part 0 has {sorted(first.batch)}"
                )
            if part.non_tensor_batch.keys() != first.non_tensor_batch.keys():
                raise KeyError(
                    f"concat: part {i} has non_tensor_batch keys {sorted(part.non_tensor_batch)} "
                    f"but part 0 has {sorted(first.non_tensor_batch)}"
                )
        batch = {k: torch.cat([p.batch[k] for p in data], dim=0) for k in first.batch}
        non_tensor = {
            k: np.concatenate([p.non_tensor_batch[k] for p in data]) for k in first.non_tensor_batch
        }
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(first.meta_info))

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat rows: interleaved gives a,a,b,b (group sampling); otherwise a,b,a,b."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
        if interleave:
            batch = {k: v.repeat_interleave(repeat_times, dim=0) for k, v in self.batch.items()}
            non_tensor = {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            batch = {k: v.repeat(repeat_times, *([1] * (v.dim() - 1))) for k, v in self.batch.items()}
            non_tensor = {k: np.tile(v, repeat_times) for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def reorder(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Permute rows in place: row i becomes old row indices[i]."""
        idx = indices.cpu().numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
        if sorted(idx.tolist()) != list(range(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)}), got {idx.tolist()[:16]}...")
        reordered = self.select_idxs(idx)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def make_iterator(
        self, mini_batch_size: int, epochs: int = 1, seed: int | None = None
    ) -> Iterator[DataProto]:
        """Mini-batches of ``mini_batch_size`` rows for ``epochs`` passes, shuffled when a seed is given."""
        if len(self) % mini_batch_size:
            raise ValueError(
                f"mini_batch_size {mini_batch_size} does not divide the batch of {len(self)} rows"
            )
        generator = np.random.default_rng(seed) if seed is not None else None
        for _ in range(epochs):
            order = generator.permutation(len(self)) if generator is not None else np.arange(len(self))
            for start in range(0, len(self), mini_batch_size):
                yield self.select_idxs(order[start : start + mini_batch_size])

    # ------------------------------------------------------------------ devices and copies
    def to(self, device: str | torch.device) -> DataProto:
        """Move tensors to ``device`` in place; returns self (verl semantics)."""
        self.batch = {k: v.to(device) for k, v in self.batch.items()}
        return self

    def clone(self) -> DataProto:
        """A deep copy whose tensors own their memory (safe to write in place)."""
        return DataProto(
            batch={k: v.clone() for k, v in self.batch.items()},
            non_tensor_batch={k: copy.deepcopy(v) for k, v in self.non_tensor_batch.items()},
            meta_info=copy.deepcopy(self.meta_info),
        )

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.batch.items()
        )
        return (
            f"DataProto(len={len(self)}, batch={{{tensors}}}, "
            f"non_tensor_batch={sorted(self.non_tensor_batch)}, meta_info={sorted(self.meta_info)})"
        )

    # ------------------------------------------------------------------ serialisation
    def __getstate__(self) -> dict:
        """Tensors become numpy arrays so pickle protocol 5 (Ray) ships their bytes out of band."""
        arrays, dtypes = {}, {}
        for key, tensor in self.batch.items():
            tensor = tensor.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            if tensor.dtype in _NUMPY_LESS_DTYPES:
                dtypes[key] = str(tensor.dtype)
                tensor = tensor.view(_NUMPY_LESS_DTYPES[tensor.dtype])
            arrays[key] = tensor.numpy()
        return {
            "arrays": arrays,
            "dtypes": dtypes,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict) -> None:
        batch = {}
        with warnings.catch_warnings():
            # Arrays from Ray's object store are read-only; wrapping them avoids a copy (see module doc).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for key, array in state["arrays"].items():
                tensor = torch.from_numpy(array)
                if key in state["dtypes"]:
                    tensor = tensor.view(_DTYPE_BY_NAME[state["dtypes"][key]])
                batch[key] = tensor
        self.batch = batch
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def save_to_disk(self, path: str | os.PathLike) -> None:
        """Write to ``path`` with pickle protocol 5 (written to a temp file, then renamed)."""
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(self, f, protocol=5)
        os.replace(tmp, path)

    @staticmethod
    def load_from_disk(path: str | os.PathLike) -> DataProto:
        """Read a file written by ``save_to_disk``. Like any pickle, only load files you trust."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"DataProto file not found: {path}")
        try:
            with open(path, "rb") as f:
                data = pickle.load(f)
        except (EOFError, pickle.UnpicklingError) as err:
            raise ValueError(f"DataProto file {path} is truncated or corrupt: {err}") from err
        if not isinstance(data, DataProto):
            raise TypeError(f"{path} holds a {type(data).__name__}, not a DataProto")
        # Tensors loaded from a file own their bytes; make them writable copies of the pickle buffers.
        data.batch = {k: v.clone() for k, v in data.batch.items()}
        return data


def _object_arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))


def _values_equal(a: Any, b: Any) -> bool:
    try:
        result = a == b
        if isinstance(result, np.ndarray):
            return bool(result.all())
        if isinstance(result, torch.Tensor):
            return bool(result.all())
        return bool(result)
    except Exception:
        return a is b


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad with copies of leading rows so len is a multiple of ``size_divisor``; returns (data, pad_size)."""
    if size_divisor < 1:
        raise ValueError(f"size_divisor must be >= 1, got {size_divisor}")
    if len(data) == 0:
        raise ValueError("cannot pad an empty DataProto")
    pad_size = -len(data) % size_divisor
    if pad_size == 0:
        return data, 0
    pad_idx = np.arange(pad_size) % len(data)
    return DataProto.concat([data, data.select_idxs(pad_idx)]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the ``pad_size`` rows that ``pad_dataproto_to_divisor`` appended."""
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size {pad_size} out of range for a DataProto of {len(data)} rows")
    return data.slice(0, len(data) - pad_size) if pad_size else data
