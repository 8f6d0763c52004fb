"""System prompts for RLM agents, built as chat messages.

The context never goes into the prompt: the system message describes it (type, total length, item
count and the first item lengths, a dict's keys; each of several contexts ``context_0``, ``context_1``,
...) and the REPL holds it as ``context``. The prompt depends on the agent's depth (root = 0; a child
started by ``rlm_query`` is one deeper) and the depth cap ``max_depth``: below the cap ``rlm_query``
starts a child agent with its own REPL; at the cap it is a plain one-shot sub-LM call, like
``llm_query``, and the prompt says so.

    msgs = build_messages("What is the magic number for quiet-harbor?", context=text,
                          depth=0, max_depth=1, max_iterations=12)

Beside the built-in styles ("full", "compact"), ``PromptConfig`` takes your own system prompt:
``custom_system_prompt`` replaces it at every depth, ``system_prompts={depth: prompt}`` per depth (an agent
uses the entry of the largest depth <= its own, so ``{0: root_prompt, 1: child_prompt}`` covers every child;
a depth below the smallest key uses ``custom_system_prompt`` or the style). A custom prompt is used as
written, except these placeholders, replaced where they occur (other braces stay as they are):
``{context_info}`` (the context's description: type and sizes), ``{tools}`` (the REPL functions at this
depth, one per line), ``{depth}`` and ``{max_iterations}``. ``extra_instructions`` is appended to it too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ContextInfo",
    "Contexts",
    "PromptConfig",
    "build_messages",
    "describe_context",
    "describe_contexts",
    "system_prompt",
]


@dataclass(frozen=True)
class ContextInfo:
    """Type and size of a REPL context, or of several (``type_name == "contexts"``, one entry of ``parts``
    per ``context_<i>``). Sizes of non-str values are lengths of their JSON text."""

    type_name: str  # "str", "list[str]", "dict", "list[dict]", "NoneType", "contexts" ...
    total_chars: int
    n_items: int | None = None  # items of a list, keys of a dict, contexts of "contexts"
    item_lengths: tuple[int, ...] = ()  # the first few items' (values', contexts') lengths
    keys: tuple[str, ...] = ()  # the first few keys, for a dict
    parts: tuple[ContextInfo, ...] = ()  # one per context, for "contexts"

    def describe(self, max_items: int = 8, name: str = "context") -> str:
        if self.type_name == "contexts":
            head = (
                f"There are {self.n_items} contexts, `context_0` ... `context_{(self.n_items or 1) - 1}` "
                f"(`context` is `context_0`), {self.total_chars:,} characters in all:"
            )
            lines = [f"- {p.describe(max_items, f'context_{i}')}" for i, p in enumerate(self.parts)]
            return "\n".join([head, *lines]) if self.parts else "There are no contexts (`context` is None)."
        if self.type_name == "NoneType":
            return f"`{name}` is None: everything you have is in the request below."
        if self.type_name == "dict":
            keys = ", ".join(repr(k) for k in self.keys[:max_items])
            more = ", ..." if (self.n_items or 0) > min(len(self.keys), max_items) else ""
            return (
                f"`{name}` is a dict with {self.n_items:,} keys ({keys}{more}) of {self.total_chars:,} "
                "characters as JSON."
                if self.n_items
                else f"`{name}` is an empty dict."
            )
        text = f"`{name}` is a {self.type_name} of {self.total_chars:,} characters"
        if self.n_items is not None:
            shown = ", ".join(f"{n:,}" for n in self.item_lengths[:max_items])
            more = ", ..." if self.n_items > min(len(self.item_lengths), max_items) else ""
            text += (
                f" in {self.n_items:,} items (item lengths: {shown}{more})" if self.n_items else " (empty)"
            )
        return text + "."

    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "type": self.type_name,
            "length": self.total_chars,
            "n_items": self.n_items,
            "item_lengths": list(self.item_lengths),
        }
        if self.keys:
            d["keys"] = list(self.keys)
        if self.parts:
            d["parts"] = [p.to_dict() for p in self.parts]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ContextInfo:
        return cls(
            d["type"],
            int(d["length"]),
            d.get("n_items"),
            tuple(d.get("item_lengths") or ()),
            tuple(d.get("keys") or ()),
            tuple(cls.from_dict(p) for p in d.get("parts") or ()),
        )


@dataclass
class Contexts:
    """Several contexts of one trajectory: its REPL holds them as ``context_0``, ``context_1``, ... and
    ``context`` is ``context_0`` (as in rlms). A plain list is one context (a list of documents)."""

    values: list


def _chars(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False, default=str))


def describe_context(context: Any, max_items: int = 8) -> ContextInfo:
    """Type and size of a REPL context (a str, a list, a dict, None or anything JSON-able)."""
    if context is None:
        return ContextInfo("NoneType", 0)
    if isinstance(context, Contexts):
        return describe_contexts(context.values, max_items)
    if isinstance(context, str):
        return ContextInfo("str", len(context))
    if isinstance(context, Mapping):
        lengths = [_chars(v) for v in context.values()]
        keys = tuple(str(k) for k in list(context)[: max(max_items, 20)])
        return ContextInfo("dict", _chars(dict(context)), len(lengths), tuple(lengths[:max_items]), keys)
    if isinstance(context, Sequence) and not isinstance(context, bytes | bytearray):
        lengths = [_chars(x) for x in context]
        kinds = {type(x).__name__ for x in context}
        inner = kinds.pop() if len(kinds) == 1 else "Any"
        return ContextInfo(f"list[{inner}]", sum(lengths), len(lengths), tuple(lengths[:max_items]))
    return ContextInfo(type(context).__name__, len(str(context)))


def describe_contexts(contexts: Sequence[Any], max_items: int = 8) -> ContextInfo:
    """Several contexts (``context_0``, ``context_1``, ... in the REPL): one ContextInfo per context."""
    parts = tuple(describe_context(c, max_items) for c in contexts)
    lengths = tuple(p.total_chars for p in parts)
    return ContextInfo("contexts", sum(lengths), len(parts), lengths[:max_items], parts=parts)


@dataclass
class PromptConfig:
    max_output_chars: int = 20_000  # REPL output shown per block before truncation
    sub_lm_chars: int | None = None  # roughly how much text one llm_query prompt may hold
    max_iterations: int | None = None
    extra_instructions: str = ""  # appended to the system prompt (task-specific hints)
    # extra REPL names -> description: a name or a signature ("search(query, k=3)"); the agent adds its
    # custom tools (signature -> first docstring line) and the variables its setup code defined
    tools: dict[str, str] = field(default_factory=dict)
    # "full": the whole protocol with strategy advice; "compact": the same rules in a few lines, for small
    # models and short context windows (the full prompt is ~1,300 tokens of the tiny tokenizer)
    style: str = "full"
    # your own system prompt for every depth (replaces the style's; placeholders in the module docstring)
    custom_system_prompt: str | None = None
    # your own system prompt per depth: the entry of the largest depth <= the agent's wins (module docstring)
    system_prompts: dict[int, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.style not in PROMPT_STYLES:
            raise ValueError(f"PromptConfig.style must be one of {PROMPT_STYLES}, got {self.style!r}")
        if any(not isinstance(d, int) or d < 0 for d in self.system_prompts):
            raise ValueError(
                f"PromptConfig.system_prompts keys must be depths >= 0, got {list(self.system_prompts)}"
            )

    def custom_prompt(self, depth: int) -> str | None:
        """The user's system prompt template for an agent at ``depth``, or None (use the style)."""
        depths = [d for d in self.system_prompts if d <= depth]
        return self.system_prompts[max(depths)] if depths else self.custom_system_prompt


