"""``DataProto.union`` combines the ``meta_info["metrics"]`` of the outputs merged into a batch (each worker call
reports its own), while any other meta_info key must still agree."""

import pytest
import torch

from dataproto import DataProto


def test_union_combines_metrics_and_still_rejects_other_conflicts():
    batch = DataProto.from_dict(
        {"x": torch.zeros(2)}, meta_info={"temperature": 1.0, "metrics": {"env/a": 1.0}}
    )
    batch = batch.union(
        DataProto.from_dict({"score": torch.ones(2)}, meta_info={"metrics": {"reward/errors": 0}})
    )
    batch = batch.union(DataProto(meta_info={"metrics": {"actor/loss": 0.5, "env/a": 2.0}}))  # an update's
    assert batch.meta_info["metrics"] == {"env/a": 2.0, "reward/errors": 0, "actor/loss": 0.5}
    assert set(batch.batch.keys()) == {"x", "score"}
    with pytest.raises(ValueError, match="temperature"):
        batch.union(DataProto(meta_info={"temperature": 0.5}))
