"""The isolation-backend interface: what an RLM agent needs from a sandbox.

``ReplSandbox`` (a fork-server zygote, bubblewrap or namespaces, seccomp, rlimits; see README.md) is the
backend that ships. A remote one -- a Docker container, a Modal or E2B sandbox -- implements the same two
protocols and is passed as ``RLM(sandbox=...)`` or ``RLMAgent(policy, sandbox, ...)``. None ships here:
each needs a service (a Docker daemon, a Modal or E2B account) that this project's machines cannot run or
reach, so none could be tested.

What a backend owes the agent (``ReplSandbox`` and ``Repl`` are the reference):

* ``acreate(context, setup_vars, handler, *, contexts, tools, setup_code)`` -> a session holding the
  context(s) as JSON values under the names ``context`` / ``context_<i>``, with ``llm_query``,
  ``rlm_query`` (and batched), ``FINAL``, ``FINAL_VAR``, ``SHOW_VARS`` and one function per tool defined in
  its REPL; sub-calls are answered by ``await handler(kind, payload)`` on the caller's loop (a remote
  backend proxies them back over its own channel), tools run on the host (``Tool.acall``), never in the
  sandbox. ``setup_code`` runs before the first block; its failure raises (``SandboxError``). Reserved
  names and tools are rebound after every block, contexts restored when changed in place.
* ``session.aexecute(code, timeout_s)`` -> ``ExecResult``; never raises for what the code does.
* ``session.aclose()``; ``backend.close()`` when the owner is done; ``backend.config.timeout_s`` (the
  default per-block limit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from workers.sandbox.config import ExecResult
from workers.sandbox.tools import Tool

__all__ = ["BackendConfig", "ReplSession", "SandboxBackend"]


class BackendConfig(Protocol):
    timeout_s: float  # default wall-clock limit of one code block


@runtime_checkable
class ReplSession(Protocol):
    """One persistent REPL of a backend (one per trajectory)."""

    setup_variables: list[tuple[str, str]]  # (name, type) of what setup_code defined

    async def aexecute(self, code: str, timeout_s: float | None = None) -> ExecResult: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SandboxBackend(Protocol):
    """A factory of REPL sessions (module docstring)."""

    config: Any  # a BackendConfig (e.g. SandboxConfig)

    async def acreate(
        self,
        context: Any = None,
        setup_vars: dict[str, Any] | None = None,
        handler: Callable[..., Any] | None = None,
        *,
        contexts: list | None = None,
        tools: Mapping[str, Tool | Callable[..., Any]] | None = None,
        setup_code: str | None = None,
    ) -> ReplSession: ...

    def close(self) -> None: ...
