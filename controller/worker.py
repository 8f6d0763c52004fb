"""Worker: base class of every role worker that runs inside a worker-group actor.

The group passes each actor its place through environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The master port is picked on rank 0's bundle before any
actor starts (``master_probe``), so every rank has it at process start and a constructor may call
``init_distributed`` without waiting for the others to be created. A Worker built outside a group
with rank 0 and no MASTER_PORT picks one itself. The environment is read in ``__new__`` so subclasses
need not call ``super().__init__()``.
"""

from __future__ import annotations

import datetime
import functools
import operator
import os

# Hidden methods the worker group calls on every actor (colocated actors expose them per role).
DISPATCH_INFO_METHOD = "_hyflow_dispatch_info"
READY_METHOD = "_hyflow_ready"


def _port_picker():
    """Build ``pick() -> int``: a port nothing listens on, for a TCPStore to bind a moment later.

    It is drawn outside the kernel's ephemeral range (``ip_local_port_range``), where the OS hands out
    ports to every outgoing connection and to gloo's own listeners (``bind(0)``): a port from that range
    can be taken by any of them between this check and the bind (CI saw EADDRINUSE so). Below it, only
    processes that choose a fixed port compete; Ray's worker ports (10002-19999) and SGLang's (30000 and
    up) are avoided too. Falls back to ``bind(0)`` where that window is too narrow. A nested function,
    so Ray ships it by value with the probe."""

    def pick() -> int:
        import random
        import socket

        def bindable(port: int) -> bool:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", port))
                except OSError:
                    return False
                return True

        try:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
                ephemeral_low = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            ephemeral_low = 0
        low, high = 20000, min(ephemeral_low, 30000)
        if high - low >= 1000:
            for port in random.sample(range(low, high), 64):
                if bindable(port):
                    return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    return pick


free_port = _port_picker()


def master_probe():
    """A function that returns (node ip, free port) where it runs; the group runs it as a Ray task in
    rank 0's bundle. It is built as a closure with its imports inside so Ray ships it by value and the
    task's process does not import this package (and torch) just to open a socket."""

    pick = _port_picker()

    def probe() -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), pick()

    return probe


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (plain unit use) fall back to loopback
        pass
    return "127.0.0.1"


class Worker:
    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._configure_from_env()
        return self

    def _configure_from_env(self) -> None:
        env = os.environ
        self._rank = int(env.get("RANK", "0"))
        self._world_size = int(env.get("WORLD_SIZE", "1"))
        self._local_rank = int(env.get("LOCAL_RANK", "0"))
        self._local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
        if self._rank == 0 and not env.get("MASTER_PORT"):
            # Exported so other Workers in this process (colocated roles) and torch see the same values.
            env["MASTER_ADDR"] = _node_ip()
            env["MASTER_PORT"] = str(free_port())
        self._master_addr = env.get("MASTER_ADDR", "127.0.0.1")
        self._master_port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None
        self._dispatch_info: dict[str, tuple[int, bool]] = {}

    # ------------------------------------------------------------------ place in the group
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    @property
    def master_addr(self) -> str:
        return self._master_addr

    @property
    def master_port(self) -> int | None:
        return self._master_port

    @functools.cached_property  # not a property: a worker class may assign its own tag
    def tag(self) -> str:
        """``<Worker class> rank <r>/<world>``: the prefix of the errors this worker raises."""
        return f"{type(self).__name__} rank {self.rank}/{self.world_size}"

    # ------------------------------------------------------------------ torch.distributed
    def init_distributed(self, backend: str | None = None, timeout_s: float = 300.0) -> None:
        """Join the group's default process group (gloo on CPU, nccl with CUDA); a no-op if joined."""
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            if dist.get_world_size() != self._world_size or dist.get_rank() != self._rank:
                raise RuntimeError(
                    f"torch.distributed already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
                    f"but this worker is rank {self._rank}/{self._world_size}"
                )
            return
        if self._master_port is None:
            raise RuntimeError(
                f"rank {self._rank}: MASTER_PORT is not set; was this worker started by a group?"
            )
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU(s); pick ours among what is visible.
            torch.cuda.set_device(self._local_rank % torch.cuda.device_count())
        for attempt in range(3):
            try:
                dist.init_process_group(
                    backend=backend,
                    init_method=f"tcp://{self._master_addr}:{self._master_port}",
                    rank=self._rank,
                    world_size=self._world_size,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )
                return
            except dist.DistNetworkError as err:
                # Someone bound the port after it was picked. A group of one has no peer that knows
                # the port, so it takes another; with peers the error stands (they would wait on it).
                if self._world_size != 1 or "EADDRINUSE" not in str(err) or attempt == 2:
                    raise
                self._master_port = free_port()
                os.environ["MASTER_PORT"] = str(self._master_port)

    # ------------------------------------------------------------------ n-D dispatch
    def register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this rank's dp rank on ``mesh_name`` and whether its output is collected."""
        try:
            dp_rank = operator.index(dp_rank)  # ints and numpy ints
        except TypeError:
            dp_rank = -1
        if dp_rank < 0:
            raise ValueError(f"rank {self._rank}: dp_rank for mesh {mesh_name!r} must be an int >= 0")
        self._dispatch_info[mesh_name] = (dp_rank, bool(is_collect))

    # ------------------------------------------------------------------ called by the worker group
    def _hyflow_dispatch_info(self, mesh_name: str) -> tuple[int, bool] | None:
        return self._dispatch_info.get(mesh_name)

    def _hyflow_ready(self) -> int:
        return os.getpid()  # RayWorkerGroup.pids
