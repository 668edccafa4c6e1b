"""A histogram the engine fills as it runs and the server's ``/metrics`` reads (phase 2).

Prometheus' histogram is a count per bucket (observations ``<=`` each upper bound, plus one
bucket past the last) and the sum of the values. The engine thread records into plain lists
(:class:`BucketCounts`: no lock, no dependency on prometheus_client, which the offline engine
does not need); the server turns them into a Prometheus family at scrape time
(``infer.server.metrics``), the way :class:`~infer.engine.scheduler.Scheduler` already exposes
its prefill statistics.
"""

from __future__ import annotations

import bisect


class BucketCounts:
    """Counts of observed values per bucket of ``bounds`` (increasing upper bounds, inclusive).

    Attributes:
        counts: ``len(bounds) + 1`` counts; ``counts[i]`` holds the values in
            ``(bounds[i - 1], bounds[i]]``, the last one those above ``bounds[-1]``.
        sum: the sum of every observed value (each counted as often as it was observed).
    """

    def __init__(self, bounds) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Count ``value`` ``times`` times (one ``bisect`` whatever ``times`` is)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of values <= le)`` per bucket, ``"+Inf"`` last: the shape of
        ``prometheus_client``'s ``HistogramMetricFamily(buckets=...)``. Read from another thread,
        it may lag the engine by one observation; never torn within a bucket."""
        counts = list(self.counts)  # a copy: the engine thread may observe meanwhile
        out, total = [], 0
        for bound, c in zip([*map(float, self.bounds), "+Inf"], counts):
            total += c
            out.append((str(bound), total))
        return out

    def reset(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
