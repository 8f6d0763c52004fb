"""Sandboxed persistent Python REPLs for RLM environments (see README.md in this folder)."""

from workers.sandbox._repl_namespace import RESERVED_NAMES
from workers.sandbox.backend import ReplSession, SandboxBackend
from workers.sandbox.config import ExecResult, SandboxConfig, SandboxError
from workers.sandbox.isolation import bwrap_path
from workers.sandbox.repl import Repl
from workers.sandbox.sandbox import ReplSandbox
from workers.sandbox.subcalls import SubcallHandler
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
