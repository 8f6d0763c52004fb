"""Models built without memory: parameters on the meta device, then only the pieces this rank holds filled in.

A training engine that shards a model over ranks must not load (or randomly initialise) the whole model on
every rank first. Here the module tree is built with its parameters on ``meta`` (`parameters_on_meta`:
buffers such as rotary frequencies stay real, they are small and computed, not stored), the engine shards it
(FSDP2 ``fully_shard`` turns each parameter into a DTensor), and `materialize` allocates each rank's local
pieces and fills them from a `WeightSource`, piece by piece:

* `CheckpointWeights`: a Hugging Face safetensors directory; only the rows (and columns) of this rank's
  piece are read from the memory-mapped files.
* `RandomWeights`: a deterministic random init that gives every element the same value whatever the sharding:
  each parameter is cut into blocks of whole rows along dim 0 and every block is drawn from its own generator
  seeded by (seed, parameter name, block index). Weights are normal(0, ``initializer_range``), biases zero,
  norm weights one (the distributions of Hugging Face's Qwen2/Llama init, not its random stream).

Random-init model directories (`write_random_init_model`): ``config.json`` (+ tokenizer) and
``hyflow_random_init.json`` with the seed, no weights. Real model shapes without a download or a weights file:
every process that loads the directory (trainer ranks at any DP size, rollout replicas) gets the same
weights (`random_init_seed` tells such a directory).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

RANDOM_INIT_FILE = "hyflow_random_init.json"
BLOCK_ELEMENTS = 1 << 20  # elements per random-init block (rounded to whole rows): the unit of determinism

# a fused experts parameter of HF mixture-of-experts modules (the checkpoint may keep one weight per expert)
_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")


def write_random_init_model(out_dir: str | os.PathLike, config, seed: int = 0, tokenizer=None) -> str:
    """A model directory without weights: ``config`` (a transformers config) saved, the random-init ``seed``
    recorded in `RANDOM_INIT_FILE`, the tokenizer saved when given. Returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    (out / RANDOM_INIT_FILE).write_text(json.dumps({"seed": int(seed)}) + "\n")
    return str(out)


def random_init_seed(path: str | os.PathLike) -> int | None:
    """The seed of a random-init model directory, None for any other directory."""
    marker = Path(path).expanduser() / RANDOM_INIT_FILE
    if not marker.is_file():
        return None
    return int(json.loads(marker.read_text())["seed"])


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init cost); buffers are
    left where they are made. Not thread-safe: it patches ``nn.Module.register_parameter`` meanwhile."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class WeightSource:
    """Where `materialize` reads parameter pieces from."""

    def fill(self, name: str, shape: tuple[int, ...], offset: tuple[int, ...], out: torch.Tensor) -> None:
        """Copy elements ``[offset, offset + out.shape)`` of parameter ``name`` (full shape ``shape``) into
        ``out``."""
        raise NotImplementedError


