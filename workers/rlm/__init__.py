"""Recursive Language Model (RLM) pieces that need no sandbox: the turn protocol and the prompts."""

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
