"""The reward worker the recipes run: ``workers.roles.RewardWorker`` plus an optional custom reward function.

The rule scorers of every task's data source are registered by ``workers.reward`` itself.

``custom_reward_function.path`` / ``.name`` (verl's keys): a Python file and the function in it,
``fn(data_source, solution_str, ground_truth, extra_info=None) -> float``, that scores every data source
instead of the registered scorers.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

from controller import Dispatch, register
from dataproto import DataProto
from workers.reward import SCORERS
from workers.roles import RewardWorker
from workers.roles.reward import RM_SCORE_INPUTS


def load_function(path: str, name: str) -> Callable:
    """``name`` from the Python file ``path`` (errors name both)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom_reward_function.path={path!r} is not a file")
    spec = importlib.util.spec_from_file_location(f"hyflow_custom_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"custom_reward_function: {path} defines no function {name!r}")
    return fn


class TaskRewardWorker(RewardWorker):
    def __init__(
        self, tokenizer_path: str, reward, custom_path: str | None = None, custom_name: str = "compute_score"
    ):
        super().__init__(tokenizer_path, reward)
        self.custom_fn = load_function(custom_path, custom_name) if custom_path else None

    @register(Dispatch.DP_COMPUTE_PROTO, inputs=RM_SCORE_INPUTS)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        if self.custom_fn is not None and "data_source" in data.non_tensor_batch:
            for source in set(
                data.non_tensor_batch["data_source"]
            ):  # the custom function scores every source
                SCORERS[source] = lambda text, truth, extra, _s=source: self.custom_fn(_s, text, truth, extra)
        return super().compute_rm_score(data)
