"""Plugin lookup shared by every registry of extension points (rollout engines, agent loops, ...), and the one
loader of a user's own code.

A config value names a plugin either by a registered short name (``"native"``), by its import path
(``"package.module:Class"``) or by a Python file (``"path/to/my_env.py:Class"``), so a user's own class is one
file plus a config value. Registries map short names to classes or to import paths (imported on first use: an
optional dependency is only imported when chosen).

A user's file (``load_user_file``: an environment, a reward function, an engine, a tool parser) is imported as a
module registered in ``sys.modules`` under a name of its absolute path, as ``import`` would (``dataclasses``,
``typing.get_type_hints`` and pickle look a class's module up there), and its classes and functions are pickled
by value (cloudpickle), so a Ray worker that receives one needs no copy of the file on its ``sys.path``. An error
raised while importing it names the file and the line (``UserCodeError``). ``absolute_reference`` turns a
relative file path into an absolute one, which the driver's config does before it reaches the workers.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Mapping
from types import ModuleType
from typing import TypeVar

T = TypeVar("T")

__all__ = [
    "UserCodeError",
    "absolute_reference",
    "is_file_reference",
    "load_plugin",
    "load_user_file",
    "load_user_module",
    "load_user_object",
]


class UserCodeError(ImportError):
    """Importing a user's module or file raised; the message names the file and the line."""


def is_file_reference(module: str) -> bool:
    """Whether ``module`` (the part of ``"module:attr"`` before the colon, or a whole value) is a Python file
    path rather than a module name."""
    return module.endswith(".py") or "/" in module or os.sep in module


def _split(reference: str) -> tuple[str, str, str]:
    """``"a.b:C"`` / ``"dir/f.py:C"`` -> (module or path, ":", attribute); the last colon splits (a Windows
    drive letter stays in the path)."""
    module, sep, attr = reference.rpartition(":")
    return (module, sep, attr) if sep else (reference, "", "")


def absolute_reference(value: str) -> str:
    """``value`` with its file path made absolute (``"my_env.py:Loop"`` -> ``"/cwd/my_env.py:Loop"``, and a bare
    ``"reward.py"`` likewise) when it names an existing file relative to the current directory; anything else
    (a registered name, ``"package.module:Class"``, a missing file: its loader names it) unchanged."""
    module, sep, attr = _split(value)
    if not is_file_reference(module) or os.path.isabs(module):
        return value
    path = os.path.expanduser(module)
    if not os.path.isfile(path):
        return value
    return os.path.abspath(path) + sep + attr


def _module_name(path: str) -> str:
    """The ``sys.modules`` name of the file ``path`` (absolute): its stem and a hash of the path, so two files
    of the same name stay apart and one file loaded twice is one module."""
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0]) or "file"
    return f"hyflow_user_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:12]}"


def _where(err: BaseException, files: tuple[str, ...]) -> str:
    """``"FILE, line N"`` of the error: a syntax error's own position, else the innermost frame in ``files``
    (the user's file), else the innermost frame."""
    if isinstance(err, SyntaxError) and err.filename:
        return f"{err.filename}, line {err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) in files] or [
        f for f in frames if not f.filename.startswith("<frozen")
    ]
    return f"{mine[-1].filename}, line {mine[-1].lineno}" if mine else "?"


def _describe(err: BaseException) -> str:
    if isinstance(err, SyntaxError):
        return f"{type(err).__name__}: {err.msg}"
    return f"{type(err).__name__}: {err}"


def _pickle_by_value(module: ModuleType) -> None:
    """Pickle the module's classes and functions by value (Ray's cloudpickle, and the standalone one where
    installed): a worker process that receives one needs no importable copy of the file."""
    for name in ("ray.cloudpickle", "cloudpickle"):
        try:
            cloudpickle = importlib.import_module(name)
        except ImportError:
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
        except (AttributeError, ValueError):  # an old cloudpickle; a module not in sys.modules
            pass


def load_user_file(path: str) -> ModuleType:
    """The Python file ``path`` imported as a module registered in ``sys.modules`` (once per absolute path: a
    second call returns the same module). FileNotFoundError when it is not a file; ``UserCodeError`` naming the
    file and the line when importing it raises (a syntax error, an exception at its top level)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is not a file")
    name = _module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs, as import does: dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        sys.modules.pop(name, None)
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise UserCodeError(f"{_where(err, (path,))}: {_describe(err)}") from err
    _pickle_by_value(module)
    return module


def load_user_module(module: str) -> ModuleType:
    """``module``: a Python file path (``load_user_file``) or an importable module name. ImportError when it
    cannot be found; ``UserCodeError`` naming the file and the line when importing it raises."""
    if is_file_reference(module):
        return load_user_file(module)
    try:
        return importlib.import_module(module)
    except ImportError:
        raise
    except Exception as err:  # the module was found, and raised while it ran
        spec = _find_spec(module)
        origin = (os.path.abspath(spec.origin),) if spec is not None and spec.origin else ()
        raise UserCodeError(f"{_where(err, origin)}: {_describe(err)}") from err


def _find_spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except Exception:
        return None


def load_user_object(reference: str, what: str) -> object:
    """The attribute ``reference`` names: ``"package.module:attr"`` or ``"path/to/file.py:attr"``. Errors are
    ValueErrors starting ``{what}: `` (e.g. ``what="env.loop='my_env.py:Loop'"``): the form, a module or file that
    cannot be imported (naming the file and the line of an error raised in it), or an attribute it lacks."""
    module, sep, attr = _split(str(reference))
    if not sep or not module or not attr:
        raise ValueError(f"{what}: must be 'package.module:attribute' or 'path/to/file.py:attribute'")
    try:
        loaded = load_user_module(module)
    except (ImportError, OSError) as e:
        raise ValueError(f"{what}: cannot import {module!r} ({type(e).__name__}: {e})") from e
    try:
        return getattr(loaded, attr)
    except AttributeError:
        kind = "file" if is_file_reference(module) else "module"
        raise ValueError(f"{what}: {kind} {module!r} has no {attr!r}") from None


def load_plugin(name: str, known: Mapping[str, type | str], base: type[T], what: str, noun: str) -> type[T]:
    """The class ``name`` stands for: ``known[name]``, ``"package.module:Class"`` or ``"path/to/file.py:Class"``,
    a subclass of ``base``. Errors name the ``noun`` (e.g. "rollout engine") and the config key ``what`` (e.g.
    "rollout.name"), and list the known names."""
    entry = known.get(name, name)
    if isinstance(entry, type):
        cls = entry
    else:
        module, sep, attr = _split(str(entry))
        if not sep or not module or not attr:
            names = " or ".join(repr(n) for n in sorted(known))
            raise ValueError(
                f"unknown {noun} {name!r}: {what} must be {names}, got {name!r} (or 'package.module:Class' or "
                "'path/to/file.py:Class' of your own)"
            )
        cls = load_user_object(str(entry), f"{what}={name!r}")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        article = "an" if base.__name__[:1] in "AEIOU" else "a"
        raise TypeError(f"{noun} {what}={name!r} is {cls!r}, not {article} {base.__name__} subclass")
    return cls
