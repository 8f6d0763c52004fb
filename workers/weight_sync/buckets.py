"""Size-bounded weight buckets: stream ``(name, tensor)`` pairs in groups, flatten a group into one buffer.

Weight sync moves a whole model from the training layout to the rollout engines every step. Sending
one tensor at a time costs a round trip per tensor; sending the whole state dict at once needs a
second copy of the model in memory. Buckets sit in between: consecutive tensors are grouped until the
group would exceed a byte bound, and each group travels as one message.

Pieces (all pure torch, no process groups unless you call ``broadcast_bucket``):

* ``iter_buckets(named_tensors, bucket_bytes)``: lists of ``(name, tensor)`` in the input order, each
  list's tensor bytes <= ``bucket_bytes``, except that a single tensor larger than the bound travels
  alone. It consumes the input lazily, so a generator over a sharded model is materialised one bucket
  at a time. Optional ``dtype`` casts floating-point tensors (integer/bool tensors keep their dtype).
* ``flatten_bucket(named_tensors) -> FlatBucket``: one contiguous ``uint8`` buffer plus metadata
  (name, shape, dtype, byte offset, byte size per tensor). Offsets are aligned to ``ALIGN_BYTES`` so
  every tensor can be viewed back in place whatever dtypes precede it.
  ``unflatten_bucket(buffer, metas)`` rebuilds the tensors exactly (views into the buffer by default).
* ``broadcast_bucket(flat_or_none, src, group)``: the torch.distributed transport for disaggregated
  rollout workers: metadata via ``broadcast_object_list``, bytes via one ``broadcast`` of the buffer.
* Name helpers: ``strip_wrapper_prefixes`` removes what FSDP / activation checkpointing /
  ``torch.compile`` / DDP wrappers add to parameter names (``_fsdp_wrapped_module.``,
  ``_checkpoint_wrapped_module.``, ``_orig_mod.``, a leading ``module.``), and ``hf_named_tensors``
  applies it to a stream, materialises DTensors and drops ``lm_head.weight`` when the embeddings are
  tied (SGLang's loaders skip it in that case, so sending it only costs bandwidth).

Sizes: ``bucket_mb`` everywhere means MiB (``mb * 2**20`` bytes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

ALIGN_BYTES = 16  # every tensor starts at a multiple of this offset in a flattened buffer
MIB = 1 << 20

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def bucket_mb_to_bytes(bucket_mb: float) -> int:
    """Bucket size in bytes for a size in MiB; must be positive."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket size must be > 0 MiB, got {bucket_mb}")
    return max(1, int(bucket_mb * MIB))


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


def _materialize(tensor: torch.Tensor) -> torch.Tensor:
    """A plain local tensor: DTensors are gathered (``full_tensor``), autograd history dropped."""
    if hasattr(tensor, "full_tensor"):  # torch.distributed.tensor.DTensor
        tensor = tensor.full_tensor()
    return tensor.detach()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes`` tensor bytes.

    A tensor larger than ``bucket_bytes`` is yielded alone (the bucket that was filling is yielded
    first). Empty input yields nothing. ``dtype`` casts floating-point tensors before they are sized.
    Tensors are not copied (unless cast); a yielded list holds references to the input tensors.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    filled = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        tensor = _cast(_materialize(tensor), dtype)
        size = tensor_nbytes(tensor)
        if bucket and filled + size > bucket_bytes:
            yield bucket
            bucket, filled = [], 0
        bucket.append((name, tensor))
        filled += size
        if filled >= bucket_bytes:  # full, or a lone oversize tensor
            yield bucket
            bucket, filled = [], 0
    if bucket:
        yield bucket


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a flattened bucket buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # byte offset into the buffer (a multiple of ALIGN_BYTES)
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass
class FlatBucket:
    """One bucket as a single contiguous ``uint8`` buffer plus the metadata to rebuild its tensors."""

    buffer: torch.Tensor
    metas: list[TensorMeta]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    def tensors(self, copy: bool = False) -> list[tuple[str, torch.Tensor]]:
        return unflatten_bucket(self.buffer, self.metas, copy=copy)


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def flatten_bucket(
    named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device | str | None = None
) -> FlatBucket:
    """Copy tensors into one ``uint8`` buffer (on ``device``, default: the first tensor's device).

    Mixed dtypes are fine: each tensor's bytes start at an ``ALIGN_BYTES``-aligned offset.
    """
    named = [(name, _materialize(t)) for name, t in named_tensors]
    metas: list[TensorMeta] = []
    offset = 0
    for name, tensor in named:
        offset = _align(offset)
        size = tensor_nbytes(tensor)
        metas.append(TensorMeta(name, tuple(tensor.shape), tensor.dtype, offset, size))
        offset += size
    if device is None:
        device = named[0][1].device if named else "cpu"
    buffer = torch.zeros(offset, dtype=torch.uint8, device=device)
    for meta, (_, tensor) in zip(metas, named):
        if meta.nbytes:
            src = tensor.contiguous().reshape(-1).view(torch.uint8)
            buffer[meta.offset : meta.end].copy_(src)
    return FlatBucket(buffer, metas)


