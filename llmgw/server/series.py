"""Series kept as plain numbers, handed to prometheus-client's registry when scraped.

Only the event loop records and scrapes, so none of them takes a lock: an observation is
a dict lookup and an addition or two, well under a microsecond.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client.utils import floatToGoString


class Count:
    """One counter series: a number the event loop adds to."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class Histogram:
    """One histogram series as plain numbers: an observation is a bisect and two additions
    (prometheus_client's takes a lock and walks its buckets in Python, 4-5 µs a request).
    Only the event loop observes and scrapes, so no lock is needed. (A stream's relay
    writes ``observe`` out per read: openai/timing.py.)"""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last one +Inf's
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative, as the exposition has them."""
        total, out = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append((floatToGoString(bound), total))
        return out
