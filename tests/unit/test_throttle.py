"""The login throttle keeps its memory bounded and its counts honest under a flood."""

from __future__ import annotations

import pytest

from llmgw.core.throttle import LoginThrottle


def test_an_address_gets_its_attempts_then_waits_for_the_window():
    t = LoginThrottle(limit=3, window_s=60, capacity=10)
    assert all(t.attempt("10.0.0.1", 0).allowed for _ in range(3))
    refused = t.attempt("10.0.0.1", 1)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(59)
    assert "10.0.0.1" in refused.reason
    assert t.attempt("10.0.0.1", 60).allowed, "a new window starts the count again"


def test_a_flood_of_made_up_addresses_neither_grows_the_table_nor_frees_the_attacker():
    t = LoginThrottle(limit=5, window_s=300, capacity=100)
    for _ in range(5):
        t.attempt("203.0.113.9", 0)
    assert not t.attempt("203.0.113.9", 1).allowed

    refused_new = 0
    for i in range(1000):
        verdict = t.attempt(f"198.51.{i // 250}.{i % 250}", 2 + i * 0.01)
        refused_new += not verdict.allowed
        assert len(t) <= 100
    assert refused_new == 1000 - 99, "once full, new addresses are refused, not admitted"
    assert not t.attempt("203.0.113.9", 20).allowed, "the flood did not reset the attacker"
    assert "too many addresses" in t.attempt("192.0.2.1", 21).reason


def test_when_full_stale_entries_make_room_but_live_ones_stay():
    t = LoginThrottle(limit=5, window_s=60, capacity=3)
    t.attempt("old-1", 0)
    t.attempt("old-2", 0)
    for _ in range(5):
        t.attempt("attacker", 30)
    assert t.attempt("new", 61).allowed, "the two stale entries were dropped"
    assert len(t) == 2
    assert not t.attempt("attacker", 62).allowed


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        LoginThrottle(limit=0)
