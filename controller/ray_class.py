"""RayClassWithInitArgs: a worker class plus the arguments each of its actors is constructed with."""

from __future__ import annotations

from controller.worker import Worker


class RayClassWithInitArgs:
    def __init__(self, cls: type, *args, **kwargs):
        if not isinstance(cls, type):
            raise TypeError(
                f"RayClassWithInitArgs needs the plain worker class (not ray.remote(cls)), got {cls!r}"
            )
        if not issubclass(cls, Worker):
            raise TypeError(f"{cls.__name__} must subclass controller.Worker to run in a worker group")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"RayClassWithInitArgs({self.cls.__name__}, args={self.args!r}, kwargs={self.kwargs!r})"