PROMPT_STYLES = ("full", "compact")


_ROOT_ROLE = (
    "You answer a request about a context that may be far longer than you can read at once. The "
    "context is not in this conversation: it is stored in a persistent Python REPL that you drive "
    "with code, turn by turn, until you give a final answer."
)

_CHILD_ROLE = (
    "You are a helper agent (depth {depth}) started by another agent's `rlm_query` call. Solve "
    "the request below using your own persistent Python REPL. Your final answer is returned, as a "
    "string, to the calling agent's code, so make it short and exactly what was asked for."
)


def _tools_section(depth: int, max_depth: int, cfg: PromptConfig) -> str:
    sub = f" (keep each prompt under about {cfg.sub_lm_chars:,} characters)" if cfg.sub_lm_chars else ""
    lines = [
        "- `context` -- the data for the request (see above). Slice it, search it, split it; do not "
        "print it whole.",
        f"- `llm_query(prompt) -> str` -- one call to a language model without a REPL{sub}. Good for "
        "reading, classifying or summarising one chunk of text you pass in the prompt.",
        "- `llm_query_batched(prompts) -> list[str]` -- many `llm_query` calls at once, answers in "
        "the same order; much faster than a loop of single calls.",
    ]
    if depth < max_depth:
        lines += [
            "- `rlm_query(prompt, context=None) -> str` -- hand a sub-task to a helper agent like you, "
            "with its own REPL holding `context` (whatever you pass: a str, a list, a dict). Use it "
            "when the sub-task needs several steps of code, not a single read; `literal=True` turns an "
            "answer such as `[3, 5]` into a Python value.",
            "- `rlm_query_batched(prompts, contexts=None) -> list[str]` -- several helper agents at once.",
        ]
    else:
        lines += [
            "- `rlm_query(prompt, context=None)` / `rlm_query_batched(prompts, contexts=None)` -- at "
            "this depth no further helper agents can be started: these behave like `llm_query` / "
            "`llm_query_batched` (a single model call; a `context` you pass is appended to the "
            "prompt).",
        ]
    lines += [
        "- `SHOW_VARS()` -- lists the variables you have defined.",
        '- `FINAL(value)` / `FINAL_VAR("name")` -- finish: answer with `str(value)`, or with the '
        "value of the named variable.",
    ]
    lines += [f"- `{name}` -- {desc}" for name, desc in cfg.tools.items()]
    return "\n".join(lines)


