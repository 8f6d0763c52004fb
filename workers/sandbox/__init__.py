"""Sandboxed persistent Python REPLs for RLM environments (see README.md in this folder)."""

from workers.sandbox._child import RESERVED_NAMES
from workers.sandbox.backend import ReplSession, SandboxBackend
from workers.sandbox.config import ExecResult, SandboxConfig
from workers.sandbox.sandbox import Repl, ReplSandbox, SandboxError, SubcallHandler, bwrap_path
from workers.sandbox.tools import Tool

__all__ = [
    "RESERVED_NAMES",
    "ExecResult",
    "Repl",
    "ReplSandbox",
    "ReplSession",
    "SandboxBackend",
    "SandboxConfig",
    "SandboxError",
    "SubcallHandler",
    "Tool",
    "bwrap_path",
]
