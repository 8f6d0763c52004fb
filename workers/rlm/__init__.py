"""Recursive Language Model (RLM) environments.

This package namespace re-exports only the light, sandbox-free pieces (turn protocol, prompts). The rest is
imported from its module so that importing the protocol does not pull in engines and sandboxes:
``workers.rlm.agent`` (RLMAgent), ``workers.rlm.trajectory_batch`` (trajectories -> DataProto),
``workers.rlm.env_worker`` (RLMEnvWorker, RLMActorRolloutWorker: the ``env`` role), ``workers.rlm.inference``
(``RLM(...).completion``) and ``workers.rlm.viewer`` (static HTML of JSONL trajectories).
"""

from workers.rlm.prompts import ContextInfo, PromptConfig, build_messages, describe_context, system_prompt
from workers.rlm.protocol import (
    DEFAULT_LANGUAGES,
    STATUSES,
    CodeResult,
    FinalCall,
    RLMTrajectory,
    RLMTurn,
    Turn,
    code_calls_final,
    dump_jsonl,
    format_observation,
    load_jsonl,
    parse_turn,
    truncate,
)

__all__ = [
    "DEFAULT_LANGUAGES",
    "STATUSES",
    "CodeResult",
    "ContextInfo",
    "FinalCall",
    "PromptConfig",
    "RLMTrajectory",
    "RLMTurn",
    "Turn",
    "build_messages",
    "code_calls_final",
    "describe_context",
    "dump_jsonl",
    "format_observation",
    "load_jsonl",
    "parse_turn",
    "system_prompt",
    "truncate",
]
