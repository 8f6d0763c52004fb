"""A multi-turn tool-use math environment: the policy runs Python in the project's sandbox and answers in
``\\boxed{}`` (``protocol``: turn parsing, observations, the outcome verifier; ``agent``: the loop;
``env_worker``: the role workers). Import the agent and workers from their modules (they pull in engines
and the sandbox); this namespace re-exports the protocol only."""

from workers.math_env.protocol import (
    TOOL_CLOSE,
    TOOL_OPEN,
    Action,
    boxed_content,
    format_correction,
    format_tool_observation,
    parse_action,
    verify_boxed,
)

__all__ = [
    "TOOL_CLOSE",
    "TOOL_OPEN",
    "Action",
    "boxed_content",
    "format_correction",
    "format_tool_observation",
    "parse_action",
    "verify_boxed",
]
