"""Plugin lookup shared by every registry of extension points (rollout engines, agent loops, ...).

A config value names a plugin either by a registered short name (``"native"``) or by its import path
(``"package.module:Class"``), so a user's own class is one file plus a config value. Registries map short names to
classes or to import paths (imported on first use: an optional dependency is only imported when chosen).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def load_plugin(name: str, known: Mapping[str, type | str], base: type[T], what: str, noun: str) -> type[T]:
    """The class ``name`` stands for: ``known[name]`` or ``"package.module:Class"``, a subclass of ``base``.
    Errors name the ``noun`` (e.g. "rollout engine") and the config key ``what`` (e.g. "rollout.name"), and list
    the known names."""
    entry = known.get(name, name)
    if isinstance(entry, type):
        cls = entry
    else:
        module, sep, attr = str(entry).partition(":")
        if not sep or not module or not attr:
            names = " or ".join(repr(n) for n in sorted(known))
            raise ValueError(
                f"unknown {noun} {name!r}: {what} must be {names}, got {name!r} (or 'package.module:Class' of "
                "your own)"
            )
        try:
            cls = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise ValueError(f"{what}={name!r}: cannot import {module!r} ({type(e).__name__}: {e})") from e
        except AttributeError:
            raise ValueError(f"{what}={name!r}: module {module!r} has no {attr!r}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        article = "an" if base.__name__[:1] in "AEIOU" else "a"
        raise TypeError(f"{noun} {what}={name!r} is {cls!r}, not {article} {base.__name__} subclass")
    return cls
