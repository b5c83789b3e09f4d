"""Password hashing: argon2id, bounded in concurrency, rehash on login, no user oracle."""

from __future__ import annotations

import asyncio
import threading

import argon2
import pytest

from llmgw.server.auth import passwords
from llmgw.server.auth.passwords import PasswordHasher

# OWASP's minimum: the cheapest parameters the hasher accepts, to keep the test fast.
FAST = {"memory_kib": 19 * 1024, "time_cost": 2, "parallelism": 1}


async def test_at_most_slots_hashes_run_at_once_under_200_concurrent_logins(monkeypatch):
    hasher = PasswordHasher(slots=2, **FAST)
    stored = await hasher.hash("the right password")
    running = 0
    peak_seen = 0
    lock = threading.Lock()
    verify = hasher._verify

    def counting_verify(*args):
        # Counted inside the worker thread: what really runs at once, not what is queued.
        nonlocal running, peak_seen
        with lock:
            running += 1
            peak_seen = max(peak_seen, running)
        try:
            return verify(*args)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(hasher, "_verify", counting_verify)
    results = await asyncio.gather(*(hasher.check(stored, f"wrong {i}") for i in range(200)))
    assert not any(r.ok for r in results)
    assert peak_seen == 2, "the slots were all used, and never more"
    assert hasher.stats() == {"slots": 2, "in_use": 0, "peak": 2}


async def test_a_weaker_stored_hash_is_upgraded_on_login():
    weak = argon2.PasswordHasher(memory_cost=19 * 1024, time_cost=2, parallelism=1)
    stored = weak.hash("hunter2 hunter2")
    hasher = PasswordHasher(slots=1)  # today's parameters: 64 MiB, 3 passes
    checked = await hasher.check(stored, "hunter2 hunter2")
    assert checked.ok and checked.rehash
    assert argon2.extract_parameters(checked.rehash).memory_cost == 65536
    assert (await hasher.check(checked.rehash, "hunter2 hunter2")).rehash is None


async def test_an_unknown_user_costs_a_hash_and_never_passes():
    hasher = PasswordHasher(slots=1, **FAST)
    before = hasher.peak
    assert not (await hasher.check(None, "anything")).ok
    assert hasher.peak == max(before, 1), "a dummy hash was verified"


def test_parameters_below_owasp_minimum_are_refused():
    with pytest.raises(ValueError, match="OWASP"):
        PasswordHasher(memory_kib=passwords.MIN_MEMORY_KIB - 1)
    with pytest.raises(ValueError, match="OWASP"):
        PasswordHasher(time_cost=1)
