"""Dataset reader: chat template + tokenisation, overlong filter, malformed rows, exact resume, SFT."""

import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recipes.data import (
    PromptDataLoader,
    PromptDataset,
    SFTDataset,
    collate_prompts,
    render_prompt,
    to_dataproto,
)
from recipes.tasks import make_dataset
from workers.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", size="nano", seed=0)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    return make_dataset("arithmetic", tmp_path_factory.mktemp("data"), n_train=100, n_val=20, seed=0)


def _row(content, gt="1", ds="hyflow/arithmetic", solution="1. The answer is \\boxed{1}."):
    return {
        "data_source": ds,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"ground_truth": gt, "style": "rule"},
        "extra_info": {"split": "train", "index": 0, "solution": solution},
    }


def test_prompts_tokenised_with_chat_template(tokenizer, arith):
    ds = PromptDataset(arith["train"], tokenizer, max_prompt_length=64)
    assert len(ds) == 100 and ds.num_filtered_overlong == 0 and ds.num_malformed == 0
    item = ds[0]
    text = tokenizer.decode(item["input_ids"])
    assert text.startswith("<|im_start|>user\nCompute ") and text.endswith("<|im_start|>assistant\n")
    assert text == render_prompt(tokenizer, item["raw_prompt"])
    assert item["data_source"] == "hyflow/arithmetic" and "ground_truth" in item["reward_model"]


def test_overlong_prompts_filtered_with_count(tokenizer, tmp_path, caplog):
    rows = [_row("Compute 1+2.")] * 5 + [_row("Compute " + "+".join(["1"] * 100) + ".")] * 3
    path = tmp_path / "long.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with caplog.at_level(logging.WARNING, logger="recipes.data"):
        ds = PromptDataset(path, tokenizer, max_prompt_length=40)
    assert len(ds) == 5 and ds.num_filtered_overlong == 3
    assert "filtered 3 of 8 prompts longer than max_prompt_length=40" in caplog.text
    with pytest.raises(ValueError, match="more than max_prompt_length"):
        PromptDataset(path, tokenizer, max_prompt_length=40, overlong="error")


def test_malformed_rows_skipped_naming_row_and_file(tokenizer, tmp_path, caplog):
    good = _row("Compute 1+2.")
    rows = [
        good,
        {**good, "prompt": []},  # row 1: empty prompt
        {**good, "prompt": [{"role": "user", "content": "   "}]},  # row 2: only whitespace
        good,
        {**good, "prompt": None},  # row 4: missing
        {**good, "reward_model": {"ground_truth": None, "style": "rule"}},  # row 5: no ground truth
        {**good, "data_source": ""},  # row 6
        good,
    ]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with caplog.at_level(logging.WARNING, logger="recipes.data"):
        ds = PromptDataset(str(path), tokenizer, max_prompt_length=64)
    assert len(ds) == 3 and ds.num_malformed == 5
    for i, why in [
        (1, "empty list"),
        (2, "only empty"),
        (4, "missing"),
        (5, "ground_truth"),
        (6, "data_source"),
    ]:
        assert f"skipping row {i} of {path}: " in caplog.text
        assert why in [r.getMessage() for r in caplog.records if f"row {i} of" in r.getMessage()][0]
    assert "row 0 of" not in caplog.text and "row 3 of" not in caplog.text
    # without requiring a ground truth, row 5 is fine
    assert len(PromptDataset(str(path), tokenizer, require_ground_truth=False)) == 4


def test_batch_layout(tokenizer, arith):
    ds = PromptDataset(arith["train"], tokenizer, max_prompt_length=64)
    batch = next(iter(PromptDataLoader(ds, batch_size=8, seed=0)))
    t, nt = batch["tensors"], batch["non_tensors"]
    ids, mask, pos = t["input_ids"], t["attention_mask"], t["position_ids"]
    assert ids.shape == mask.shape == pos.shape and ids.shape[0] == 8 and ids.dtype == torch.long
    assert mask.dtype == torch.long and pos.dtype == torch.long
    assert torch.equal(pos, (mask.cumsum(-1) - 1).clamp(min=0))
    assert (mask[:, -1] == 1).all()  # left padded: every prompt ends in the last column
    assert (ids[mask == 0] == tokenizer.pad_token_id).all()
    assert mask.sum(1).max() == ids.shape[1]  # padded to the longest prompt in the batch
    for key in ("data_source", "reward_model", "extra_info", "raw_prompt", "uid"):
        assert isinstance(nt[key], np.ndarray) and nt[key].dtype == object and nt[key].shape == (8,)
    assert isinstance(nt["raw_prompt"][0], list) and isinstance(nt["reward_model"][0], dict)
    assert len(set(nt["uid"])) == 8
    # each row decodes to its raw prompt
    for i in range(8):
        text = tokenizer.decode(ids[i][mask[i].bool()])
        assert text == render_prompt(tokenizer, nt["raw_prompt"][i])
    padded = collate_prompts([ds[0], ds[1]], tokenizer.pad_token_id, pad_to=64)
    assert padded["tensors"]["input_ids"].shape == (2, 64)


def _same(a, b):
    assert a["tensors"].keys() == b["tensors"].keys()
    for k in a["tensors"]:
        assert torch.equal(a["tensors"][k], b["tensors"][k])
    for k in a["non_tensors"]:
        assert list(a["non_tensors"][k]) == list(b["non_tensors"][k])


