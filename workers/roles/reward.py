"""RewardWorker: rule-based outcome rewards -- decode each response, score it by data source, put the score on
the last valid response token.

Scorers come from `workers.reward` (registered by ``data_source``; ``reward.default_scorer`` covers sources
without one). A scorer that raises, or a row without ``reward_model["ground_truth"]``, fails only that row:
its score is 0, ``non_tensor_batch["reward_error"]`` holds the message, and the errors are counted in
``meta_info["metrics"]["reward/errors"]`` (the first messages in ``meta_info["reward_error_messages"]``). A data
source with no scorer and no default is a configuration error and fails the call. A custom reward function
(``custom_path`` / ``custom_name``: verl's ``custom_reward_function``) scores every data source instead.

With a group of several ranks ``reward/errors`` is summed over the ranks (``dataproto/metrics_merge.py``) and
``reward_error_messages`` is rank 0's; the per-row ``reward_error`` column covers every row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from controller import Dispatch, Inputs, Worker, register
from dataproto import DataProto
from workers.config import RewardConfig
from workers.models import load_tokenizer
from workers.reward import load_custom_scorer, score_batch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_ERROR_MESSAGES = 5
# `responses` and the row's source and ground truth; the valid length from attention_mask (else response_mask);
# `answer`: an RLM trajectory's final answer, scored instead of the decoded responses.
RM_SCORE_INPUTS = Inputs(
    batch=("responses",),
    non_tensor=("data_source", "reward_model"),
    optional=("attention_mask", "response_mask", "extra_info", "answer", "data_row"),
)


class RewardWorker(Worker):
    def __init__(
        self,
        model_path_or_tokenizer_path: str,
        reward: RewardConfig,
        custom_path: str | None = None,
        custom_name: str = "compute_score",
    ):
        self.tokenizer_path = str(model_path_or_tokenizer_path)
        self.reward_config = reward
        self.custom_scorer = load_custom_scorer(custom_path, custom_name) if custom_path else None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        if reward.reward_manager != "outcome":
            raise ValueError(
                f"{self.tag}: reward.reward_manager={reward.reward_manager!r} is not supported; "
                "this worker implements 'outcome' (score on the last response token)"
            )

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the tokenizer (also done on first use)."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_path)

    def _valid_lengths(self, data: DataProto) -> torch.Tensor:
        """Valid response length per row: response tokens with attention, else up to the last response_mask 1."""
        responses = data.batch["responses"]
        r = responses.shape[1]
        if "attention_mask" in data.batch:
            return data.batch["attention_mask"][:, -r:].sum(dim=1).long()
        if "response_mask" in data.batch:
            nz = (data.batch["response_mask"] != 0).long()
            positions = torch.arange(1, r + 1).expand_as(nz)
            return (nz * positions).max(dim=1).values
        raise KeyError(
            f"{self.tag}: compute_rm_score needs batch key 'attention_mask' (or 'response_mask') to find each "
            f"response's length; the batch has {sorted(data.batch)}"
        )

    @register(Dispatch.DP_COMPUTE_PROTO, inputs=RM_SCORE_INPUTS)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``token_level_scores`` [B, R] float32 (the row's score on its last valid response token, on token 0
        for an empty response), ``non_tensor_batch["response_text"]`` (the decoded responses, or the RLM
        final answers when the batch has an ``answer`` column) and
        ``["reward_error"]`` ("" or the row's error)."""
        self.init_model()
        responses = data.batch["responses"]
        lengths = self._valid_lengths(data)
        sources = data.non_tensor_batch["data_source"]
        reward_models = data.non_tensor_batch["reward_model"]
        extra_infos = data.non_tensor_batch.get("extra_info")
        if "answer" in data.non_tensor_batch:
            # RLM trajectories: `responses` is the whole multi-turn transcript; the scored text is the
            # agent's final answer (None when it never called FINAL, which scores as an empty answer).
            texts = ["" if a is None else str(a) for a in data.non_tensor_batch["answer"]]
        else:
            assert self.tokenizer is not None  # init_model loaded it
            texts = self.tokenizer.batch_decode(
                [responses[i, : int(lengths[i])].tolist() for i in range(len(data))], skip_special_tokens=True
            )

        # errors name the prompt's file row when the data loader recorded it, else the batch row
        where = data.non_tensor_batch.get("data_row", [f"row {i}" for i in range(len(data))])
        scores = torch.zeros(len(data), dtype=torch.float32)
        row_errors = [""] * len(data)
        for i, (text, source, rm) in enumerate(zip(texts, sources, reward_models)):
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                row_errors[i] = f"{where[i]} ({source}): reward_model has no 'ground_truth' (got {rm!r})"
                continue
            extra = extra_infos[i] if extra_infos is not None else None
            try:
                result = score_batch(
                    [text],
                    [source],
                    [rm["ground_truth"]],
                    [extra],
                    self.reward_config.default_scorer,
                    custom=self.custom_scorer,
                )
            except KeyError as err:  # no scorer for this data source: a configuration error
                raise KeyError(f"{self.tag}: compute_rm_score {where[i]}: {err.args[0]}") from None
            scores[i] = result.scores[0]
            if result.errors:
                row_errors[i] = f"{where[i]} " + result.error_messages[0].removeprefix("row 0 ")

        token_level_scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = (lengths - 1).clamp(min=0)
        token_level_scores[torch.arange(len(data)), last] = scores
        messages = [e for e in row_errors if e]
        return DataProto.from_dict(
            {"token_level_scores": token_level_scores},
            non_tensors={"response_text": list(texts), "reward_error": row_errors},
            meta_info={
                "metrics": {"reward/errors": float(len(messages))},
                "reward_error_messages": messages[:MAX_ERROR_MESSAGES],
            },
        )
