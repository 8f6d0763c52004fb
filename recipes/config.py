"""Recipe configs: OmegaConf YAML beside each recipe, ``key.sub=value`` overrides, checked before Ray starts.

    cfg = load_config("grpo", ["actor.optim.lr=1e-5", "rollout.n=8"])   # recipes/grpo.yaml + overrides

The schema of a recipe is its dataclass in ``recipes.schemas`` (``SCHEMAS``), made of the sections in
``recipes.sections``. The role sections reuse the workers' own config dataclasses (``workers/config.py``:
``actor``, ``critic``, ``rollout``, ``reward``), so every field a worker accepts is a key here under verl's name
(``actor.ppo_mini_batch_size``, ``rollout.n``, ...). Loading merges schema defaults <- YAML <- overrides; an
unknown key or a value of the wrong type is a ``ConfigError`` naming the full key, and ``validate`` then runs
every section's check and the recipe's (batch sizes against the data-parallel sizes, placement against the
devices, estimator against the roles), naming keys and numbers.

The ``env`` section of the agent recipes has no fixed dataclass: ``env.loop`` (command line, else YAML, else the
schema's default) names an agent-loop plugin (``workers.agents.loop``), and the section is read into the
dataclass that plugin declares (``AgentLoop.config_class``), so a new environment brings its own keys; with
``env.loop: mixed`` (several environments, ``workers.agents.mixed``) each entry of ``env.envs`` likewise. A loop
given on the command line whose config is another dataclass than the file's drops the file's ``env`` section, and
a warning lists the settings that this resets.

A user's own file in a plugin value (``env.loop=path/to/my_env.py:Class``, ``rollout.name``, a tool parser) or in
``custom_reward_function.path`` is imported by the config check (``workers.plugins.load_user_file``: an error in
it names the file and the line before Ray starts), and a relative path is made absolute, so the Ray workers find
the file whatever their current directory and ``sys.path``.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from recipes.schemas import SCHEMAS
from recipes.sections import RecipeConfig
from recipes.worker_sections import WORKER_SECTION_CHECKS
from workers.agents.loop import AgentEnvConfig, agent_loop_class
from workers.engine.checkpoint import write_atomic
from workers.plugins import absolute_reference

RECIPES_DIR = Path(__file__).resolve().parent
logger = logging.getLogger("recipes")


class ConfigError(ValueError):
    """The recipe config is invalid; the message names the offending key(s) and values."""


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def _explain(err: OmegaConfBaseException, source: str, schema: DictConfig) -> ConfigError:
    """``err`` of merging ``source`` into ``schema`` (the config before that merge) as a ConfigError."""
    key = getattr(err, "full_key", None) or "?"
    msg = str(err).split("\n")[0]
    if isinstance(err, ConfigKeyError):
        parent, _, leaf = key.rpartition(".")
        return ConfigError(f"unknown config key {key!r} ({source}); {_known_keys_hint(schema, parent, leaf)}")
    if isinstance(err, ValidationError):
        return ConfigError(f"config key {key!r} ({source}): {msg}")
    return ConfigError(f"config error at {key!r} ({source}): {msg}")


def _known_keys_hint(schema: DictConfig, parent: str, leaf: str) -> str:
    node: Any = schema
    for part in [p for p in parent.split(".") if p]:
        node = node.get(part) if isinstance(node, DictConfig) else None
        if node is None:
            return "no such section"
    if not isinstance(node, DictConfig):
        return f"{parent!r} is not a section"
    keys = sorted(str(k) for k in node.keys())  # a schema section's keys are field names (str)
    close = sorted(
        {*difflib.get_close_matches(leaf, keys), *(k for k in keys if leaf and (leaf in k or k in leaf))}
    )
    hint = f" (did you mean {close}?)" if close else ""
    of = OmegaConf.get_type(node)
    where = f"{parent or 'the top level'!r}" + (f" ({of.__name__})" if dataclasses.is_dataclass(of) else "")
    return f"keys in {where}: {keys}{hint}"


def parse_overrides(args: list[str]) -> DictConfig:
    """``key.sub=value`` items -> a DictConfig (values parsed as YAML: ints, floats, bools, null, lists)."""
    bad = [a for a in args if "=" not in a or a.startswith("=")]
    if bad:
        raise ConfigError(f"overrides must look like key.sub=value, got {bad}")
    try:
        return OmegaConf.from_dotlist(list(args))
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot parse overrides {args}: {str(err).splitlines()[0]}") from None


def default_config_path(recipe: str) -> Path:
    return RECIPES_DIR / f"{recipe}.yaml"


def schema_config(schema_cls: type) -> DictConfig:
    """The schema's defaults as a DictConfig that YAML and overrides can be merged into. A frozen dataclass in the
    schema (``SandboxConfig``) makes a read-only node; OmegaConf 2.3 merges into it on Python 3.11 but refuses on
    3.12 ("Cannot set value of read-only config node": ``recipes.rlm`` could not load its YAML there). The flag
    is cleared on every node; the frozen dataclasses are built, and check their values, in `to_dataclass`."""
    cfg = OmegaConf.structured(schema_cls)
    _clear_readonly(cfg)
    return cfg


def _clear_readonly(node: DictConfig) -> None:
    OmegaConf.set_readonly(node, None)  # None: no flag of its own, inherit (the root: writable)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _clear_readonly(child)


def load_config(
    recipe: str,
    overrides: list[str] | None = None,
    config_path: str | os.PathLike | None = None,
    check: bool = True,
) -> RecipeConfig:
    """Schema of ``recipe`` <- its YAML (``recipes/<recipe>.yaml`` unless ``config_path``) <- ``overrides``;
    interpolations resolved, converted to the dataclasses and (``check``) validated."""
    schema_cls = SCHEMAS.get(recipe)
    if schema_cls is None:
        raise ConfigError(f"unknown recipe {recipe!r}; known: {sorted(SCHEMAS)}")
    path = Path(config_path) if config_path is not None else default_config_path(recipe)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    file_cfg = OmegaConf.load(path)
    if not isinstance(file_cfg, DictConfig):
        raise ConfigError(f"config file {path} must map section names to sections, not hold a list")
    cli = parse_overrides(list(overrides or []))
    merged = schema_config(schema_cls)
    if "env" in merged:
        _env_section(merged, recipe, schema_cls, file_cfg, cli, str(path))
    _one_item_lists(file_cfg, merged)
    merged = _merge(merged, file_cfg, str(path))
    if _switches_task(merged, cli):  # the file's knobs belong to the file's task
        merged.task.knobs = {}
    _one_item_lists(cli, merged)
    merged = _merge(merged, cli, "command-line override")
    _absolute_file_references(merged)
    return to_dataclass(merged, check=check)


def _merge(schema: DictConfig, source: DictConfig, where: str) -> DictConfig:
    """``source`` (read from ``where``) merged into ``schema``, an error as a ConfigError naming the key."""
    try:
        merged = OmegaConf.merge(schema, source)
    except OmegaConfBaseException as err:
        raise _explain(err, where, schema) from None
    assert isinstance(merged, DictConfig)  # a merge into a DictConfig gives one
    return merged


def _absolute_file_references(node: DictConfig | ListConfig) -> None:
    """Every value naming an existing Python file by a relative path (``"my_env.py:Class"``, ``"reward.py"``)
    made absolute (``workers.plugins.absolute_reference``): the driver resolves it, so a Ray worker finds the file
    whatever its current directory. Interpolations are left as they are."""
    # a DictConfig's keys (str in a schema; any DictKeyType in a bare ``dict`` field) or a ListConfig's indices
    keys: list[Any] = list(node.keys()) if isinstance(node, DictConfig) else list(range(len(node)))
    for key in keys:
        if OmegaConf.is_interpolation(node, key):
            continue
        value = node[key]
        if isinstance(value, (DictConfig, ListConfig)):
            _absolute_file_references(value)
        elif isinstance(value, str) and ".py" in value:
            resolved = absolute_reference(value)
            if resolved != value:
                node[key] = resolved


def _one_item_lists(source: DictConfig, schema: DictConfig) -> None:
    """A string in ``source`` where ``schema`` has a list of strings becomes a one-item list, so that
    ``data.train_files=/tmp/x.parquet`` (or ``train_files: x.parquet`` in a YAML file) means ``[/tmp/x.parquet]``.
    Interpolations and lists of other types are left to the merge (which names a wrong type)."""
    for key in list(source.keys()):
        if not isinstance(key, str) or key not in schema:
            continue  # an unknown key: the merge names it
        target, value = schema._get_node(key), source._get_node(key)
        if isinstance(target, DictConfig) and isinstance(value, DictConfig):
            _one_item_lists(value, target)
        elif (
            isinstance(target, ListConfig)
            and target._metadata.element_type is str
            and not OmegaConf.is_interpolation(source, key)
            and isinstance(source[key], str)
        ):
            source[key] = [source[key]]


def _env_section(
    merged: DictConfig, recipe: str, schema_cls: type, file_cfg: DictConfig, cli: DictConfig, path: str
) -> None:
    """Make ``merged.env`` the dataclass of the agent loop that ``env.loop`` names (command line, else the config
    file, else the schema's default). A command-line loop with another config than the file's drops the file's
    ``env`` section (its keys belong to the file's environment), as another ``task.name`` drops ``task.knobs``.
    A field of that dataclass typed ``dict[str, <AgentEnvConfig>]`` (``env.envs`` of ``env.loop: mixed``) holds
    env sections: each entry is read into the dataclass of the loop its own ``loop`` names, the same way."""
    need = get_type_hints(schema_cls)["env"]
    file_loop = OmegaConf.select(file_cfg, "env.loop", default=None)
    if file_loop is None:
        env_cls = _env_class(merged.env.loop, "the schema's default", recipe, "env", need)
    else:
        env_cls = _env_class(str(file_loop), path, recipe, "env", need)
    cli_loop = OmegaConf.select(cli, "env.loop", default=None)
    if cli_loop is not None:
        file_env, env_cls = env_cls, _env_class(str(cli_loop), "command-line override", recipe, "env", need)
        if env_cls is not file_env:
            _warn_dropped(file_cfg.pop("env", None), "env", str(cli_loop), file_env, env_cls, cli, path)
    if OmegaConf.get_type(merged.env) is not env_cls:
        merged.env = schema_config(env_cls)
    for name in _env_sections_fields(env_cls):
        _nested_env_sections(merged.env[name], f"env.{name}", recipe, file_cfg, cli, path)


def _env_sections_fields(env_cls: type) -> list[str]:
    """The fields of ``env_cls`` typed ``dict[str, <an AgentEnvConfig>]``: name -> an env section."""
    hints = get_type_hints(env_cls)
    out = []
    for f in dataclasses.fields(env_cls):
        args = get_args(hints[f.name]) if get_origin(hints[f.name]) is dict else ()
        if len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], AgentEnvConfig):
            out.append(f.name)
    return out


def _nested_env_sections(
    node: DictConfig, key: str, recipe: str, file_cfg: DictConfig, cli: DictConfig, path: str
) -> None:
    """Each entry ``<key>.<name>`` of the file and the command line becomes the dataclass of the loop its ``loop``
    names (command line, else the file); a command-line loop with another config drops the file's entry."""
    names: dict[str, None] = {}
    for source in (file_cfg, cli):
        section = OmegaConf.select(source, key, default=None)
        if isinstance(section, DictConfig):
            names |= dict.fromkeys(str(k) for k in section.keys())
    for name in names:
        file_loop = OmegaConf.select(file_cfg, f"{key}.{name}.loop", default=None)
        cli_loop = OmegaConf.select(cli, f"{key}.{name}.loop", default=None)
        if file_loop is None and cli_loop is None:
            raise ConfigError(
                f"config key '{key}.{name}.loop' is missing ({path} and the command line): each environment of "
                f"{key} names its agent loop (a registered name or 'package.module:Class')"
            )
        sub_cls = None
        if file_loop is not None:
            sub_cls = _env_class(str(file_loop), path, recipe, f"{key}.{name}", AgentEnvConfig)
        if cli_loop is not None:
            file_sub = sub_cls
            sub_cls = _env_class(
                str(cli_loop), "command-line override", recipe, f"{key}.{name}", AgentEnvConfig
            )
            if file_sub is not None and sub_cls is not file_sub:
                dropped = OmegaConf.select(file_cfg, key).pop(name, None)
                _warn_dropped(dropped, f"{key}.{name}", str(cli_loop), file_sub, sub_cls, cli, path)
        assert sub_cls is not None  # file_loop or cli_loop is set (checked above)
        if _env_sections_fields(sub_cls):
            raise ConfigError(
                f"config key '{key}.{name}.loop': {sub_cls.__name__} holds environments itself; an environment of "
                f"{key} must be a single one"
            )
        node[name] = schema_config(sub_cls)


def _warn_dropped(
    section: Any, key: str, loop: str, file_cls: type, env_cls: type, cli: DictConfig, path: str
) -> None:
    """Log which settings of the config file's ``key`` section (dropped: the command line's ``<key>.loop`` reads
    ``env_cls``, not the file's ``file_cls``) are reset: each with its value in the file and now (``env_cls``'s
    default, or "no such key"); those the command line sets again, or that keep their value, are not listed."""
    if not isinstance(section, DictConfig):
        return
    new = schema_config(env_cls)
    reset = []
    for leaf, value in _leaves(section):
        full = f"{key}.{leaf}"
        if leaf == "loop" or OmegaConf.select(cli, full, default=_MISSING) is not _MISSING:
            continue
        now = OmegaConf.select(new, leaf, default=_MISSING)
        if now is _MISSING:
            reset.append(f"{full}: {value!r} -> not a key of {env_cls.__name__}")
        elif _plain(now) != value:
            reset.append(f"{full}: {value!r} -> {_plain(now)!r}")
    if reset:
        logger.warning(
            "warning: %s.loop=%r (command line) reads %s, not the %s of %s: that file's %s section is dropped, "
            "and these settings of it change (set them on the command line to keep them):\n  %s",
            key,
            loop,
            env_cls.__name__,
            file_cls.__name__,
            path,
            key,
            "\n  ".join(reset),
        )


def _leaves(node: DictConfig, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of ``node`` (lists are leaves)."""
    out: list[tuple[str, Any]] = []
    for k in node.keys():
        value, name = node._get_node(k), str(k)
        if isinstance(value, DictConfig) and not OmegaConf.is_interpolation(node, name):
            out.extend(_leaves(value, f"{prefix}{name}."))
        else:
            out.append((f"{prefix}{name}", _plain(value)))
    return out


def _plain(value: Any) -> Any:
    """A node's value as plain Python (an interpolation as its ``${...}`` text)."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=False)
    return value._value() if hasattr(value, "_value") else value


def _env_class(loop: str, source: str, recipe: str, key: str, need: type) -> type:
    """The ``config_class`` of the agent loop ``loop`` (``<key>.loop``, set in ``source``), which must derive from
    ``need``: the type the recipe's schema gives ``env`` (the fields the recipe itself reads)."""
    try:
        loop_cls = agent_loop_class(loop)
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        raise ConfigError(f"config key '{key}.loop' ({source}): {err}") from None
    env_cls = getattr(loop_cls, "config_class", None)
    if env_cls is None:
        raise ConfigError(
            f"{key}.loop={loop!r} ({source}): {loop_cls.__name__} declares no config_class (its env section's "
            "dataclass)"
        )
    if not issubclass(env_cls, need):
        raise ConfigError(
            f"{key}.loop={loop!r} ({source}) reads an env config {env_cls.__name__}, but recipes.{recipe} needs "
            f"one deriving from {need.__name__} (the recipe reads its fields)"
        )
    return env_cls


def _switches_task(file_cfg: DictConfig, cli: DictConfig) -> bool:
    """Whether the overrides name another task than the config file: then the file's ``task.knobs`` are
    dropped and only the command line's ``task.knobs.*`` apply."""
    new = OmegaConf.select(cli, "task.name", default=None)
    old = OmegaConf.select(file_cfg, "task.name", default=None)
    return new is not None and new != old and "task" in file_cfg


def to_dataclass(cfg: DictConfig, check: bool = True) -> RecipeConfig:
    """A merged DictConfig -> the dataclass tree (interpolations resolved; dataclass checks run)."""
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise _explain(err, "resolving", cfg) from None
    except (ValueError, TypeError) as err:  # a dataclass __post_init__ (e.g. OptimConfig) refused a value
        section, msg = _failing_section(cfg), str(err)
        field_name = msg.split(" ", 1)[0].split("=", 1)[0]
        if OmegaConf.select(cfg, f"{section}.{field_name}", default=_MISSING) is not _MISSING:
            raise ConfigError(f"invalid config: {section}.{msg}") from None  # the message starts with the key
        raise ConfigError(f"invalid config at {section!r}: {msg}") from None
    assert isinstance(obj, RecipeConfig)  # cfg is a recipe schema's (load_config)
    if check:
        validate(obj)
    return obj


_MISSING = object()


def _failing_section(cfg: DictConfig, prefix: str = "") -> str:
    """The deepest section whose dataclass refuses its values (for errors raised in ``__post_init__``)."""
    for key in cfg.keys():
        node = cfg[key]
        if isinstance(node, DictConfig):  # a dataclass, or a dict of them (env.envs)
            try:
                OmegaConf.to_object(node)
            except (ValueError, TypeError):
                return _failing_section(node, f"{prefix}{key!s}.")
    return prefix.rstrip(".") or "the top level"


def as_dict(cfg: RecipeConfig) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: RecipeConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: RecipeConfig, path: str | os.PathLike) -> str:
    """Write the resolved config as YAML (atomically); ``load_config(recipe, config_path=path)`` reads it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, to_yaml(cfg).encode())
    return str(path)


# ----------------------------------------------------------------------------------------------------------------
# Validation: do the numbers fit together? Each section checks itself, then the recipe.
# ----------------------------------------------------------------------------------------------------------------


def validate(cfg: RecipeConfig) -> None:
    """Raise ConfigError listing every inconsistency (keys and numbers named): each section's check, then the
    recipe schema's ``check_recipe``."""
    errors: list[str] = []
    for f in dataclasses.fields(cfg):
        check = WORKER_SECTION_CHECKS.get(f.name) or getattr(getattr(cfg, f.name), "check", None)
        if check is not None:
            check(errors, cfg)
    cfg.check_recipe(errors)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
