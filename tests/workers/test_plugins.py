"""``workers.plugins``: a user's own file or module as a plugin (``"path/to/file.py:Class"`` as well as
``"package.module:Class"``), imported as a module registered in ``sys.modules``, its errors named by file and
line, its classes pickled by value for processes that do not have it; every registry takes a file."""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import subprocess
import sys
import textwrap
import typing

import pytest
import ray

from workers.agents.tool_calls import HermesParser, tool_parser
from workers.plugins import (
    UserCodeError,
    absolute_reference,
    load_plugin,
    load_user_file,
    load_user_object,
)
from workers.rlm.tools import load_tools
from workers.rollout.native import NativeEngine
from workers.rollout.registry import rollout_engine_class

SETTINGS = textwrap.dedent(
    """\
    from __future__ import annotations

    from dataclasses import dataclass, field


    @dataclass
    class Settings:
        bonus: float = 0.25
        words: list[str] = field(default_factory=lambda: ["yes"])


    def double(x: int) -> int:
        return 2 * x
    """
)


def _write(path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_a_users_file_is_a_registered_module_loaded_once(tmp_path):
    path = _write(tmp_path / "my_settings.py", SETTINGS)
    settings_cls = load_user_object(f"{path}:Settings", "what")
    assert dataclasses.is_dataclass(settings_cls) and settings_cls().words == ["yes"]
    module = sys.modules[settings_cls.__module__]
    assert module.__file__ == path and module.__name__.startswith("hyflow_user_my_settings_")
    assert typing.get_type_hints(settings_cls) == {"bonus": float, "words": list[str]}
    assert load_user_file(path) is module and load_user_object(f"{path}:double", "what")(4) == 8
    # another file of the same name is another module
    other = _write(tmp_path / "b" / "my_settings.py", "VALUE = 1\n")
    assert load_user_file(other) is not module and load_user_file(other).VALUE == 1


def test_an_error_in_a_users_file_or_module_names_the_file_and_the_line(tmp_path, monkeypatch):
    syntax = _write(tmp_path / "syntax.py", "x = 1\n\ndef f(:\n    pass\n")
    with pytest.raises(UserCodeError, match=f"^{re.escape(syntax)}, line 3: SyntaxError: "):
        load_user_file(syntax)
    raises = _write(tmp_path / "raises.py", "import json\n\nCONFIG = json.loads('{bad')\n")
    with pytest.raises(
        UserCodeError, match=f"^{re.escape(raises)}, line 3: JSONDecodeError: Expecting property name"
    ):
        load_user_file(raises)
    assert not any(m.startswith("hyflow_user_raises_") for m in sys.modules)  # nothing half-imported is kept
    # through a registry: a ValueError naming the key, the value and the file's line
    with pytest.raises(ValueError) as err:
        load_plugin(f"{raises}:X", {"native": object}, object, "rollout.name", "rollout engine")
    assert f"rollout.name='{raises}:X': cannot import '{raises}' (UserCodeError: {raises}, line 3:" in str(
        err.value
    )
    # a module by name: the same, naming the module's file
    _write(tmp_path / "pkgs" / "my_pkg_56" / "__init__.py", "")
    module = _write(tmp_path / "pkgs" / "my_pkg_56" / "env.py", "A = 1\nB = A / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    with pytest.raises(
        ValueError, match=f"cannot import 'my_pkg_56.env' \\(UserCodeError: {re.escape(module)}, line 2: Zero"
    ):
        load_user_object("my_pkg_56.env:A", "env.loop='my_pkg_56.env:A'")
    # a missing file, a missing attribute, no attribute at all
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError,
        match=f"^x: cannot import 'a/b.py' \\(FileNotFoundError: {re.escape(str(tmp_path))}/a/b.py is",
    ):
        load_user_object("a/b.py:C", "x")
    with pytest.raises(ValueError, match="^x: file 'pkgs/my_pkg_56/__init__.py' has no 'C'$"):
        load_user_object("pkgs/my_pkg_56/__init__.py:C", "x")
    with pytest.raises(
        ValueError, match="^x: must be 'package.module:attribute' or 'path/to/file.py:attribute'"
    ):
        load_user_object("a/b.py", "x")


def test_a_relative_file_is_made_absolute_and_nothing_else_changes(tmp_path, monkeypatch):
    _write(tmp_path / "envs" / "mine.py", "")
    monkeypatch.chdir(tmp_path)
    assert absolute_reference("envs/mine.py:Loop") == f"{tmp_path}/envs/mine.py:Loop"
    assert absolute_reference("envs/mine.py") == f"{tmp_path}/envs/mine.py"
    for unchanged in ("native", "workers.agents.examples.word_count:WordCountLoop", "envs/missing.py:Loop"):
        assert absolute_reference(unchanged) == unchanged
    assert absolute_reference(f"{tmp_path}/envs/mine.py:Loop") == f"{tmp_path}/envs/mine.py:Loop"
    monkeypatch.setenv("HOME", str(tmp_path))  # env.loop=~/...: the shell leaves a "~" after "key=" as it is
    assert absolute_reference("~/envs/mine.py:Loop") == f"{tmp_path}/envs/mine.py:Loop"


def test_a_users_class_reaches_a_process_that_cannot_import_the_file(tmp_path):
    """What a Ray worker gets: ``ray.cloudpickle`` pickles the file's classes by value, so a process started
    elsewhere (another current directory, the file on no ``sys.path``) unpickles an instance of one."""
    path = _write(tmp_path / "private" / "my_settings.py", SETTINGS)
    settings = load_user_object(f"{path}:Settings", "what")(bonus=0.5, words=["a", "b"])
    probe = "import pickle, sys; s = pickle.loads(sys.stdin.buffer.read()); print(type(s).__name__, s.bonus, s.words)"

    def elsewhere(data: bytes) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        return subprocess.run(
            [sys.executable, "-c", probe], input=data, capture_output=True, cwd="/", env=env
        )

    out = elsewhere(ray.cloudpickle.dumps(settings))
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().split() == ["Settings", "0.5", "['a',", "'b']"]
    # by reference (plain pickle) that process cannot find the class's module: what pickling by value avoids
    by_reference = elsewhere(pickle.dumps(settings))
    assert b"ModuleNotFoundError: No module named 'hyflow_user_my_settings_" in by_reference.stderr


def test_every_registry_takes_a_users_file(tmp_path):
    """Rollout engines (``rollout.name``), tool-call parsers (``tool_format``) and RLM tools (``env.tools``),
    like agent loops (``env.loop``: tests/recipes/test_user_files.py), take ``path/to/file.py:Name``."""
    path = _write(
        tmp_path / "mine.py",
        "from __future__ import annotations\n"
        "from workers.agents.tool_calls import HermesParser\n"
        "from workers.rollout.native import NativeEngine\n"
        "class MyParser(HermesParser):\n    pass\n"
        "class MyEngine(NativeEngine):\n    pass\n"
        "def shout(text: str) -> str:\n    '''Upper case.'''\n    return text.upper()\n",
    )
    parser = tool_parser(f"{path}:MyParser")
    assert isinstance(parser, HermesParser) and type(parser).__name__ == "MyParser"
    engine = rollout_engine_class(f"{path}:MyEngine")
    assert issubclass(engine, NativeEngine) and engine.__name__ == "MyEngine"
    tools = load_tools({"shout": f"{path}:shout"})
    assert list(tools) == ["shout"]
    with pytest.raises(TypeError, match="is <function shout"):
        rollout_engine_class(f"{path}:shout")
