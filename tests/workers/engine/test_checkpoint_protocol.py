"""Checkpointing (workers/engine/checkpoint.py) knows an engine only through the `TrainEngine` protocol: a
minimal engine that is neither FSDP nor Megatron saves and resumes with its optimizer, LR schedule and step
counters, like torchtitan's checkpointer saving ``Stateful`` components."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from workers.engine import EngineConfig, TrainEngine, load_checkpoint, save_checkpoint
from workers.engine.registry import check_train_engine
from workers.engine.train_steps import load_module_state, module_state


class LinearEngine:
    """A one-layer "model" with the attributes and methods of the protocol, nothing more."""

    supports_lora: ClassVar[bool] = False
    supports_compile: ClassVar[bool] = False
    reshards_for_generation: ClassVar[bool] = False
    process_global_parallel_state: ClassVar[bool] = False
    supports_moe: ClassVar[bool] = False
    use_fsdp = False
    num_params = 8

    @classmethod
    def from_config(cls, config, parallel):
        return cls(seed=config.seed)

    @classmethod
    def model_parallel_size(cls, parallel):
        return 1

    def dispatch_place(self, rank):
        return rank, True

    def replica_coords(self):
        return {}

    def offload(self, optimizer=True):
        pass

    def reload(self, optimizer=True):
        pass

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.config = EngineConfig(model_path="none")
        self.device = torch.device("cpu")
        self.dp_size, self.dp_rank, self.dp_group = 1, 0, None
        self.is_value_model = False
        self.global_step = self.skipped_steps = 0
        self.hf_config = self.generation_config = None
        self.model = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)

    def dp_all_reduce(self, t, op=dist.ReduceOp.SUM):
        return t

    def compute_log_prob(self, data, **kwargs):
        return {}

    def compute_values(self, data, **kwargs):
        return {}

    def train_step(self, data, loss_fn=None, **kwargs):
        self.optimizer.zero_grad()
        self.model(data).square().sum().backward()
        self.optimizer.step()
        self.lr_scheduler.step()
        self.global_step += 1
        return {}

    def full_state_dict_iter(self, *, device="cpu", dtype=None):
        yield from self.model.state_dict().items()

    def state_dict(self):  # module_state: DCP loads in place, so the optimizer state must exist before a step
        train = {"global_step": self.global_step, "lr_scheduler": self.lr_scheduler.state_dict()}
        return {**module_state(self.model, self.optimizer), "train": train}

    def load_state_dict(self, state):
        load_module_state(self.model, self.optimizer, state)
        self.lr_scheduler.load_state_dict(state["train"]["lr_scheduler"])
        self.global_step = state["train"]["global_step"]

    def checkpoint_group(self):
        return None

    def checkpoint_layout(self):
        return {"kind": "linear"}


def test_any_train_engine_saves_and_resumes(tmp_path):
    batches = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    full = LinearEngine(seed=0)
    assert isinstance(full, TrainEngine)
    check_train_engine(LinearEngine, "LinearEngine")  # the registry would take it too
    for b in batches[:2]:
        full.train_step(b)
    path = save_checkpoint(full, tmp_path, extra={"data_pos": 2})
    for b in batches[2:]:
        full.train_step(b)

    resumed = LinearEngine(seed=1)  # other initial weights: everything must come from the checkpoint
    assert load_checkpoint(resumed, path) == {"data_pos": 2} and resumed.global_step == 2
    for b in batches[2:]:
        resumed.train_step(b)
    assert resumed.global_step == 4
    assert resumed.lr_scheduler.get_last_lr() == full.lr_scheduler.get_last_lr()
    for name, t in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], t), name
