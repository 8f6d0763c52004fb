"""Fixtures shared by the SGLang test modules."""

import importlib.util
import multiprocessing
import os
import sys

import pytest

SGLANG_HINT = "needs SGLang: run `make sglang-cpu` (CPU engine) or pip install hyflow[sglang] (CUDA)"


@pytest.fixture(scope="module")
def sglang_module(needs):
    """Skips without SGLang (fails in CI, which installs it); afterwards undoes what starting an engine
    changes for the whole test process: the CPU import shims on PYTHONPATH / sys.path (later subprocesses,
    e.g. sandboxes, must not import a fake torchvision) and SGLang's forced "spawn" start method."""
    if importlib.util.find_spec("sglang") is None:
        needs(SGLANG_HINT)
    env = {k: os.environ.get(k) for k in ("PYTHONPATH", "SGLANG_CPU_OMP_THREADS_BIND")}
    path = list(sys.path)
    method = multiprocessing.get_start_method(allow_none=True)
    yield
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    sys.path[:] = path
    multiprocessing.set_start_method(method, force=True)
