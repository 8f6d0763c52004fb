"""A standalone weight-sync process group: the trainer's rank 0 plus every rollout rank.

Disaggregated placement puts the trainer group and the rollout group in different processes (often
different nodes), each with its own default ``torch.distributed`` group (or none, for a rollout worker
that needs no collectives). Weights must flow from the trainer to all rollout ranks over a group that
spans the two, without touching either default group.

Construction (torch 2.13)
-------------------------
* Trainer rank 0 hosts a ``torch.distributed.TCPStore`` bound to port 0, so the OS picks a free port
  on that node as the socket is bound (no probe-then-bind race); ``host_store`` returns the node's
  address and the port it got.
* Every member connects to that store (rank 0 reuses its master object), wraps it in a
  ``PrefixStore`` named after the group, and builds the backend object directly:
  ``torch.distributed.ProcessGroupGloo(store, rank, size, timeout)`` on CPU,
  ``torch.distributed.ProcessGroupNCCL(store, rank, size, ProcessGroupNCCL.Options())`` with CUDA.
  Both classes are exported from ``torch.distributed``; they are c10d ``Backend`` objects whose
  collectives are called directly (``backend.broadcast([tensor], BroadcastOptions)`` returns a Work
  to ``wait()``), which is how ``init_process_group`` itself builds them (``_new_process_group_helper``).
* Not used: ``init_process_group`` (one default group per process, and the trainer's is taken by FSDP),
  ``new_group`` (all members must share one default group), ``_new_process_group_helper`` (private,
  its signature changes between releases, and it registers the group in c10d's global maps).
  ``dist.broadcast(t, group=backend, group_src=0)`` happens to accept a bare backend in 2.13 but that
  is undocumented, so nothing here goes through the ``dist.*`` collective functions.

Protocol
--------
The source streams size-bounded buckets (``iter_buckets`` + ``flatten_bucket``): for each bucket one
header (pickled ``(metas, nbytes)``: a length broadcast, then the bytes) and one broadcast of the flat
``uint8`` buffer; a ``None`` header ends the stream, so receivers need not know the bucket count.
Receivers rebuild the tensors with ``unflatten_bucket`` and hand each bucket to a callback (the rollout
engine's ``update_weights``). A bucket bound smaller than a tensor is fine: that tensor travels alone.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
import torch
import torch.distributed as dist

from workers.weight_sync.buckets import (
    FlatBucket,
    flatten_bucket,
    iter_buckets,
    tensor_nbytes,
    unflatten_bucket,
)

DEFAULT_GROUP_NAME = "hyflow_weight_sync"


def _node_ip() -> str:
    """This node's IP as Ray sees it, or loopback outside Ray."""
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def host_store(
    world_size: int, timeout_s: float = 300.0, host: str | None = None
) -> tuple[dist.TCPStore, str, int]:
    """Start the group's TCPStore on this process (the source rank): ``(store, address, port)``.

    The store binds port 0, so the port is free by construction; keep the store object alive for as
    long as the group is used. ``host`` is the address the other members dial (default: this node's IP
    as Ray sees it, else 127.0.0.1)."""
    addr = host or _node_ip()
    store = dist.TCPStore(
        addr,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return store, addr, int(store.port)


class WeightSyncGroup:
    """One member of a weight-sync group (rank 0 is the source: the trainer's rank 0).

    ``store``: rank 0 passes the master store from ``host_store``; other ranks pass ``master_addr`` and
    ``master_port`` and connect as clients. The constructor blocks until every member has joined (it
    ends with a barrier), so the members must be constructed concurrently (the controller issues them
    without blocking).
    ``backend``: "gloo" or "nccl" (default: nccl when CUDA is available). ``label`` names this member
    in error messages (e.g. "rollout rank 1").
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
        store: dist.Store | None = None,
        backend: str | None = None,
        timeout_s: float = 300.0,
        group_name: str = DEFAULT_GROUP_NAME,
        label: str | None = None,
    ):
        if world_size < 2:
            raise ValueError(
                f"weight-sync group needs at least 2 members (a source and a receiver), got {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"weight-sync rank {rank} out of range for world size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.label = label or f"weight-sync rank {rank}"
        self.group_name = group_name
        self.backend_name = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            if master_addr is None or master_port is None:
                raise ValueError(f"{self.label}: pass either store or master_addr and master_port")
            store = dist.TCPStore(master_addr, int(master_port), world_size, is_master=False, timeout=timeout)
        self._store: dist.Store | None = store  # keeps the source's master store alive
        prefixed = dist.PrefixStore(f"{group_name}/", store)
        self._pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None  # None once destroyed
        try:
            if self.backend_name == "gloo":
                self.device = torch.device("cpu")
                self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            elif self.backend_name == "nccl":
                if not torch.cuda.is_available():
                    raise RuntimeError("backend 'nccl' needs CUDA")
                self.device = torch.device("cuda", torch.cuda.current_device())
                opts = dist.ProcessGroupNCCL.Options()
                opts.is_high_priority_stream = False
                opts._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
            else:
                raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', got {self.backend_name!r}")
            # NCCL connects lazily at the first collective: one here makes setup errors surface at setup.
            self.barrier()
        except Exception as err:
            raise RuntimeError(
                f"{self.label}: could not join weight-sync group {group_name!r} "
                f"({self.backend_name}, {world_size} members): {err}"
            ) from err

    # ------------------------------------------------------------------ collectives
    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast of ``tensor`` (on ``self.device``) from ``src``."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        # set in __init__ and None only after destroy(); a destroyed group is not used again
        assert self._pg is not None, f"{self.label}: weight-sync group used after destroy()"
        # torch's stubs leave the c10d Backend collectives (broadcast, ...) out; they exist at runtime
        self._pg.broadcast([tensor], opts).wait()  # type: ignore[union-attr]
        return tensor

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Pickle ``obj`` on ``src`` and return it on every rank (two broadcasts: length, bytes)."""
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast_tensor(length, src)
        if self.rank == src:
            data = payload.to(self.device)
        else:
            data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast_tensor(data, src)
        return obj if self.rank == src else pickle.loads(data.cpu().numpy().tobytes())

    def _bucket_body(self, flat: FlatBucket | None, header, src: int) -> FlatBucket:
        metas, nbytes = header
        if self.rank == src:
            assert flat is not None  # the source's own bucket: send() passes it, receive() runs off rank 0
            buffer = flat.buffer if flat.buffer.device == self.device else flat.buffer.to(self.device)
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.broadcast_tensor(buffer, src)
        return FlatBucket(buffer, list(metas))

    # ------------------------------------------------------------------ weight streams
    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
    ) -> dict[str, float]:
        """Source side: stream ``named_tensors`` in buckets of at most ``bucket_bytes`` (a larger tensor
        travels alone), then the end-of-stream marker. ``named_tensors`` is consumed lazily, so a
        generator that gathers a sharded model materialises one bucket at a time. Returns counts."""
        if self.rank != 0:
            raise RuntimeError(f"{self.label}: only rank 0 (the trainer) sends weights")
        stats: dict[str, float] = {
            "buckets": 0,
            "tensors": 0,
            "bytes": 0,
            "wire_bytes": 0,
            "max_bucket_bytes": 0,
        }
        for bucket in iter_buckets(named_tensors, bucket_bytes, dtype=dtype):
            flat = flatten_bucket(bucket, device=self.device)
            self.broadcast_object((flat.metas, flat.nbytes))
            self._bucket_body(flat, (flat.metas, flat.nbytes), 0)
            size = sum(tensor_nbytes(t) for _, t in bucket)
            stats["buckets"] += 1
            stats["tensors"] += len(bucket)
            stats["bytes"] += size
            stats["wire_bytes"] += flat.nbytes
            stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], size)
        self.broadcast_object(None)  # end of stream
        return stats

    def receive(self, apply: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> dict[str, float]:
        """Receiver side: call ``apply(named_tensors)`` for every bucket until the end-of-stream marker.
        The tensors are views into the received buffer, valid during the call. Returns counts."""
        if self.rank == 0:
            raise RuntimeError(f"{self.label}: rank 0 is the source; it sends, it does not receive")
        stats = {"buckets": 0, "tensors": 0, "bytes": 0, "wire_bytes": 0, "apply_s": 0.0}
        while True:
            header = self.broadcast_object(None)
            if header is None:
                return stats
            flat = self._bucket_body(None, header, 0)
            named = unflatten_bucket(flat.buffer, flat.metas)
            t0 = time.perf_counter()
            apply(named)
            stats["apply_s"] += time.perf_counter() - t0
            stats["buckets"] += 1
            stats["tensors"] += len(named)
            stats["bytes"] += sum(m.nbytes for m in flat.metas)
            stats["wire_bytes"] += flat.nbytes

    def barrier(self) -> None:
        """Every member waits for the others (a one-element broadcast, which every backend has)."""
        self.broadcast_tensor(torch.zeros(1, device=self.device))

    def destroy(self) -> None:
        """Shut the backend down and drop the store connection (the source's store stops serving)."""
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # already broken / unsupported: nothing left to free
                pass
        self._store = None

    def __repr__(self) -> str:
        return (
            f"WeightSyncGroup({self.group_name!r}, rank={self.rank}/{self.world_size}, "
            f"backend={self.backend_name})"
        )


def stream_metrics(stats: dict, elapsed_s: float) -> dict:
    """One member's metrics of a weight stream (the counts ``send``/``receive`` return), as reported to the
    controller: ``timing_s/update_weights``, ``perf/weight_sync_bytes`` (tensor bytes), ``weight_sync/*``."""
    return {
        "timing_s/update_weights": elapsed_s,
        "perf/weight_sync_bytes": stats["bytes"],
        "weight_sync/wire_bytes": stats["wire_bytes"],
        "weight_sync/buckets": stats["buckets"],
        "weight_sync/tensors": stats["tensors"],
    }


class WeightSyncMemberships:
    """The weight-sync groups one worker belongs to, by group name, and the stores it hosts for them (the
    source hosts its group's store before the members join)."""

    def __init__(self):
        self._groups: dict[str, WeightSyncGroup] = {}
        self._stores: dict[str, dist.TCPStore] = {}

    def host_store(self, group_name: str, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Host ``group_name``'s store on this process; ``(address, port)`` for the other members to dial."""
        store, addr, port = host_store(world_size, timeout_s=timeout_s)
        self._stores[group_name] = store
        return addr, port

    def join(self, group_name: str, rank: int, world_size: int, **kwargs) -> WeightSyncGroup:
        """Join ``group_name`` as ``rank`` (leaving an earlier group of that name), through the store hosted
        here if there is one; ``kwargs`` go to `WeightSyncGroup`. Blocks until every member joined."""
        old = self._groups.pop(group_name, None)
        if old is not None:
            old.destroy()
        store = self._stores.get(group_name)
        group = WeightSyncGroup(rank, world_size, store=store, group_name=group_name, **kwargs)
        self._groups[group_name] = group
        return group

    def get(self, group_name: str) -> WeightSyncGroup | None:
        return self._groups.get(group_name)

    def require(self, group_name: str, caller: str) -> WeightSyncGroup:
        """The group, or a RuntimeError saying that ``caller`` ran before ``init_weight_sync``."""
        group = self._groups.get(group_name)
        if group is None:
            raise RuntimeError(f"{caller} before init_weight_sync (group {group_name!r})")
        return group

    def leave(self, group_name: str) -> None:
        group = self._groups.pop(group_name, None)
        if group is not None:
            group.destroy()
        self._stores.pop(group_name, None)
