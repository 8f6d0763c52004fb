"""Weight sync utilities: size-bounded buckets, flattened transport buffers, HF name mapping."""

from workers.weight_sync.buckets import (
    ALIGN_BYTES,
    FlatBucket,
    TensorMeta,
    broadcast_bucket,
    bucket_mb_to_bytes,
    flatten_bucket,
    hf_named_tensors,
    iter_buckets,
    strip_wrapper_prefixes,
    tensor_nbytes,
    unflatten_bucket,
)

__all__ = [
    "ALIGN_BYTES",
    "FlatBucket",
    "TensorMeta",
    "broadcast_bucket",
    "bucket_mb_to_bytes",
    "flatten_bucket",
    "hf_named_tensors",
    "iter_buckets",
    "strip_wrapper_prefixes",
    "tensor_nbytes",
    "unflatten_bucket",
]
