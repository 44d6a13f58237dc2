"""A histogram of durations, counted into fixed buckets: what ``status`` shows as
``close_to_durable_s`` and the metrics export as ``acpfs_close_to_durable_seconds``.

The flusher owns the one instance (``Flusher.close_to_durable``) and observes under the op
log's lock; ``as_dict`` is read under the same lock. The bucket bounds are in config.py.
"""

from __future__ import annotations

import bisect
from typing import Any

from ..config import CLOSE_TO_DURABLE_BUCKETS


class Histogram:
    """Counts of observed values per bucket (``le`` bounds, ascending), their number and sum."""

    def __init__(self, bounds: tuple[float, ...] = CLOSE_TO_DURABLE_BUCKETS) -> None:
        assert list(bounds) == sorted(bounds), bounds
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)   # the last: above every bound
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        value = max(0.0, value)
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def as_dict(self) -> dict[str, Any]:
        """``count``, ``sum`` and ``buckets``: [upper bound, observations at most that],
        cumulative as Prometheus counts them; the +Inf bucket is ``count``."""
        buckets, total = [], 0
        for bound, n in zip(self.bounds, self._counts):
            total += n
            buckets.append([bound, total])
        return {"count": self.count, "sum": round(self.sum, 6), "buckets": buckets}
