"""The batch type that crosses process boundaries (see dataproto/BATCH_LAYOUT.md for shared keys)."""

from dataproto.layout import position_ids
from dataproto.metrics_merge import merge_meta_info, merge_rule
from dataproto.proto import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto

__all__ = [
    "DataProto",
    "DataProtoItem",
    "merge_meta_info",
    "merge_rule",
    "pad_dataproto_to_divisor",
    "position_ids",
    "unpad_dataproto",
]
