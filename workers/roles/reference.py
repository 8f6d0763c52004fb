"""RefWorker: the frozen reference policy's log-probs (for the KL loss or the in-reward KL penalty).

A forward-only engine (no optimizer, parameters frozen), FSDP2-sharded over the group when it has more than one
rank. Usually colocated with the actor in the same processes (``create_colocated_worker_cls``); the two hold
separate engines, and the reference never changes.

``compute_teacher_log_prob`` makes the reference a hint-conditioned teacher (hindsight on-policy distillation,
``algorithms/hybrid.py``): the log-probs of the policy's own response tokens under [prompt + hint + response],
aligned token for token with ``responses`` (`build_teacher_inputs`).

Both methods are module functions that a LoRA actor binds too: its frozen base is the reference.
"""

from __future__ import annotations

import torch

from controller import Dispatch, Inputs, register
from dataproto import DataProto
from workers.config import ModelConfig, RolloutConfig
from workers.engine.moe_forward import ROLLOUT_ROUTES
from workers.roles.common import (
    FORWARD_KEYS,
    EngineRoleWorker,
    engine_config,
    log_prob_settings,
)


def build_teacher_inputs(
    prompts: torch.Tensor,
    responses: torch.Tensor,
    attention_mask: torch.Tensor,
    hint_ids: list[list[int]],
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """The engine batch of [prompt + hint + response] per row, the response tokens unchanged.

    ``prompts`` [B, P] are left-padded (their real tokens are the ones ``attention_mask[:, :P]`` marks) and
    ``responses`` [B, R] right-padded. Row b's hint tokens go right after its real prompt tokens; the new
    prompt block is left-padded to P' = P + the longest hint, so response token j sits at column P' + j and
    the engine's log-probs come back [B, R] aligned with ``responses``. With every hint empty the batch is
    the input's, token for token (the teacher is then exactly the reference)."""
    B, P = prompts.shape
    if len(hint_ids) != B:
        raise ValueError(f"{len(hint_ids)} hints for {B} rows")
    H = max((len(h) for h in hint_ids), default=0)
    if H == 0:
        return {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "responses": responses,
        }
    new_prompts = torch.full((B, P + H), pad_token_id, dtype=prompts.dtype)
    new_mask = torch.zeros((B, P + H), dtype=attention_mask.dtype)
    for b in range(B):
        real = prompts[b][attention_mask[b, :P].bool()]
        row = torch.cat([real, torch.as_tensor(hint_ids[b], dtype=prompts.dtype)])
        new_prompts[b, P + H - len(row) :] = row
        new_mask[b, P + H - len(row) :] = 1
    return {
        "input_ids": torch.cat([new_prompts, responses], dim=1),
        "attention_mask": torch.cat([new_mask, attention_mask[:, P:]], dim=1),
        "responses": responses,
    }


# The reference's two methods, shared by the roles that can compute the frozen reference: `RefWorker` (a
# forward-only engine of its own) and, with LoRA, `ActorWorker` (its base model, adapters disabled: no copy of
# the model is loaded). Each role binds them as its own methods; its ``_reference_log_probs`` runs the forward.


@register(Dispatch.DP_COMPUTE_PROTO, inputs=Inputs(batch=FORWARD_KEYS, optional=(ROLLOUT_ROUTES,)))
def compute_ref_log_prob(self: EngineRoleWorker, data: DataProto) -> DataProto:
    """``ref_log_prob`` [B, R] of the responses at ``meta_info["temperature"]`` (default rollout.temperature, the
    same temperature the actor's log-probs use); micro-batching from rollout.log_prob_*. A mixture of experts
    replays the rollout's routes with ``actor.moe.reference_replay`` (the role's ``reference_replay``)."""
    temperature, micro = log_prob_settings(self.tag, self.rollout_config, data.meta_info)
    replay = ROLLOUT_ROUTES if self.reference_replay else None
    lp = self._reference_log_probs("compute_ref_log_prob", data.batch, temperature, micro, replay)
    return DataProto.from_dict({"ref_log_prob": lp}, meta_info={"temperature": temperature})


@register(
    Dispatch.DP_COMPUTE_PROTO,
    inputs=Inputs(batch=("prompts", "responses", "attention_mask"), optional=("teacher_hint",)),
)
def compute_teacher_log_prob(self: EngineRoleWorker, data: DataProto) -> DataProto:
    """``teacher_log_prob`` [B, R]: log-probs of ``responses`` under [prompt + hint + response], where the hint
    of row b is ``non_tensor_batch["teacher_hint"][b]`` (text, tokenised as is; "" or a missing column: no
    hint, the ordinary reference log-prob). Needs ``prompts``, ``responses``, ``attention_mask``; temperature
    and micro-batching as ``compute_ref_log_prob``."""
    temperature, micro = log_prob_settings(self.tag, self.rollout_config, data.meta_info)
    hints = data.non_tensor_batch.get("teacher_hint")
    texts = ["" if h is None else str(h) for h in hints] if hints is not None else [""] * len(data)
    tokenizer = self.tokenizer
    if tokenizer is None:
        raise RuntimeError(f"{self.tag}: compute_teacher_log_prob called before init_model()")
    hint_ids = [list(tokenizer.encode(t, add_special_tokens=False)) if t else [] for t in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    b = data.batch
    inputs = build_teacher_inputs(b["prompts"], b["responses"], b["attention_mask"], hint_ids, pad)
    lp = self._reference_log_probs("compute_teacher_log_prob", inputs, temperature, micro)
    n_hint = sum(bool(h) for h in hint_ids)
    return DataProto.from_dict(
        {"teacher_log_prob": lp},
        meta_info={
            "temperature": temperature,
            "metrics": {
                "teacher/hint_tokens/mean": sum(map(len, hint_ids)) / max(n_hint, 1),
                "teacher/rows_with_hint": float(n_hint),
            },
        },
    )


class RefWorker(EngineRoleWorker):
    compute_ref_log_prob = compute_ref_log_prob
    compute_teacher_log_prob = compute_teacher_log_prob

    def __init__(self, model: ModelConfig, rollout: RolloutConfig, reference_replay: bool = False):
        self.model_config = model
        self.rollout_config = rollout
        self.reference_replay = reference_replay

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self._init_engine(engine_config(self.model_config, optim=None))