def system_prompt(
    context_info: ContextInfo,
    *,
    depth: int = 0,
    max_depth: int = 1,
    config: PromptConfig | None = None,
) -> str:
    """The system message for an agent at ``depth`` (0 = root) under the cap ``max_depth``."""
    if depth < 0 or max_depth < 0:
        raise ValueError(f"depth and max_depth must be >= 0, got {depth}, {max_depth}")
    cfg = config or PromptConfig()
    custom = cfg.custom_prompt(depth)
    if custom is not None:
        return _fill_custom(custom, context_info, depth, max_depth, cfg)
    if cfg.style == "compact":
        return _compact_prompt(context_info, depth, max_depth, cfg)
    role = _ROOT_ROLE if depth == 0 else _CHILD_ROLE.format(depth=depth)
    limit = f" You have at most {cfg.max_iterations} turns." if cfg.max_iterations else ""
    parts = [
        role,
        f"## The context\n{context_info.describe()}",
        "## The REPL\nPut Python code in fenced blocks marked `repl`:\n```repl\n"
        "print(len(context))\nprint(context[:500])\n```\n"
        "Every ```repl block in your message runs, in order, and variables persist between blocks and "
        "turns. Other fences (```python, ...) are not run. After your message you see what each block "
        f"printed (cut to {cfg.max_output_chars:,} characters per block), its errors and the names of "
        "your variables. Only printed output is shown: a bare expression on the last line shows "
        "nothing. Keep long text in variables and pass it to sub-calls instead of printing it.\n\n"
        "Available in the REPL:\n" + _tools_section(depth, max_depth, cfg),
        "## Finishing\nWhen you know the answer, finish in one of two ways:\n"
        '- call `FINAL(answer)` or `FINAL_VAR("variable_name")` inside a ```repl block, or\n'
        "- write `FINAL(your answer)` or `FINAL_VAR(variable_name)` alone on its own line, outside "
        "code. A FINAL_VAR line is read after your code blocks ran, so you can set the variable in a "
        "block of the same message.\n"
        "FINAL mentioned inside a sentence does not count. Do not finish before you have looked at "
        "the context." + limit,
        "## Strategy\nFirst find out what the context looks like (its size, a few lines, its "
        "structure). Then solve the request in code: search with string methods or regular "
        "expressions, split the context into chunks and read them with `llm_query_batched`, collect "
        "partial results in variables, and combine them. Check your result before you answer.",
    ]
    if cfg.extra_instructions:
        parts.append(cfg.extra_instructions.strip())
    return "\n\n".join(parts)


