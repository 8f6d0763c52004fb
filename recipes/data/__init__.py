"""Datasets for RL prompts and SFT warm-start, read from verl-format parquet files.

RL prompts::

    ds = PromptDataset(["data/arith/train.parquet"], tokenizer, max_prompt_length=128)
    loader = PromptDataLoader(ds, batch_size=16, seed=0)        # shuffled per epoch, resumable
    for batch in loader:                                         # the rest of the current epoch
        data = to_dataproto(batch)                               # or use batch["tensors"] etc.
        ...
        ckpt["data"] = loader.state_dict()                       # {"epoch", "index", ...}
    loader.load_state_dict(ckpt["data"])                         # the same next batch as before

SFT warm start (prompt + ``extra_info["solution"]``, loss on the solution tokens only): ``SFTDataset`` holds the
(prompt ids, solution ids + EOS) pairs; ``recipes.trainer.data.sft_loader`` batches them in the rollout layout that
``ActorWorker.sft_step`` trains on (``collate_sft_layout``).
"""

from recipes.data.loader import ResumableLoader
from recipes.data.prompts import PromptDataLoader, PromptDataset, collate_prompts, to_dataproto
from recipes.data.reading import read_rows, render_prompt
from recipes.data.sft import SFTDataset

__all__ = [
    "PromptDataLoader",
    "PromptDataset",
    "ResumableLoader",
    "SFTDataset",
    "collate_prompts",
    "read_rows",
    "render_prompt",
    "to_dataproto",
]
