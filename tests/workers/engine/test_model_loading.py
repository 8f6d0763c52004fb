"""workers/models/loading.py: local-only loading, clear errors, dtype, value heads, pad-token handling."""

from __future__ import annotations

import engine_testlib as T
import pytest
import torch
from transformers import AutoModel, PreTrainedTokenizerFast

from workers.models import (
    ValueHeadModel,
    is_value_model,
    load_model,
    load_tokenizer,
    pad_token_id_of,
    resolve_dtype,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/workers/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return T.make_model_dir(tmp_path_factory.mktemp("tiny_qwen2_load"))


def _save_tokenizer(path, with_pad: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_model = Tokenizer(models.WordLevel({f"w{i}": i for i in range(T.VOCAB)}, unk_token="w3"))
    tok_model.pre_tokenizer = pre_tokenizers.Whitespace()
    kw = {"pad_token": "w0"} if with_pad else {}
    PreTrainedTokenizerFast(tokenizer_object=tok_model, eos_token="w1", **kw).save_pretrained(path)
    return str(path)


def test_missing_path_and_missing_config_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json .*empty/config\.json"):
        load_model(empty)
    (empty / "config.json").write_text(T.tiny_config().to_json_string())
    with pytest.raises(FileNotFoundError, match=r"has no weights"):
        load_model(empty)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(missing)


def test_causal_lm_dtype_and_attention(model_dir):
    m = load_model(model_dir, dtype="bf16")
    assert type(m).__name__ == "Qwen2ForCausalLM" and next(m.parameters()).dtype == torch.bfloat16
    assert not is_value_model(m)
    m = load_model(model_dir, attn_implementation="hyflow_varlen")
    assert m.config._attn_implementation == "hyflow_varlen"
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8")


def test_value_head_models(model_dir):
    torch.manual_seed(0)
    critic = load_model(model_dir, value_head=True)
    assert type(critic).__name__ == "Qwen2ForTokenClassification" and is_value_model(critic)
    assert critic.config.num_labels == 1 and critic.dropout.p == 0.0
    ids = torch.randint(3, T.VOCAB, (2, 5))
    assert critic(ids).logits.shape == (2, 5, 1)
    # the generic wrapper, for architectures without *ForTokenClassification
    wrapped = ValueHeadModel(AutoModel.from_pretrained(model_dir, local_files_only=True))
    assert is_value_model(wrapped) and wrapped(ids).logits.shape == (2, 5, 1)
    # same base weights as the causal LM
    lm = load_model(model_dir)
    torch.testing.assert_close(critic.model.embed_tokens.weight, lm.model.embed_tokens.weight)


def test_tokenizer_pad_token_and_padding_side(tmp_path):
    tok = load_tokenizer(_save_tokenizer(tmp_path / "nopad", with_pad=False))
    assert tok.pad_token == tok.eos_token == "w1" and tok.padding_side == "left"
    assert pad_token_id_of(tok) == 1
    tok = load_tokenizer(_save_tokenizer(tmp_path / "pad", with_pad=True), padding_side="right")
    assert tok.pad_token_id == 0 and tok.padding_side == "right"
    assert pad_token_id_of(None, T.tiny_config()) == T.PAD
