"""Weight sync: size-bounded buckets, flattened transport buffers, HF name mapping, the standalone
trainer -> rollout weight-sync process group, the 3D reshard, and `WeightSync` (the controller-side driver
of all of them: colocated, resharded and disaggregated strategies)."""

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
from workers.weight_sync.sync import STRATEGIES, WeightSync, WeightSyncLink
from workers.weight_sync.sync_group import (
    DEFAULT_GROUP_NAME,
    WeightSyncGroup,
    WeightSyncMemberships,
    host_store,
    stream_metrics,
)

__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_GROUP_NAME",
    "STRATEGIES",
    "FlatBucket",
    "TensorMeta",
    "WeightSync",
    "WeightSyncGroup",
    "WeightSyncLink",
    "WeightSyncMemberships",
    "broadcast_bucket",
    "bucket_mb_to_bytes",
    "flatten_bucket",
    "hf_named_tensors",
    "host_store",
    "iter_buckets",
    "stream_metrics",
    "strip_wrapper_prefixes",
    "tensor_nbytes",
    "unflatten_bucket",
]
