"""Sandboxed persistent Python REPLs for RLM environments (see README.md in this folder)."""

from workers.sandbox._child import RESERVED_NAMES
from workers.sandbox.config import ExecResult, SandboxConfig
from workers.sandbox.sandbox import Repl, ReplSandbox, SandboxError, SubcallHandler, bwrap_path

__all__ = [
    "RESERVED_NAMES",
    "ExecResult",
    "Repl",
    "ReplSandbox",
    "SandboxConfig",
    "SandboxError",
    "SubcallHandler",
    "bwrap_path",
]
