"""CPU stand-ins for the few CUDA-only calls megatron-core (<= 0.16) makes on its forward/backward path.

Used ONLY when ``torch.cuda.is_available()`` is False (our CI and laptops); on a GPU nothing here is
installed and megatron-core runs unmodified. Everything Megatron computes is still Megatron's own code:
its GPTModel, tensor-parallel layers and mappings (all-gather / reduce-scatter / all-reduce over gloo),
its 1F1B pipeline schedule with point-to-point sends over gloo. What is replaced, and why:

1. ``torch.cuda.current_device`` returns ``cpu`` and ``torch.cuda.synchronize`` does nothing. Megatron
   allocates communication buffers and pipeline receive tensors with ``device=torch.cuda.current_device()``
   (tensor_parallel/mappings.py, layers.py, pipeline_parallel/p2p_communication.py) and synchronises the
   CUDA stream after pipeline sends/receives (gloo's waits already complete them); on a CPU build the
   real functions raise.
2. A torch-function mode maps ``device="cuda"`` in factory calls (``torch.zeros(..., device="cuda")`` in
   pipeline_parallel/schedules.py, the default causal mask in transformer/utils.py) and ``Tensor.cuda()``
   to CPU. It is active only inside ``cpu_device_scope()``, i.e. while the engine runs Megatron code.
3. The model-parallel RNG tracker (``tensor_parallel.random``) keeps CUDA generator states and forks them
   around dropout; ``CpuRNGStatesTracker`` does the same with CPU generator states, seeded per TP rank the
   way ``model_parallel_cuda_manual_seed`` seeds the CUDA ones.

Not replaceable on CPU (so the engine does not use them there): Megatron's distributed optimizer and its
``DistributedDataParallel`` grad buffers (CUDA streams / NCCL-specific), fused kernels, sequence
parallelism, Transformer Engine. The engine steps torch AdamW on the parameters' ``.grad`` instead and
all-reduces gradients over the data-parallel group itself.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_installed = False
_originals: dict = {}


def needed() -> bool:
    """True when the CPU stand-ins are required (no CUDA device)."""
    return not torch.cuda.is_available()


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, int):  # a bare index means a CUDA ordinal to torch
        return True
    return isinstance(device, str) and device.startswith("cuda")


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for torch factory calls and ``Tensor.cuda`` / ``Tensor.to``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Megatron's ``CudaRNGStatesTracker`` interface over CPU generator states (named states forked around
    regions that must draw different random numbers per TP rank, e.g. dropout on partitioned heads)."""

    def __init__(self):
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was not added to the CPU tracker")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def install(seed: int, tp_rank: int) -> None:
    """Install the stand-ins for this process (idempotent; a no-op on a machine with CUDA). ``seed`` and
    ``tp_rank`` seed the RNG tracker as ``model_parallel_cuda_manual_seed`` would."""
    global _installed
    if not needed():
        return
    from megatron.core.tensor_parallel import random as mrandom

    with _lock:
        if not _installed:
            _originals.update(current_device=torch.cuda.current_device, synchronize=torch.cuda.synchronize)
            # a device where torch types an ordinal: Megatron only passes the result on as ``device=``
            torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]  # see above
            torch.cuda.synchronize = lambda device=None: None
            _installed = True
        tracker = CpuRNGStatesTracker()
        # the same offsets Megatron uses: one stream shared by the TP group, one per TP rank
        tracker.add("data-parallel-rng", seed)
        tracker.add("model-parallel-rng", seed + 2718 + tp_rank)
        tracker.add("expert-parallel-rng", seed + 1024 + tp_rank)
        mrandom._CUDA_RNG_STATE_TRACKER = tracker
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


@contextlib.contextmanager
def cpu_device_scope():
    """Run Megatron code with CUDA device arguments mapped to CPU (a no-op when CUDA is available)."""
    if not needed():
        yield
        return
    with CudaToCpuMode():
        yield