def unflatten_bucket(
    buffer: torch.Tensor, metas: Iterable[TensorMeta], copy: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """Rebuild ``(name, tensor)`` pairs from a flattened buffer: views into it, or clones if ``copy``."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"expected a 1-D uint8 buffer, got {buffer.dtype} with shape {tuple(buffer.shape)}")
    out = []
    for meta in metas:
        if meta.end > buffer.numel():
            raise ValueError(
                f"tensor {meta.name!r} spans bytes [{meta.offset}, {meta.end}) but the buffer has "
                f"{buffer.numel()}"
            )
        tensor = buffer[meta.offset : meta.end].view(meta.dtype).reshape(meta.shape)
        out.append((meta.name, tensor.clone() if copy else tensor))
    return out


def broadcast_bucket(
    flat: FlatBucket | None,
    src: int,
    group=None,
    device: torch.device | str | None = None,
) -> FlatBucket:
    """Broadcast one flattened bucket from rank ``src`` to every rank of ``group``.

    ``src`` passes its ``FlatBucket``; other ranks pass ``None`` and get a new one whose buffer is on
    ``device`` (default: CUDA for NCCL groups, else CPU). Two collectives: the metadata list
    (``broadcast_object_list``), then the byte buffer.
    """
    rank = dist.get_rank()
    source = flat if rank == src else None  # the bucket this rank sends (None: it receives)
    if rank == src and source is None:
        raise ValueError("the source rank must pass the FlatBucket to broadcast")
    if device is None:
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    header = [(source.metas, source.nbytes) if source is not None else None]
    dist.broadcast_object_list(header, src=src, group=group)
    assert header[0] is not None  # every rank now holds the source's entry, which is never None
    metas, nbytes = header[0]
    if source is not None:  # exactly when rank == src (checked above)
        buffer = source.buffer if source.buffer.device == torch.device(device) else source.buffer.to(device)
    else:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    return FlatBucket(buffer, list(metas))


# ---------------------------------------------------------------------------------------- names


def strip_wrapper_prefixes(name: str) -> str:
    """A Hugging Face parameter name from a wrapped module's name.

    ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.`` and ``_orig_mod.`` are removed wherever
    they occur (FSDP1 / activation checkpointing wrap submodules, ``torch.compile`` wraps the root);
    a leading ``module.`` (DDP / DataParallel) is removed once.
    """
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if name.startswith("module."):
        name = name[len("module.") :]
    return name


def hf_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    tie_word_embeddings: bool = False,
    keep_tied_lm_head: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, tensor)``: wrapper prefixes stripped, DTensors gathered, detached.

    With ``tie_word_embeddings`` the ``lm_head.weight`` entry is dropped (it is the embedding matrix;
    SGLang's loaders skip it for tied models) unless ``keep_tied_lm_head``. Two inputs mapping to the
    same name is an error naming both.
    """
    seen: dict[str, str] = {}
    for raw_name, tensor in named_tensors:
        name = strip_wrapper_prefixes(raw_name)
        if tie_word_embeddings and not keep_tied_lm_head and name == "lm_head.weight":
            continue
        if name in seen:
            raise ValueError(f"weights {seen[name]!r} and {raw_name!r} both map to {name!r}")
        seen[name] = raw_name
        yield name, _materialize(tensor)
