"""Single controller: Worker base, @register dispatch/collect modes and declared inputs, RayWorkerGroup,
colocation, futures."""

from controller.colocate import Shared, create_colocated_worker_cls
from controller.decorator import MethodSpec, register, registered_methods
from controller.dispatch import (
    PAD_ROWS_KEY,
    Dispatch,
    Dispatched,
    DispatchMode,
    Execute,
    get_dispatch_mode,
    make_nd_compute_dataproto_dispatch_fn,
    make_nd_split_dataproto_dispatch_fn,
    register_dispatch_mode,
)
from controller.errors import DispatchError, WorkerGroupError, WorkerGroupTimeoutError
from controller.future import DataProtoFuture, wait_all
from controller.inputs import Inputs
from controller.ray_class import RayClassWithInitArgs
from controller.worker import Worker
from controller.worker_group import GroupMethod, RayWorkerGroup

__all__ = [
    "PAD_ROWS_KEY",
    "DataProtoFuture",
    "Dispatch",
    "DispatchError",
    "DispatchMode",
    "Dispatched",
    "Execute",
    "GroupMethod",
    "Inputs",
    "MethodSpec",
    "RayClassWithInitArgs",
    "RayWorkerGroup",
    "Shared",
    "Worker",
    "WorkerGroupError",
    "WorkerGroupTimeoutError",
    "create_colocated_worker_cls",
    "get_dispatch_mode",
    "make_nd_compute_dataproto_dispatch_fn",
    "make_nd_split_dataproto_dispatch_fn",
    "register",
    "register_dispatch_mode",
    "registered_methods",
    "wait_all",
]
