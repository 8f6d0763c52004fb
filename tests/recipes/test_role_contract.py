"""Roles composed per pool, through the recipe: a role written only against the role contract
(`workers/roles/examples/rollout_recorder.py`: it shares the rollout role with ``Shared("rollout")`` and
generates through it) joins the rollout role's processes by the recipe's role options and trains
``recipes.grpo`` in both placements, touching no other role's class. Plus the contract's own rules: every
worker class is at most 4 classes deep, and a role that shares one built after it (or one not in its pool) is
refused before any process starts."""

import importlib
import json
import pkgutil
import sys

import pytest
import ray

import workers
from controller import RayClassWithInitArgs, Shared, Worker, create_colocated_worker_cls
from recipes import grpo
from recipes.config import load_config
from recipes.trainer.roles import PooledRole
from recipes.trainer.run import start_run
from tests.recipes.test_rollout_engine_contract import DIGIT_REWARD, PLACEMENT
from workers.roles import ActorWorker, RolloutWorker
from workers.roles.examples.rollout_recorder import RolloutRecorder

STEPS, PROMPTS, N = 2, 4, 4


@pytest.mark.e2e
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_a_role_added_by_the_recipe_generates_and_records_in_both_placements(
    ray_session, tmp_path, placement
):
    reward = tmp_path / "digits.py"
    reward.write_text(DIGIT_REWARD)
    cfg = load_config(
        "grpo",
        [
            "model.tiny_size=nano",
            "task.name=arithmetic",
            "task.n_train=32",
            f"data.train_batch_size={PROMPTS}",
            "data.max_prompt_length=32",
            "data.max_response_length=16",
            f"rollout.n={N}",
            "actor.ppo_mini_batch_size=4",
            "actor.use_kl_loss=false",
            f"custom_reward_function.path={reward}",
            f"trainer.total_training_steps={STEPS}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.resume_mode=disable",
            "trainer.progress_bar=false",
            "trainer.logger=[console]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            *PLACEMENT[placement],
        ],
    )
    out_dir = tmp_path / "rollouts"
    spec = RayClassWithInitArgs(RolloutRecorder, out_dir=str(out_dir), rollout_role=Shared("rollout"))
    run = start_run(cfg, "grpo", start_ray=False)
    history = grpo.train(cfg, run, extra_roles={"recorder": PooledRole(spec)}, generator="recorder")[
        "history"
    ]

    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    for row in history:
        assert row["recorder/rows"] == PROMPTS * N  # every generated row went through the new role
        assert row["critic/advantages/max"] > 0 and row["actor/grad_norm"] > 0  # and trained
        assert row["perf/weight_sync_bytes"] > 0  # the rollout role it shares still takes the weights
    lines = [
        json.loads(line) for f in sorted(out_dir.glob("rank*.jsonl")) for line in f.read_text().splitlines()
    ]
    assert [f.name for f in sorted(out_dir.glob("rank*.jsonl"))] == ["rank0.jsonl"]  # one rollout rank
    assert len(lines) == STEPS * PROMPTS * N and {r["call"] for r in lines} == set(range(STEPS))
    assert all(r["response_tokens"] > 0 and r["prompt"] for r in lines)
    lengths = [r["response_length/mean"] for r in history]  # the recorded tokens are the batch's
    for step, mean in enumerate(lengths):
        recorded = [r["response_tokens"] for r in lines if r["call"] == step]
        assert sum(recorded) / len(recorded) == pytest.approx(mean)


def _worker_classes() -> list[type]:
    for mod in pkgutil.walk_packages(workers.__path__, "workers."):
        if mod.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(mod.name)
        except ImportError:  # optional extras (SGLang, Megatron) that this install lacks
            continue
    found, todo = [], [Worker]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            # ray.remote(cls) makes subclasses of its own in the driver (ray.actor's `_modify_class` and
            # `ActorClass(...)`), which keep our __module__: a class of ours is its module's own attribute
            module = sys.modules.get(sub.__module__)
            if (
                sub.__module__.startswith(("workers.", "recipes."))
                and getattr(module, sub.__name__, None) is sub
            ):
                found.append(sub)
    return found


def test_every_worker_class_is_at_most_four_classes_deep():
    # Ray's own subclasses (ray.remote makes them in the driver), alive as an earlier test's may be
    remote_actor = ray.remote(ActorWorker)
    classes = _worker_classes()
    del remote_actor
    assert {ActorWorker, RolloutWorker, RolloutRecorder} <= set(classes)
    deep = {c.__qualname__: [k.__name__ for k in c.__mro__] for c in classes if len(c.__mro__) - 1 > 4}
    assert not deep, deep  # object not counted


def test_sharing_a_role_built_later_or_elsewhere_is_refused_before_any_process():
    recorder = RayClassWithInitArgs(RolloutRecorder, out_dir="x", rollout_role=Shared("rollout"))
    rollout = RayClassWithInitArgs(RolloutWorker, model=None, rollout=None)
    with pytest.raises(ValueError, match="role 'recorder' .* shares role 'rollout', which comes later"):
        create_colocated_worker_cls({"recorder": recorder, "rollout": rollout})
    with pytest.raises(ValueError, match="shares role 'rollout', which is not in this pool"):
        create_colocated_worker_cls({"recorder": recorder})
    create_colocated_worker_cls({"rollout": rollout, "recorder": recorder})  # the right order


def test_pool_roles_maps_roles_to_pools_per_placement():
    from types import SimpleNamespace

    from recipes.trainer.roles import plan_of, pool_roles

    run = SimpleNamespace(model_path="unused")  # only the classes and their arguments are built here
    spec = RayClassWithInitArgs(RolloutRecorder, out_dir="x", rollout_role=Shared("rollout"))
    extra = {"recorder": PooledRole(spec)}
    for placement, expected in [
        ("colocated", {"global_pool": ["actor", "rollout", "reward", "recorder"]}),
        ("disaggregated", {"train_pool": ["actor", "reward"], "rollout_pool": ["rollout", "recorder"]}),
    ]:
        cfg = load_config(
            "grpo", [*PLACEMENT[placement], "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false"]
        )
        pools = pool_roles(cfg, run, plan_of(cfg), extra_roles=extra)
        assert {pool: list(roles) for pool, roles in pools.items()} == expected, placement
    cfg = load_config("grpo", PLACEMENT["colocated"])
    with pytest.raises(ValueError, match="extra role 'actor' is already a role"):
        pool_roles(cfg, run, plan_of(cfg), extra_roles={"actor": PooledRole(spec)})
    with pytest.raises(ValueError, match="extra role 'recorder' joins role 'critic', which this run has not"):
        pool_roles(cfg, run, plan_of(cfg), extra_roles={"recorder": PooledRole(spec, beside="critic")})
