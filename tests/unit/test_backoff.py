"""The one backoff rule (core.backoff): install retries, crash loops and reconnects use it."""

from __future__ import annotations

import random

import pytest

from llmgw.core.backoff import delay_s, jittered_delay_s


def test_the_wait_doubles_from_the_first_up_to_the_cap():
    waits = [delay_s(n, 0.5, 30.0) for n in range(1, 10)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_no_failure_yet_is_no_wait():
    assert delay_s(0, 10.0, 300.0) == 0.0
    assert delay_s(-1, 10.0, 300.0) == 0.0


def test_weeks_of_failures_stay_at_the_cap_without_overflowing():
    assert delay_s(10**6, 60.0, 600.0) == 600.0


def test_a_first_wait_longer_than_the_cap_is_the_cap():
    # server.yaml may set restart_backoff_initial_s above restart_backoff_max_s.
    assert [delay_s(n, 500.0, 300.0) for n in (1, 2)] == [300.0, 300.0]


@pytest.mark.parametrize("draw", [0.0, 0.25, 0.999])
def test_full_jitter_is_the_drawn_fraction_of_the_wait(draw):
    assert jittered_delay_s(3, 0.5, 30.0, draw) == draw * 2.0


def test_full_jitter_matches_a_uniform_draw_up_to_the_wait():
    """The agent's reconnects draw with random.Random: the same generator state gives the
    wait ``uniform(0, ceiling)`` would."""
    for failures in range(1, 12):
        ceiling = delay_s(failures, 0.5, 30.0)
        ours, theirs = random.Random(failures), random.Random(failures)
        assert jittered_delay_s(failures, 0.5, 30.0, ours.random()) == pytest.approx(
            theirs.uniform(0, ceiling))
