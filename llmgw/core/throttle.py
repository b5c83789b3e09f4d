"""A per-address login throttle whose memory is bounded, whatever a flood sends.

Each address gets ``limit`` attempts per ``window_s``. The table holds at most
``capacity`` addresses. When it is full, entries whose window has passed are dropped; if
it is still full, a *new* address is refused. Evicting a live entry instead would let a
flood of made-up addresses reset the count of the address that is really guessing.
Time is passed in, so a test can replay any sequence.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    window_start: float
    attempts: int


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    retry_after_s: float = 0.0
    reason: str = ""


class LoginThrottle:
    def __init__(self, limit: int = 10, window_s: float = 300.0, capacity: int = 10_000):
        if limit < 1 or window_s <= 0 or capacity < 1:
            raise ValueError("limit, window and capacity must be positive")
        self.limit = limit
        self.window_s = window_s
        self.capacity = capacity
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def attempt(self, address: str, now: float) -> Verdict:
        """Count one attempt from ``address``; say whether it may go ahead."""
        entry = self._entries.get(address)
        if entry is not None and now - entry.window_start >= self.window_s:
            # A new window: move it to the back, so the table stays ordered by window start.
            del self._entries[address]
            entry = self._entries[address] = _Entry(now, 0)
        if entry is None:
            if len(self._entries) >= self.capacity:
                self._expire(now)
            if len(self._entries) >= self.capacity:
                return Verdict(False, self._soonest_expiry(now),
                               "too many addresses are trying to log in; try again later")
            entry = self._entries[address] = _Entry(now, 0)
        if entry.attempts >= self.limit:
            wait = entry.window_start + self.window_s - now
            return Verdict(False, wait, f"too many login attempts from {address}; "
                                        f"try again in {wait:.0f} s")
        entry.attempts += 1
        return Verdict(True)

    def _expire(self, now: float) -> None:
        # Entries are in window-start order: drop from the front while they are stale.
        while self._entries:
            address = next(iter(self._entries))
            if now - self._entries[address].window_start < self.window_s:
                break
            del self._entries[address]

    def _soonest_expiry(self, now: float) -> float:
        oldest = next(iter(self._entries.values()))
        return max(0.0, oldest.window_start + self.window_s - now)
