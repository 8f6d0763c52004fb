"""The typed role handles (`workers/roles/handles.py`) against the worker classes that serve them: every group method
a handle declares exists on each worker class with the group signature its dispatch mode gives (names, kinds,
defaults and types of the parameters, and the result), and a worker class's own handle declares all its
methods. A renamed, removed or re-typed worker method fails here; mypy checks the controller's calls against the
handles."""

import inspect
import typing

import pytest

from controller.worker_group import RayWorkerGroup, _resolve_methods
from dataproto import DataProto
from workers.agents.env_worker import EnvWorker
from workers.prm.worker import PRMWorker
from workers.roles import handles
from workers.roles.actor import ActorWorker
from workers.roles.critic import CriticWorker
from workers.roles.reference import RefWorker
from workers.roles.reward import RewardWorker
from workers.roles.rollout import RolloutWorker

# handle -> (the worker class it is the whole interface of, other worker classes that can serve it)
SERVED_BY = {
    handles.ActorGroup: (ActorWorker, ()),
    handles.RefGroup: (RefWorker, (ActorWorker,)),  # with LoRA the actor's frozen base is the reference
    handles.CriticGroup: (CriticWorker, ()),
    handles.RolloutGroup: (RolloutWorker, ()),
    handles.EnvGroup: (EnvWorker, ()),
    handles.GeneratorGroup: (None, (RolloutWorker, EnvWorker)),
    handles.RewardGroup: (RewardWorker, ()),
    handles.PRMGroup: (PRMWorker, ()),
    handles.RoleGroup: (
        None,
        (ActorWorker, CriticWorker, RefWorker, RolloutWorker, EnvWorker, RewardWorker, PRMWorker),
    ),
}
# once a class has been made a Ray actor class in this process, Ray's tracing has given its methods this
# keyword-only parameter, which the group call never takes
RAY_TRACE_CONTEXT = "_ray_trace_ctx"
PER_RANK_LISTS = {"one_to_all", "all_to_all"}  # the group call returns the ranks' results as a list
RANK_ZERO = {"one_to_all_rank_zero", "rank_zero"}  # the group call returns rank 0's result


def group_signature(worker_cls: type, name: str) -> tuple[list[tuple], object]:
    """(parameters as (name, kind, default, type), result type) of the group call of ``worker_cls.name``,
    derived from the worker method and its dispatch mode."""
    mode = _resolve_methods(worker_cls)[name][1].name
    method = getattr(worker_cls, name)
    hints = typing.get_type_hints(method)
    params = []
    for p in list(inspect.signature(method).parameters.values())[1:]:
        if p.name == RAY_TRACE_CONTEXT:
            continue
        kind, default = p.kind, p.default
        hint = hints[p.name]
        if mode == "all_to_all":  # one entry per rank; an omitted argument is the worker's default
            hint, default = list[hint], (Ellipsis if default is not inspect.Parameter.empty else default)
        params.append((p.name, kind, default, hint))
    result = None if hints["return"] is type(None) else hints["return"]
    if mode in PER_RANK_LISTS:
        result = list[result]
    elif mode not in RANK_ZERO:
        assert result is DataProto, f"{worker_cls.__name__}.{name}: a {mode} method returns a DataProto"
    return params, result


def declared_signature(method) -> tuple[list[tuple], object]:
    hints = typing.get_type_hints(method)
    params = list(inspect.signature(method).parameters.values())[1:]
    return [(p.name, p.kind, p.default, hints[p.name]) for p in params], hints["return"]


CASES = [
    (handle, worker_cls, name)
    for handle, (own, others) in SERVED_BY.items()
    for worker_cls in ((own,) if own else ()) + others
    for name in handles.group_methods(handle)
]


@pytest.mark.parametrize(
    "handle, worker_cls, name", CASES, ids=[f"{h.__name__}-{w.__name__}-{n}" for h, w, n in CASES]
)
def test_a_handles_method_is_the_workers_group_call(handle, worker_cls, name):
    assert name in _resolve_methods(worker_cls), f"{worker_cls.__name__} has no registered method {name}"
    assert declared_signature(handles.group_methods(handle)[name]) == group_signature(worker_cls, name)


@pytest.mark.parametrize("handle", [h for h, (own, _) in SERVED_BY.items() if own], ids=lambda h: h.__name__)
def test_a_worker_class_handle_declares_all_its_methods(handle):
    own = SERVED_BY[handle][0]
    assert sorted(handles.group_methods(handle)) == sorted(_resolve_methods(own))


def unstarted_group(worker_cls: type) -> RayWorkerGroup:
    """A group of no ranks over ``worker_cls``: its methods bound as a started group's are (no Ray needed)."""
    return RayWorkerGroup._from_actors("g", [], worker_cls, "", None, ("", 0), (None, 0.0), True)


def test_role_group_types_a_group_that_serves_the_role_and_names_what_is_missing():
    actor = unstarted_group(ActorWorker)
    assert handles.role_group(actor, handles.RefGroup) is actor
    with pytest.raises(TypeError, match=r"'g' \(RewardWorker\) cannot serve as ActorGroup: .*update_actor"):
        handles.role_group(unstarted_group(RewardWorker), handles.ActorGroup)


def test_the_check_reads_the_methods_as_written_after_ray_wrapped_them():
    """Ray wraps a worker class's methods in place when it becomes an actor class (earlier tests in the same
    process do that): the group signatures stay the worker's own."""
    import ray

    ray.remote(RewardWorker)
    assert "_ray_trace_ctx" in inspect.signature(RewardWorker.compute_rm_score).parameters
    test_a_handles_method_is_the_workers_group_call(handles.RewardGroup, RewardWorker, "compute_rm_score")


def test_a_renamed_worker_method_is_found(monkeypatch):
    """The check itself: the actor's update_actor renamed leaves ActorGroup's declaration without its method."""
    methods = dict(_resolve_methods(ActorWorker))
    methods["update_policy"] = methods.pop("update_actor")
    monkeypatch.setitem(globals(), "_resolve_methods", lambda cls: methods)
    with pytest.raises(AssertionError, match="no registered method update_actor"):
        test_a_handles_method_is_the_workers_group_call(handles.ActorGroup, ActorWorker, "update_actor")
