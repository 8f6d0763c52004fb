"""The training-engine contract (`workers.engine.base.TrainEngine`) and its registry (`workers.engine.registry`):
a third engine is one file plus a config value (``actor.strategy=path/to/file.py:Class``, or a registered name),
the registry builds it and checks it against the contract (a class lacking a member is refused, the member
named), and the roles and the config checks before Ray read what it declares, never its class or its name."""

from __future__ import annotations

import ast
from pathlib import Path

import engine_testlib as T
import pytest

from workers.config import ActorConfig, ModelConfig, RolloutConfig
from workers.engine import FSDPEngine, LoRAConfig, MegatronConfig
from workers.engine.base import TrainEngine
from workers.engine.registry import (
    TRAIN_ENGINES,
    build_train_engine,
    check_train_engine,
    contract_members,
    register_train_engine,
    train_engine_class,
)
from workers.roles.actor import ActorWorker
from workers.roles.common import build_engine, data_parallel_size, mesh_info

# A user's engine in a file of its own: the FSDP engine that counts its training steps, declares that it does
# not compile, and puts <role>.megatron.tensor_model_parallel_size ranks in one model replica (as a
# model-parallel engine would), so the checks that read those declarations show it.
USER_ENGINE = """
from typing import ClassVar

from workers.engine import FSDPEngine


class CountingEngine(FSDPEngine):
    supports_compile: ClassVar[bool] = False
    steps_taken = 0

    @classmethod
    def from_config(cls, config, parallel):
        engine = cls(config)
        engine.replica_ranks = parallel.tensor_model_parallel_size
        return engine

    @classmethod
    def model_parallel_size(cls, parallel):
        return parallel.tensor_model_parallel_size

    def dispatch_place(self, rank):
        return rank // self.replica_ranks, rank % self.replica_ranks == 0

    def train_step(self, data, loss_fn, **kw):
        self.steps_taken += 1
        return super().train_step(data, loss_fn, **kw)
"""


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/workers/conftest.py


@pytest.fixture(scope="module")
def user_engine(tmp_path_factory) -> str:
    """``actor.strategy`` of the user's engine: its file and class."""
    path = tmp_path_factory.mktemp("user_engine") / "counting_engine.py"
    path.write_text(USER_ENGINE)
    return f"{path}:CountingEngine"


def test_a_users_engine_is_one_file_plus_a_config_value(tmp_path, user_engine, monkeypatch):
    cls = train_engine_class(user_engine)
    assert cls.__name__ == "CountingEngine" and issubclass(cls, FSDPEngine)
    # the registry builds it (the roles' build_engine is the registry's), and it trains like the FSDP engine
    model_dir = T.make_model_dir(tmp_path / "tiny")
    tp2 = MegatronConfig(tensor_model_parallel_size=2)
    engine = build_engine(T.engine_config(model_dir), user_engine, tp2, tag="t")
    assert type(engine) is cls and isinstance(engine, TrainEngine)
    engine.train_step(T.make_batch(4, seed=1), T.pg_loss, micro_batch_size=2)
    assert engine.steps_taken == 1 and engine.global_step == 1  # type: ignore[attr-defined]
    # the roles read its declared layout: two ranks per replica, one of them collected
    assert data_parallel_size(4, user_engine, tp2, section="actor", tag="t") == 2
    assert data_parallel_size(4, user_engine, MegatronConfig(), section="actor", tag="t") == 4
    assert [mesh_info(engine, r) for r in range(4)] == [(0, True), (0, False), (1, True), (1, False)]
    # a name for it, in this process
    monkeypatch.setitem(TRAIN_ENGINES, "counting", TRAIN_ENGINES["fsdp"])  # restored afterwards
    register_train_engine("counting", cls)
    assert train_engine_class("counting", "critic.strategy") is cls
    # an unknown name lists the known ones
    with pytest.raises(ValueError, match=r"actor.strategy must be 'counting' or 'fsdp' or 'megatron'"):
        train_engine_class("deepspeed")


