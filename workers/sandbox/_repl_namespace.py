"""The names a REPL's namespace reserves (bound by the runtime, rebound after every block) and the copies
that keep its contexts pristine: a copy of a JSON value sharing its immutable leaves, and the check,
by identity only, that the code left such a copy untouched.

Standard library only and nothing done on import: the host imports it as
``workers.sandbox._repl_namespace`` for the reserved names, the zygote from its own folder (see
``_child.py``).
"""

import re

RESERVED_NAMES = (
    "context",
    "llm_query",
    "llm_query_batched",
    "rlm_query",
    "rlm_query_batched",
    "FINAL",
    "FINAL_VAR",
    "SHOW_VARS",
)
CONTEXT_NAME = re.compile(r"context_[0-9]+")  # several contexts: context_0, context_1, ... (also reserved)
MAX_VARS_LISTED = 200


def _unchanged(live, pristine) -> bool:
    """Is ``live`` still an untouched copy of ``pristine`` (a JSON value)? Identity and exact-type checks
    only, so no method of whatever the code put there runs; iterative, so depth costs no stack."""
    stack = [(live, pristine)]
    while stack:
        a, b = stack.pop()
        if a is b:
            continue
        kind = type(b)
        if kind is list:
            if type(a) is not list or len(a) != len(b):
                return False
            stack.extend(zip(a, b))
        elif kind is dict:
            if type(a) is not dict or len(a) != len(b):
                return False
            for (ka, va), (kb, vb) in zip(a.items(), b.items()):
                if ka is not kb:
                    return False
                stack.append((va, vb))
        else:
            return False
    return True


def _fresh(pristine):
    """A copy of a JSON value's lists and dicts that shares its immutable leaves (strings, numbers)."""
    if type(pristine) not in (list, dict):
        return pristine
    root: list | dict = [] if type(pristine) is list else {}
    stack = [(pristine, root)]
    while stack:
        src, dst = stack.pop()
        items = enumerate(src) if type(src) is list else src.items()
        for key, value in items:
            copy = [] if type(value) is list else {} if type(value) is dict else value
            if copy is not value:
                stack.append((value, copy))
            if type(dst) is list:
                dst.append(copy)
            else:
                dst[key] = copy
    return root
