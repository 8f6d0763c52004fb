"""Weight sync utilities: size-bounded buckets, flattened transport buffers, HF name mapping, and the
standalone trainer -> rollout weight-sync process group."""

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
from workers.weight_sync.sync_group import DEFAULT_GROUP_NAME, WeightSyncGroup, host_store

__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_GROUP_NAME",
    "FlatBucket",
    "TensorMeta",
    "WeightSyncGroup",
    "broadcast_bucket",
    "bucket_mb_to_bytes",
    "flatten_bucket",
    "hf_named_tensors",
    "host_store",
    "iter_buckets",
    "strip_wrapper_prefixes",
    "tensor_nbytes",
    "unflatten_bucket",
]
