"""``@register``: marks a worker method as callable on the whole group, with its dispatch/collect mode and
the DataProto columns it reads (`controller.inputs`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from controller.dispatch import Dispatch, DispatchMode, Execute
from controller.inputs import Inputs, plain_columns
from dataproto import DataProto

# Attribute set on a registered function; the worker group looks for it when binding methods.
REGISTER_ATTR = "__hyflow_register__"


@dataclass(frozen=True)
class MethodSpec:
    dispatch_mode: Dispatch | str | DispatchMode  # resolved when a group binds the method
    execute_mode: Execute
    blocking: bool
    timeout_s: float | None
    inputs: Inputs | None = None  # None: the method gets whole batches


def register(
    dispatch_mode: Dispatch | str | DispatchMode = Dispatch.ALL_TO_ALL,
    execute_mode: Execute | None = None,
    blocking: bool = True,
    timeout_s: float | None = None,
    inputs: Inputs | None = None,
):
    """Expose a worker method as a group method.

    ``execute_mode`` defaults to RANK_ZERO for ``Dispatch.RANK_ZERO`` and ALL otherwise. With
    ``blocking=False`` the group call returns a DataProtoFuture. ``timeout_s`` bounds each call
    (WorkerGroupTimeoutError naming the ranks that did not answer). ``inputs`` declares the columns the
    method reads from its DataProto arguments: only those are sent, and reading another one fails.
    """
    if callable(dispatch_mode) and not isinstance(dispatch_mode, DispatchMode):
        raise TypeError("use @register(...) with parentheses (and a dispatch mode), not bare @register")
    if not isinstance(dispatch_mode, (Dispatch, str, DispatchMode)):
        raise TypeError(
            f"dispatch_mode must be a Dispatch, a registered name or a DispatchMode, got {dispatch_mode!r}"
        )
    if execute_mode is None:
        execute_mode = Execute.RANK_ZERO if dispatch_mode is Dispatch.RANK_ZERO else Execute.ALL
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute member, got {execute_mode!r}")
    if inputs is not None and not isinstance(inputs, Inputs):
        raise TypeError(f"inputs must be an Inputs(...), got {type(inputs).__name__}")
    spec = MethodSpec(dispatch_mode, execute_mode, blocking, timeout_s, inputs)

    def decorate(fn):
        if not callable(fn):
            raise TypeError(f"@register decorates methods, got {type(fn).__name__}")
        method = fn if inputs is None else _reading_declared_inputs(fn, inputs)
        setattr(method, REGISTER_ATTR, spec)
        return method

    return decorate


def _reading_declared_inputs(fn, inputs: Inputs):
    """``fn`` called with every DataProto argument reduced to ``inputs`` (checked, undeclared reads failing)."""

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        owner = f"{getattr(self, 'tag', type(self).__name__)}: {fn.__name__}"

        def received(value):
            return inputs.received(value, owner) if isinstance(value, DataProto) else value

        args = tuple(received(a) for a in args)
        kwargs = {k: received(v) for k, v in kwargs.items()}
        return plain_columns(fn(self, *args, **kwargs))

    return method


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Name -> MethodSpec of every ``@register``-ed method of ``cls`` (inherited ones included)."""
    out = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), REGISTER_ATTR, None)
        if isinstance(spec, MethodSpec):
            out[name] = spec
    return out
