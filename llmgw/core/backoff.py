"""When to try again after a failure: a delay that doubles from a first value to a cap.

The one rule for every retry llmgw makes: the agent's install loop (a failed pass is
retried after a minute, backing off to ten), the controller's crash-loop backoff for a
model's replicas (core.reconcile) and the agent's reconnects to the control plane (with
full jitter, so that a fleet does not come back in lockstep). Pure, with time and the
random draw passed in, so each can be replayed in a unit test. The state is a small
frozen value the caller keeps per thing it retries; a success forgets it.
"""

from __future__ import annotations

from dataclasses import dataclass


def delay_s(failures: int, first_s: float, max_s: float) -> float:
    """The wait after ``failures`` failures in a row: ``first_s`` after one, twice that
    after two, and so on, never more than ``max_s``; nothing before the first failure."""
    if failures <= 0:
        return 0.0
    # Cap the exponent first: something failing for weeks must not overflow the float.
    return min(first_s * 2 ** min(failures - 1, 32), max_s)


def jittered_delay_s(failures: int, first_s: float, max_s: float, draw: float) -> float:
    """Full jitter: anywhere from zero up to ``delay_s``, at the fraction ``draw`` (a
    uniform random number in [0, 1)) of it."""
    return draw * delay_s(failures, first_s, max_s)


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


def after_failure(retry: Retry, now: float, policy: RetryPolicy = INSTALL_RETRY) -> Retry:
    failures = retry.failures + 1
    return Retry(failures, now + delay_s(failures, policy.first_s, policy.max_s))