def test_the_config_checks_and_the_roles_read_what_the_engine_declares(user_engine, monkeypatch):
    from recipes.config import ConfigError, load_config
    from recipes.worker_sections import check_actor

    # model.compile: refused for the engine that declares supports_compile=False, naming the role
    cfg = load_config("grpo", [f"actor.strategy={user_engine}"])
    cfg.model.compile = True
    errors: list[str] = []
    check_actor(errors, cfg)
    assert len(errors) == 1 and "model.compile=true" in errors[0] and "actor.strategy=" in errors[0]
    # LoRA: it inherits supports_lora=True from the FSDP engine, so the config check and the actor role take it
    # (both compared the name with "fsdp" before); the Megatron engine declares False and is refused by both
    load_config("grpo", [f"actor.strategy={user_engine}", "actor.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank=4 needs actor\.strategy=fsdp"):
        load_config("grpo", ["actor.lora.rank=4", "actor.strategy=megatron"])
    monkeypatch.setenv("MASTER_PORT", "29555")
    rollout = RolloutConfig(n=2)
    lora = LoRAConfig(rank=4)
    ActorWorker(ModelConfig(path="unused"), ActorConfig(strategy=user_engine, lora=lora), rollout)
    with pytest.raises(ValueError, match=r"actor.lora needs a training engine that supports LoRA"):
        ActorWorker(ModelConfig(path="unused"), ActorConfig(strategy="megatron", lora=lora), rollout)
    # an unknown strategy is a config error listing the engines
    with pytest.raises(ConfigError, match="actor.strategy must be fsdp or megatron, got 'deepspeed'"):
        load_config("grpo", ["actor.strategy=deepspeed"])


def _complete_class(name: str, leave_out: str = "", **capabilities) -> type:
    """A class with every member of the contract (stubs) but ``leave_out``."""
    caps = dict.fromkeys(contract_members(object)[0], False) | capabilities
    stub = type(name, (), caps)
    _, _, methods = contract_members(stub)
    return type(name, (), caps | {m: (lambda self: None) for m in methods if m != leave_out})


def test_the_contract_check_names_what_a_class_lacks():
    check_train_engine(FSDPEngine, "actor.strategy='fsdp'")
    check_train_engine(_complete_class("Stubbed"), "x")  # nothing missing
    with pytest.raises(
        TypeError, match=r"NoLayout lacks \['checkpoint_layout'\] of the TrainEngine contract"
    ):
        check_train_engine(_complete_class("NoLayout", leave_out="checkpoint_layout"), "x")
    with pytest.raises(TypeError, match=r"NoPlace lacks \['dispatch_place'\]"):
        register_train_engine("no_place", _complete_class("NoPlace", leave_out="dispatch_place"))
    assert "no_place" not in TRAIN_ENGINES
    # a capability declared True brings its own members: LoRA's adapters, resharding's shards
    adapters = type("Adapters", (_complete_class("Plain"),), {"supports_lora": True})
    with pytest.raises(TypeError, match=r"Adapters lacks \['adapter_state_iter', 'base_model_mode'\]"):
        check_train_engine(adapters, "x")
    resharding = type("Shards", (_complete_class("Plain"),), {"reshards_for_generation": True})
    with pytest.raises(
        TypeError, match=r"Shards lacks \['reshard_plan', 'generation_shard_iter', 'reshard_stats'\]"
    ):
        check_train_engine(resharding, "x")
    # a capability that is not declared (or not a bool) is named too
    undeclared = type("Undeclared", (_complete_class("Base"),), {"supports_compile": None})
    with pytest.raises(TypeError, match=r"does not declare the capabilities \['supports_compile'\]"):
        check_train_engine(undeclared, "x")
    # the built instance must have the per-instance attributes (dp_size, device, ...)
    with pytest.raises(TypeError, match=r"built an engine without \['config', 'device', 'dp_size'"):
        Bare = _complete_class("Bare")
        Bare.from_config = classmethod(lambda cls, config, parallel: cls())  # type: ignore[attr-defined]
        TRAIN_ENGINES["bare"] = Bare
        try:
            build_train_engine(T.engine_config("/nonexistent"), "bare")
        finally:
            del TRAIN_ENGINES["bare"]


def test_no_role_tells_training_engines_apart_by_class_or_name():
    """The roles use the training engine only through the contract: no engine class, no type test on an engine
    and no comparison with an engine's name (``<role>.strategy``) in workers/roles."""
    roles = Path(__file__).resolve().parents[3] / "workers" / "roles"
    classes = {"FSDPEngine", "MegatronEngine"}
    found = []
    for path in sorted(roles.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = {getattr(node, "id", None), getattr(node, "attr", None)}
            if isinstance(node, ast.ImportFrom):
                names |= {alias.name for alias in node.names}
            sniff = (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("isinstance", "issubclass", "hasattr")
                and "engine" in ast.unparse(node.args[0])
            )
            if isinstance(node, ast.Compare):
                parts = [ast.unparse(p) for p in (node.left, *node.comparators)]
                sniff = any(p.endswith("strategy") or p in ("'fsdp'", "'megatron'") for p in parts)
            if names & classes or sniff:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")  # type: ignore[attr-defined]
    assert found == []
