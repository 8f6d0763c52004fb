"""A role written only against the role contract: it generates through the rollout role it shares and records
every sampled response to JSONL (the "what did the policy write at step k" file users ask for).

It is one file plus the recipe's role options, touching no other role's class::

    spec = RayClassWithInitArgs(RolloutRecorder, out_dir="runs/x/rollouts", rollout_role=Shared("rollout"))
    grpo.train(cfg, run, extra_roles={"recorder": PooledRole(spec)}, generator="recorder")

``PooledRole`` (`recipes.trainer.roles`) puts it in the rollout role's processes, in either placement (colocated:
beside the actor and its rollout role; disaggregated: on the rollout pool); ``generator`` makes the recipe's
``roles.generate`` call it. Each rank appends to ``<out_dir>/rank<r>.jsonl`` one line per row: the call number,
the row's ``uid``, the decoded prompt and response, and the response's token count. ``meta_info`` gains
``recorder/rows``.
"""

from __future__ import annotations

import json
import os

from controller import Dispatch, Worker, register
from dataproto import DataProto


class RolloutRecorder(Worker):
    def __init__(self, out_dir: str, rollout_role=None):
        if rollout_role is None:
            raise ValueError(
                f"{self.tag}: rollout_role=Shared('rollout') is required (the engine it records)"
            )
        self.out_dir = out_dir
        self.rollout = rollout_role
        self.calls = 0

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)

    @register(Dispatch.DP_SPLIT_PROTO)
    def generate_sequences(self, data: DataProto) -> DataProto:
        out = self.rollout.generate_sequences(data)  # the shared role, in process: its engine and lock
        tok = self.rollout.tokenizer
        b, uids = out.batch, out.non_tensor_batch.get("uid")
        lengths = b["response_mask"].sum(-1).tolist()
        with open(os.path.join(self.out_dir, f"rank{self.rank}.jsonl"), "a", encoding="utf-8") as f:
            for i in range(len(out)):
                row = {
                    "call": self.calls,
                    "uid": None if uids is None else str(uids[i]),
                    "prompt": tok.decode(b["prompts"][i], skip_special_tokens=True),
                    "response": tok.decode(b["responses"][i][: int(lengths[i])], skip_special_tokens=True),
                    "response_tokens": int(lengths[i]),
                }
                f.write(json.dumps(row) + "\n")
        self.calls += 1
        out.meta_info["recorder/rows"] = len(out)  # summed over the ranks (dataproto/metrics_merge.py)
        return out
