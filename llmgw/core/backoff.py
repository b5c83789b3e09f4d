"""When to try again after a failure: a delay that doubles from a first value to a cap.

Pure, with time passed in, so the agent's install loop (a failed pass is retried after a
minute, backing off to ten) can be replayed in a unit test. The state is a small frozen
value the caller keeps per thing it retries; a success forgets it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    first_s: float = 60.0
    max_s: float = 600.0

    def __post_init__(self) -> None:
        if self.first_s <= 0 or self.max_s < self.first_s:
            raise ValueError("a retry policy needs 0 < first_s <= max_s")


# Failed install passes: after a minute, doubling to ten.
INSTALL_RETRY = RetryPolicy(60.0, 600.0)


@dataclass(frozen=True, slots=True)
class Retry:
    """Failures in a row, and the earliest time the next try may start."""

    failures: int = 0
    not_before: float = 0.0

    def due(self, now: float) -> bool:
        return now >= self.not_before


def delay_s(failures: int, policy: RetryPolicy) -> float:
    """The wait after ``failures`` failures in a row (1 → first_s, 2 → twice that, …)."""
    if failures <= 0:
        return 0.0
    # Cap the exponent first: something failing for weeks must not overflow the float.
    return min(policy.first_s * 2 ** min(failures - 1, 32), policy.max_s)


def after_failure(retry: Retry, now: float, policy: RetryPolicy = INSTALL_RETRY) -> Retry:
    failures = retry.failures + 1
    return Retry(failures, now + delay_s(failures, policy))
