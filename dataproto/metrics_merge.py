"""One ``meta_info`` from the per-rank chunks of a group call: each metric merged by a rule its name decides.

`DataProto.concat` keeps the first chunk's ``meta_info``, so a group call's metrics would be rank 0's chunk
alone. The controller's collect path (``controller.dispatch.concat_chunks``) instead calls `merge_meta_info`.

Metrics are the numeric (int or float, not bool) values of ``meta_info["metrics"]``, and the numeric top-level
entries whose key holds a ``/`` (``timing_s/gen``, ``rollout/generated_tokens``): the entries
``recipes.trainer.metrics_of`` reads. The first rule that matches the name (split at ``/`` into segments) wins:

1. ``timing_s/*``: the **max** (ranks run side by side; the slowest one is the wall time).
2. a segment ``max``, ``max_*`` or ``*_max``: the **max** (``env/turns/max``, ``perf/max_memory_allocated_gib/gen``);
   ``min``, ``min_*`` or ``*_min``: the **min**.
3. a last segment that is an average or a rate (the word ``mean``, ``ratio``, ``rate`` or ``per`` between
   ``_``'s, or ``frac`` anywhere): the **mean weighted by each chunk's rows** (``env/turns/mean``,
   ``env/finished_frac``, ``rollout/tokens_per_s``: a rate stays one rank's, averaged).
4. a count of the chunk's own work: a last segment ``num_*``, ``*_count``, ``*_tokens``, ``errors``,
   ``*_errors``, ``timeouts``, ``rows``, ``rows_with_*``, ``dropped_*``, or one under ``status/``: the **sum**
   (``rollout/generated_tokens``, ``env/num_roots``, ``env/status/finished``, ``reward/errors``).
5. anything else: the weighted mean (losses, ``*/lr``, ``*/grad_norm``, ``actor/skipped_steps``: values every
   training rank shares, or per-rank averages). Name a new count by rule 4 to have it summed.

The weighted mean is ``sum(rows_r * value_r) / sum(rows_r)`` over the chunks that carry the metric, so a rank
with no rows (a split call's placeholder chunk) does not count; when none of them has rows (a training call
returns metrics only), the plain mean. A metric some chunks lack (``env/depth_2/*`` where only one rank's trees
were that deep) is merged over the chunks that carry it. A mean of equal values is that value, unrounded; sums,
maxima and minima of ints stay ints.

Every other entry (``eos_token_id``, ``pad_token_id``, ``temperature``, ``n``, message lists, and a metric name
with a non-numeric value on some chunk) keeps the first chunk's value, as `DataProto.concat` does: no check that
the ranks agree.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

METRICS_KEY = "metrics"

SUM, MEAN, MAX, MIN = "sum", "mean", "max", "min"

# whole words of a segment ("_"-separated): "rate" is not the one inside "generated"
_MAX = re.compile(r"^(max|max_.*|.*_max)$")
_MIN = re.compile(r"^(min|min_.*|.*_min)$")
_MEAN = re.compile(r"(^|_)(mean|ratio|rate|per)(_|$)|frac")
_COUNT = re.compile(r"^(num_.*|.*_count|.*_tokens|errors|.*_errors|timeouts|rows|rows_with_.*|dropped_.*)$")


def merge_rule(name: str) -> str:
    """How the metric ``name`` merges across ranks: ``"sum"``, ``"mean"`` (weighted by rows), ``"max"`` or
    ``"min"`` (module docstring, rules 1-5)."""
    segments = name.split("/")
    if segments[0] == "timing_s":
        return MAX
    if any(_MAX.match(s) for s in segments):
        return MAX
    if any(_MIN.match(s) for s in segments):
        return MIN
    last = segments[-1]
    if _MEAN.search(last):
        return MEAN
    if _COUNT.match(last) or (len(segments) > 1 and segments[-2] == "status"):
        return SUM
    return MEAN


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def merge_metric(name: str, values: Sequence[int | float], rows: Sequence[int]) -> int | float:
    """One metric's per-chunk ``values`` (chunks of ``rows`` rows each) merged by `merge_rule`."""
    rule = merge_rule(name)
    if rule == SUM:
        return sum(values)
    if rule == MAX:
        return max(values)
    if rule == MIN:
        return min(values)
    if all(v == values[0] for v in values[1:]):  # what every training rank shares comes back exactly
        return values[0]
    total = sum(rows)
    if total == 0:
        return math.fsum(values) / len(values)
    return math.fsum(w * v for w, v in zip(rows, values)) / total


def _merge_entries(dicts: Sequence[Mapping[str, Any]], rows: Sequence[int], is_metric) -> dict[str, Any]:
    """Keys in first-seen order; a metric merged over the chunks that carry it, any other key the first."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for d in dicts for k in d):
        present = [(d[key], n) for d, n in zip(dicts, rows) if key in d]
        values = [v for v, _ in present]
        if is_metric(key) and all(_is_number(v) for v in values):
            out[key] = merge_metric(key, values, [n for _, n in present])
        else:
            out[key] = values[0]
    return out


def merge_meta_info(metas: Sequence[Mapping[str, Any]], rows: Sequence[int]) -> dict[str, Any]:
    """The ``meta_info`` of the concatenation of chunks whose ``meta_info`` are ``metas`` and whose row counts
    are ``rows`` (module docstring). One chunk: a copy of its ``meta_info``."""
    if len(metas) != len(rows):
        raise ValueError(f"merge_meta_info: {len(metas)} meta_info dicts but {len(rows)} row counts")
    if not metas:
        raise ValueError("merge_meta_info needs at least one meta_info")
    if len(metas) == 1:
        return dict(metas[0])
    out = _merge_entries(metas, rows, lambda key: "/" in key)
    with_metrics = [
        (m[METRICS_KEY], n) for m, n in zip(metas, rows) if isinstance(m.get(METRICS_KEY), Mapping)
    ]
    if METRICS_KEY in out and len(with_metrics) == sum(METRICS_KEY in m for m in metas):
        out[METRICS_KEY] = _merge_entries(
            [d for d, _ in with_metrics], [n for _, n in with_metrics], lambda key: True
        )
    return out
