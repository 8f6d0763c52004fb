"""Import shims for running ``sglang.Engine`` on a CPU-only machine (used by tests and CI only).

Two packages SGLang imports have no CPU build on the package registries: ``sgl_kernel`` (PyPI's
wheel is CUDA-only; SGLang's CPU kernels live only in its source tree) and ``torchvision`` (PyPI's
wheel is built against CUDA torch and fails with CPU torch: ``operator torchvision::nms does not
exist``). With ``SGLANG_USE_CPU_ENGINE=1`` and ``attention_backend="torch_native"`` SGLang imports
a few names from them at module load but never calls them. This folder stands in for both:

* ``sgl_kernel/`` and ``torchvision/`` import, and every name and submodule in them resolves to a
  placeholder that raises ``NotImplementedError`` naming the function if it is ever called, so a
  code path that really needs a kernel fails loudly instead of computing something wrong;
* ``torchvision-0.0.0+hyflow.cpushim.dist-info`` makes ``importlib.metadata`` find a version, which
  transformers checks before importing torchvision.

``workers.rollout.sglang.rollout.use_cpu_shims()`` puts this folder first on ``sys.path`` and
``PYTHONPATH`` (SGLang's scheduler and detokenizer are spawned processes) only for a CPU engine on
a machine without CUDA; a GPU machine installs the real packages and never sees this folder.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

SHIMMED = ("sgl_kernel", "torchvision")


class Placeholder:
    """Stands for any attribute of a shimmed module: attributes chain, calling raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._qualname} is not available on this platform: hyflow's CPU shim "
            "(workers/rollout/sglang/cpu_shim) stands in for it; run SGLang on a GPU machine with the "
            "real package for this code path"
        )

    def __repr__(self) -> str:
        return f"<hyflow CPU shim placeholder {self._qualname}>"


def fill(module: types.ModuleType) -> None:
    """Make ``module`` a shim: unknown attributes become placeholders, submodules import."""
    module.__path__ = []  # a package, so ``import sgl_kernel.x`` reaches the finder below
    # PEP 562: a module-level __getattr__ lives in the module's namespace (assigning the attribute stores it
    # there too, but mypy reads that as overriding typeshed's ModuleType.__getattr__ method)
    module.__dict__["__getattr__"] = lambda name: _attr(module.__name__, name)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _attr(module_name: str, name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return Placeholder(f"{module_name}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every submodule of a shimmed package as an empty shim module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in SHIMMED and "." in fullname:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        fill(module)
