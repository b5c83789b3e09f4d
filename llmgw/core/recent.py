"""Requests and tokens per minute over the last hour, as one server counted them: the
cluster page's overview. Pure: the caller says what time it is."""

from __future__ import annotations

from dataclasses import dataclass

MINUTES = 60


@dataclass(frozen=True, slots=True)
class Minute:
    start: int  # Unix time of the minute's first second
    requests: int
    tokens: int


class RecentMinutes:
    """Counts per wall-clock minute, the last ``minutes`` of them; older ones are dropped
    as new ones come, so it never holds more than ``minutes`` entries."""

    def __init__(self, minutes: int = MINUTES) -> None:
        self.minutes = minutes
        self._counts: dict[int, list[int]] = {}  # minute index -> [requests, tokens]

    def add(self, now: float, requests: int, tokens: int) -> None:
        index = int(now // 60)
        counts = self._counts.get(index)
        if counts is None:
            counts = self._counts[index] = [0, 0]
            for old in [i for i in self._counts if i <= index - self.minutes]:
                del self._counts[old]
        counts[0] += requests
        counts[1] += tokens

    def series(self, now: float) -> list[Minute]:
        """Every minute of the last ``minutes``, oldest first, the current one last (it
        is still counting); a minute without requests is there with zeros."""
        last = int(now // 60)
        return [Minute(i * 60, *self._counts.get(i, (0, 0)))
                for i in range(last - self.minutes + 1, last + 1)]