def _fill_custom(template: str, info: ContextInfo, depth: int, max_depth: int, cfg: PromptConfig) -> str:
    # str.replace, not str.format: a prompt may hold code with braces of its own
    values = {
        "{context_info}": info.describe(),
        "{tools}": _tools_section(depth, max_depth, cfg),
        "{depth}": str(depth),
        "{max_iterations}": str(cfg.max_iterations) if cfg.max_iterations else "unlimited",
    }
    text = template
    for key, value in values.items():
        text = text.replace(key, value)
    return text + ("\n\n" + cfg.extra_instructions.strip() if cfg.extra_instructions else "")


def _compact_prompt(info: ContextInfo, depth: int, max_depth: int, cfg: PromptConfig) -> str:
    rlm = "rlm_query(prompt, context=None) (a helper agent with its own REPL)" if depth < max_depth else ""
    calls = ", ".join(x for x in ("llm_query(prompt)", "llm_query_batched(prompts)", rlm, "SHOW_VARS()") if x)
    extra = "".join(f", {name} ({desc})" for name, desc in cfg.tools.items())
    limit = f" At most {cfg.max_iterations} turns." if cfg.max_iterations else ""
    text = (
        f"Answer the request using a persistent Python REPL. {info.describe()} Write code in ```repl "
        f"blocks; you see what they print (up to {cfg.max_output_chars:,} characters). Functions: {calls}"
        f"{extra}. Finish with FINAL(answer) or FINAL_VAR(name), in code or alone on a line.{limit}"
    )
    return text + ("\n\n" + cfg.extra_instructions.strip() if cfg.extra_instructions else "")


def build_messages(
    query: str,
    context: Any = None,
    *,
    context_info: ContextInfo | Mapping | None = None,
    depth: int = 0,
    max_depth: int = 1,
    config: PromptConfig | None = None,
    max_iterations: int | None = None,
) -> list[dict[str, str]]:
    """``[system, user]`` chat messages for an agent. Pass ``context`` (it is only measured, never
    copied into the messages) or its precomputed ``context_info`` (e.g. from a dataset row)."""
    if context_info is None:
        info = describe_context(context)
    elif isinstance(context_info, ContextInfo):
        info = context_info
    else:
        info = ContextInfo.from_dict(context_info)
    cfg = config or PromptConfig()
    if max_iterations is not None:
        cfg = PromptConfig(**{**cfg.__dict__, "max_iterations": max_iterations})
    where = (
        "The contexts are in the REPL variables `context_0`, `context_1`, ..."
        if info.type_name == "contexts"
        else "The context is in the REPL variable `context`."
    )
    user = f"{query.strip()}\n\n{where} Start by inspecting it in a ```repl block."
    return [
        {"role": "system", "content": system_prompt(info, depth=depth, max_depth=max_depth, config=cfg)},
        {"role": "user", "content": user},
    ]