def test_resume_gives_identical_next_batch(tokenizer, arith):
    ds = PromptDataset(arith["train"], tokenizer, max_prompt_length=64)
    loader = PromptDataLoader(ds, batch_size=16, seed=7)
    assert len(loader) == 6
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    assert (state["epoch"], state["index"]) == (0, 4)
    rest = list(it) + list(loader)  # rest of epoch 0, then all of epoch 1
    fresh = PromptDataLoader(ds, batch_size=16, seed=7)
    fresh.load_state_dict(state)
    again = list(fresh) + list(fresh)
    assert len(rest) == len(again) == 2 + 6
    for a, b in zip(rest, again):
        _same(a, b)
    # epochs are shuffled differently; different seeds differ
    e0 = [b["non_tensors"]["uid"][0] for b in rest[2:]]
    assert loader.state_dict()["epoch"] == 2
    other = PromptDataLoader(ds, batch_size=16, seed=8)
    assert [list(b["non_tensors"]["raw_prompt"]) for b in other] != [
        list(b["non_tensors"]["raw_prompt"]) for b in rest[2:]
    ]
    assert len(set(e0)) == 6
    # a state from a different data setup cannot be loaded
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_end_of_epoch_state(tokenizer, arith):
    ds = PromptDataset(arith["train"], tokenizer, max_prompt_length=64)
    loader = PromptDataLoader(ds, batch_size=50, seed=0)
    batches = []
    for b in loader:
        batches.append(b)
        state = loader.state_dict()
    assert (state["epoch"], state["index"]) == (0, 2)  # saved after the last batch of epoch 0
    fresh = PromptDataLoader(ds, batch_size=50, seed=0)
    fresh.load_state_dict(state)
    assert list(fresh) == []  # nothing left of epoch 0 ...
    nxt = next(iter(fresh))  # ... and then epoch 1 begins
    ref = PromptDataLoader(ds, batch_size=50, seed=0)
    ref.load_state_dict({"epoch": 1, "index": 0})
    _same(nxt, next(iter(ref)))
    assert fresh.state_dict()["epoch"] == 1 and fresh.state_dict()["index"] == 1
    assert list(nxt["non_tensors"]["uid"]) != list(batches[0]["non_tensors"]["uid"])


def test_to_dataproto(tokenizer, arith):
    ds = PromptDataset(arith["val"], tokenizer, max_prompt_length=64)
    batch = next(iter(PromptDataLoader(ds, batch_size=4, seed=0)))
    data = to_dataproto(batch)
    assert torch.equal(data.batch["input_ids"], batch["tensors"]["input_ids"])
    assert list(data.non_tensor_batch["uid"]) == list(batch["non_tensors"]["uid"])


def test_sft_dataset_masks_prompt(tokenizer, arith, tmp_path, caplog):
    """SFT pairs in the rollout layout (``collate_sft_layout``, through the rollout batch builder): the prompt as
    RL renders it, left-padded; the solution + EOS as the response, right-padded, and the loss on it alone."""
    from recipes.trainer.data import collate_sft_layout

    sft = SFTDataset(arith["train"], tokenizer, max_length=128)
    assert len(sft) == 100
    batch = collate_sft_layout([sft[i] for i in range(4)], tokenizer.pad_token_id).batch
    prompts, responses, rmask = batch["prompts"], batch["responses"], batch["response_mask"]
    ids, mask, P = batch["input_ids"], batch["attention_mask"], batch["prompts"].shape[1]
    assert torch.equal(ids, torch.cat([prompts, responses], 1)) and (mask[:, P - 1] == 1).all()  # left padded
    assert (rmask[:, 0] == 1).all() and torch.equal(rmask, mask[:, P:].float())  # right padded
    for i in range(4):
        prompt = tokenizer.decode(prompts[i][mask[i, :P].bool()])
        resp = tokenizer.decode(responses[i][rmask[i].bool()])
        assert prompt.startswith("<|im_start|>user\nCompute ") and prompt.endswith("assistant\n")
        assert "\\boxed{" in resp and resp.endswith("<|im_end|>")
        assert (prompt, resp) == (tokenizer.decode(sft[i][0]), tokenizer.decode(sft[i][1]))
    # rows without a solution are skipped naming the row; overlong examples are counted
    rows = [_row("Compute 1+2."), _row("Compute 1+2.", solution=""), _row("Compute " + "1+" * 60 + "1.")]
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with caplog.at_level(logging.WARNING, logger="recipes.data"):
        small = SFTDataset(path, tokenizer, max_length=64)
    assert len(small) == 1 and small.num_malformed == 1 and small.num_filtered_overlong == 1
    assert f"skipping row 1 of {path}: extra_info.solution is missing or empty" in caplog.text
    # the HF loss on labels (the response tokens, -100 elsewhere) equals the response_mask-weighted token loss:
    # the layout's position_ids and mask are what a HF forward over left padding needs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tokenizer.name_or_path)
    lm = torch.cat([torch.zeros_like(prompts, dtype=torch.float32), rmask], 1)
    labels = torch.where(lm.bool(), ids, torch.full_like(ids, -100))
    out = model(input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"], labels=labels)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    manual = -(logp * lm[:, 1:]).sum() / lm[:, 1:].sum()
    assert torch.allclose(out.loss, manual, atol=1e-5)
