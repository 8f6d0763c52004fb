"""Inputs: the DataProto columns a group method reads, declared with ``@register(..., inputs=Inputs(...))``.

The worker group keeps only those columns, on the controller, before a batch is put in the object store and
dispatched, so a call ships what its method reads and nothing else (an RLM batch's trajectory JSON and long
contexts stay on the controller). On arrival the worker selects again (a no-op after the group's selection;
the real selection when the method is called directly or is handed a chained future), checks that the
required columns are there and gives the method a batch in which reading an undeclared column raises a
KeyError naming the method and the column. A method without a declaration gets the whole batch (environment
rollouts read everything). ``meta_info`` holds the call's settings (temperature, micro-batch overrides) and
always travels whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.future import DataProtoFuture
from dataproto import DataProto


@dataclass(frozen=True)
class Inputs:
    """Columns a method needs (``batch``: tensors, ``non_tensor``: per-row objects) and the ``optional`` ones
    (either kind) it reads when the batch has them."""

    batch: tuple[str, ...] = ()
    non_tensor: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    def __post_init__(self):
        for field_name in ("batch", "non_tensor", "optional"):
            names = getattr(self, field_name)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(f"Inputs.{field_name} must be a sequence of column names, got {names!r}")
            object.__setattr__(self, field_name, tuple(names))

    @property
    def names(self) -> frozenset[str]:
        return frozenset((*self.batch, *self.non_tensor, *self.optional))

    def select(self, data: DataProto) -> DataProto:
        """The declared columns ``data`` has (tensors shared, nothing copied) and its whole meta_info."""
        names = self.names
        return DataProto(
            batch={k: v for k, v in data.batch.items() if k in names},
            non_tensor_batch={k: v for k, v in data.non_tensor_batch.items() if k in names},
            meta_info=data.meta_info,
        )

    def select_args(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Every DataProto among a call's arguments reduced to the declared columns, and every future to be
        reduced if the controller resolves it (`DataProtoFuture.selecting`); other arguments unchanged."""

        def pick(value):
            if isinstance(value, DataProtoFuture):
                return value.selecting(self.select)
            return self.select(value) if isinstance(value, DataProto) else value

        return tuple(pick(a) for a in args), {k: pick(v) for k, v in kwargs.items()}

    def received(self, data: DataProto, owner: str) -> DataProto:
        """What the method sees: the declared columns, checked, with undeclared reads failing loudly.
        ``owner`` (e.g. ``"ActorWorker rank 0/2: update_actor"``) prefixes every error."""
        missing = [k for k in self.batch if k not in data.batch]
        if missing:
            raise KeyError(
                f"{owner} needs batch key(s) {missing}; the batch has {sorted(data.batch)} "
                "(see dataproto/BATCH_LAYOUT.md)"
            )
        missing = [k for k in self.non_tensor if k not in data.non_tensor_batch]
        if missing:
            raise KeyError(
                f"{owner} needs "
                + ", ".join(f"non_tensor_batch key {k!r}" for k in missing)
                + f"; it has {sorted(data.non_tensor_batch)} (see dataproto/BATCH_LAYOUT.md)"
            )
        out = self.select(data)
        out.batch = DeclaredColumns(out.batch, owner, "batch", self)
        out.non_tensor_batch = DeclaredColumns(out.non_tensor_batch, owner, "non_tensor_batch", self)
        return out


class DeclaredColumns(dict):
    """A column dict whose missing keys raise a KeyError that says why: undeclared, or optional and absent."""

    def __init__(self, columns: dict, owner: str, kind: str, inputs: Inputs):
        super().__init__(columns)
        self.owner, self.kind, self.inputs = owner, kind, inputs

    def __missing__(self, key):
        if key in self.inputs.optional:
            raise KeyError(f"{self.owner} read optional input {self.kind}[{key!r}], which this batch lacks")
        raise KeyError(
            f"{self.owner} read {self.kind}[{key!r}], which its @register(inputs=...) does not declare "
            f"(declared: {sorted(self.inputs.names)}); add it there so the group sends it"
        )


def plain_columns(result):
    """A method's DataProto result with plain column dicts again (it may hand back the batch it was given)."""
    if isinstance(result, DataProto):
        if isinstance(result.batch, DeclaredColumns):
            result.batch = dict(result.batch)
        if isinstance(result.non_tensor_batch, DeclaredColumns):
            result.non_tensor_batch = dict(result.non_tensor_batch)
    return result
