"""Model and tokenizer loading from local Hugging Face directories (see `loading.py`)."""

from workers.models.loading import (
    ValueHeadModel,
    check_model_dir,
    ensure_pad_token,
    is_value_model,
    load_config,
    load_model,
    load_tokenizer,
    pad_token_id_of,
    resolve_dtype,
)

__all__ = [
    "ValueHeadModel",
    "check_model_dir",
    "ensure_pad_token",
    "is_value_model",
    "load_config",
    "load_model",
    "load_tokenizer",
    "pad_token_id_of",
    "resolve_dtype",
]