def fill_in_chunks(
    read_rows: Callable[[int, int], torch.Tensor],
    shape: tuple[int, ...],
    offset: tuple[int, ...],
    out: torch.Tensor,
) -> None:
    """``out`` = elements ``[offset, offset + out.shape)`` of a tensor of ``shape`` whose rows ``[a, b)`` (dim 0)
    ``read_rows(a, b)`` returns, read in chunks of whole `block_rows` blocks, so the transient memory is one
    block whatever the size of the tensor."""
    step = block_rows(shape)
    inner = (slice(None),) + tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:]))
    lo, hi = offset[0], offset[0] + out.shape[0]
    start = lo
    while start < hi:
        stop = min(hi, (start // step + 1) * step)
        out[start - lo : stop - lo].copy_(read_rows(start, stop)[inner])
        start = stop


def block_rows(shape: tuple[int, ...]) -> int:
    """Rows per block of a parameter of full shape ``shape``: at most `BLOCK_ELEMENTS` elements, at least 1."""
    row_numel = 1
    for s in shape[1:]:
        row_numel *= s
    return max(1, BLOCK_ELEMENTS // max(1, row_numel))


class RandomWeights(WeightSource):
    """Seeded init, block by block of rows: the same values for every element whatever piece is asked for."""

    def __init__(self, seed: int, std: float = 0.02):
        self.seed, self.std = int(seed), float(std)

    def fill(self, name, shape, offset, out):
        fill_in_chunks(lambda start, stop: self._rows(name, shape, start, stop), shape, offset, out)

    def _rows(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of parameter ``name``, all within one block."""
        n = (stop - start,) + shape[1:]
        if name.endswith(".bias"):
            return torch.zeros(n)
        if len(shape) == 1 and name.endswith("norm.weight"):
            return torch.ones(n)
        step = block_rows(shape)
        index = start // step
        gen = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + zlib.crc32(name.encode())) * 1_000_033 + index
        )
        block_start = index * step
        block = torch.randn((min(step, shape[0] - block_start),) + shape[1:], generator=gen).mul_(self.std)
        return block[start - block_start : stop - block_start]


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointWeights(WeightSource):
    """The safetensors files of a Hugging Face directory, read a block of rows at a time with plain file reads
    (a memory map would count the file's pages in this process's resident memory until it is closed)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        files = (
            sorted({self.path / f for f in json.loads(index.read_text())["weight_map"].values()})
            if index.is_file()
            else [self.path / "model.safetensors"]
        )
        self.entries: dict[str, tuple[Path, int, torch.dtype, tuple[int, ...]]] = {}
        for file in files:
            with open(file, "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(header_len))
            for name, e in header.items():
                if name != "__metadata__":
                    start = 8 + header_len + e["data_offsets"][0]
                    self.entries[name] = (file, start, _SAFETENSORS_DTYPES[e["dtype"]], tuple(e["shape"]))

    @staticmethod
    def available(path: str | os.PathLike) -> bool:
        p = Path(path)
        return (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()

    def fill(self, name, shape, offset, out):
        if name not in self.entries and (fused := _FUSED_EXPERTS.fullmatch(name)):
            return self._fill_fused_experts(fused[1], fused[2], offset, out)
        if name not in self.entries:
            raise KeyError(f"{str(self.path)!r} holds no weight {name!r}")
        file, start, dtype, stored = self.entries[name]
        if stored != tuple(shape):
            raise ValueError(f"{name}: {file} holds shape {stored}, the model wants {tuple(shape)}")
        row_bytes = torch.empty((), dtype=dtype).element_size()
        for s in shape[1:]:
            row_bytes *= s

        with open(file, "rb") as fh:

            def read_rows(a: int, b: int) -> torch.Tensor:
                buf = torch.empty((b - a) * row_bytes, dtype=torch.uint8)
                fh.seek(start + a * row_bytes)
                if fh.readinto(buf.numpy()) != buf.numel():  # type: ignore[arg-type]
                    raise OSError(f"{file}: truncated data of {name!r}")
                return buf.view(dtype).reshape((b - a,) + tuple(shape[1:]))

            fill_in_chunks(read_rows, shape, offset, out)

    def _fill_fused_experts(self, prefix: str, kind: str, offset: tuple[int, ...], out: torch.Tensor) -> None:
        """A mixture of experts' fused ``[experts, out, in]`` parameter (``<prefix>.gate_up_proj``: each expert's
        gate rows then its up rows; ``<prefix>.down_proj``) from a checkpoint that keeps one weight per expert, as
        transformers saves Qwen3-MoE and Mixtral-style models (``<prefix>.<e>.gate_proj.weight``, ...). Reads only
        the experts of ``out``'s piece, one at a time."""
        parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        for i in range(out.shape[0]):
            weights = []
            for part in parts:
                name = f"{prefix}.{offset[0] + i}.{part}.weight"
                if name not in self.entries:
                    raise KeyError(f"{str(self.path)!r} holds neither {prefix}.{kind} nor {name!r}")
                stored = self.entries[name][3]
                weights.append(torch.empty(stored, dtype=out.dtype))
                self.fill(name, stored, (0,) * len(stored), weights[-1])
            expert = torch.cat(weights)
            out[i].copy_(expert[offset[1] : offset[1] + out.shape[1], offset[2] : offset[2] + out.shape[2]])


def local_piece_of(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(this rank's local tensor of ``param``, its offset in the full tensor); a plain tensor is all of it."""
    if isinstance(param, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        local = param.to_local()
        if tuple(local.shape) != tuple(local_shape):
            raise RuntimeError(f"local shard shape {tuple(local.shape)} != expected {tuple(local_shape)}")
        return local, tuple(offset)
    return param, (0,) * param.dim()


@torch.no_grad()
def materialize(model: nn.Module, source: WeightSource, device: str | torch.device = "cpu") -> nn.Module:
    """Allocate ``model``'s meta parameters on ``device`` (sharded ones: this rank's pieces only) and fill
    them from ``source``; buffers keep their values. Tied parameters are filled once. Returns ``model``."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    first_name: dict[int, str] = {}
    aliases = []  # (module name, attribute, name of the parameter it shares): to_empty unties them
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            module_name, _, attr = name.rpartition(".")
            aliases.append((module_name, attr, first_name[id(param)]))
        else:
            first_name[id(param)] = name
    model.to_empty(device=device)
    for module_name, attr, shared in aliases:
        model.get_submodule(module_name)._parameters[attr] = model.get_parameter(shared)
    for name, buf in model.named_buffers():
        if name in buffers:
            buf.copy_(buffers[name])
    for name, param in model.named_parameters():
        local, offset = local_piece_of(param)
        source.fill(name, tuple(param.shape), offset, local)
    return model


def full_tensors(model: nn.Module, source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every parameter of ``model`` (tied ones once), read from ``source`` one
    parameter at a time in the parameter's dtype: a consumer that copies each away holds one at a time."""
    for name, param in model.named_parameters():
        out = torch.empty(param.shape, dtype=param.dtype)
        source.fill(name, tuple(param.shape), (0,) * param.dim(), out)
        yield name, out


def use_placeholders(model: nn.Module) -> nn.Module:
    """Replace ``model``'s meta parameters by zero-stride views of one zero element (real tensors of the right
    shape and dtype that cost no memory), ties kept: for code that copies a module's weights elsewhere and is
    then given the real ones (e.g. the native rollout engine, then ``full_tensors``). Returns ``model``."""
    seen: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if id(param) not in seen:
            view = torch.zeros((), dtype=param.dtype).expand(param.shape)
            seen[id(param)] = nn.Parameter(view, requires_grad=False)
        module_name, _, attr = name.rpartition(".")
        model.get_submodule(module_name)._parameters[attr] = seen[id(param)]
    return model
