"""The key cache and ids the store does not have (issue 34, hole 3), over a real store
(SQLite and PostgreSQL) whose reads are counted by wrapping it: an unknown id is answered
as a known id with a wrong secret is, from memory after its first read, with the same work
and the same words; a flood of made-up ids costs batched reads, one at a time, and memory
up to a cap; and a key made elsewhere is not locked out longer than ``ttl_s``."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime

import pytest

from llmgw.server.auth import KeyCache, create_api_key, hash_key, key_id, keys
from llmgw.server.auth.keys import _ALPHABET, KEY_PREFIX, _checksum, new_api_key
from llmgw.store import ApiKeyRecord, Store, StoreError

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
NOT_VALID = "the API key is not valid"


class Reads:
    """The real store, its key reads counted: how many, the ids each asked for, and the
    most ever on their way at once. ``gate``, when given, holds each read's answer until
    it is set; ``fail``, when given, is raised by the next read instead."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.count = 0
        self.asked: list[list[str]] = []
        self.in_flight = self.most_in_flight = 0
        self.started = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None

    async def find_api_keys(self, prefixes) -> list[tuple[ApiKeyRecord, bool]]:
        self.count += 1
        self.asked.append(list(prefixes))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.fail is not None:
                failure, self.fail = self.fail, None
                raise failure
            found = await self.store.find_api_keys(prefixes)
            self.started.set()
            if self.gate is not None:
                await self.gate.wait()
            return found
        finally:
            self.in_flight -= 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _made_up(count: int) -> list[str]:
    """``count`` well-formed keys (prefix, length, checksum) that nobody made: what an
    attacker sends. Quicker than ``new_api_key``, which draws each character securely."""
    draw = random.Random(34).choices
    bodies = (KEY_PREFIX + "".join(draw(_ALPHABET, k=44)) for _ in range(count))
    return [body + _checksum(body) for body in bodies]


def _wrong_secret(key: str) -> str:
    body = key_id(key) + "x" * 32
    return body + _checksum(body)


async def _add_elsewhere(store: Store, key: str) -> ApiKeyRecord:
    """Store ``key`` as another server sharing the store would make it."""
    return await store.add_api_key(ApiKeyRecord(
        prefix=key_id(key), secret_hash=hash_key(key), name="made elsewhere",
        created_at=NOW))


async def test_an_unknown_id_is_answered_as_a_wrong_secret_from_memory(store, monkeypatch):
    key, _ = await create_api_key(store, "real")
    wrong, made_up = _wrong_secret(key), new_api_key()
    reads = Reads(store)
    cache = KeyCache(reads, ttl_s=5.0, clock=Clock())

    # The first request naming each id reads it, whether the store has it or not.
    assert await cache.check(wrong, NOW) == NOT_VALID
    assert await cache.check(made_up, NOW) == NOT_VALID
    assert reads.count == 2

    # From then on both are answered from memory: the same words, each key hashed once
    # and compared (with its id's stored hash, or with a stand-in), no read.
    hashed: list[str] = []
    digest = keys._digest
    monkeypatch.setattr(keys, "_digest", lambda k: hashed.append(k) or digest(k))
    for _ in range(100):
        assert await cache.check(wrong, NOW) is await cache.check(made_up, NOW)
    assert reads.count == 2
    assert hashed == [wrong, made_up] * 100

    # The gateway's callback path hands both to the task path, having hashed each.
    hashed.clear()
    assert cache.good_now(wrong, {}) is None and cache.good_now(made_up, {}) is None
    assert hashed == [wrong, made_up]


async def test_a_flood_of_made_up_ids_costs_batched_reads_and_bounded_memory(store):
    key, record = await create_api_key(store, "busy")
    reads = Reads(store)
    cache = KeyCache(reads, ttl_s=5.0, clock=Clock(), max_unknown=1_000)
    assert await cache.check(key, NOW) == record

    # 20,000 made-up ids, none twice, in waves of 1,000 requests at once (a client with
    # many connections): the ids that miss while a read is on its way are read together
    # next, one read at a time, so each wave costs two reads, not a thousand.
    flood = _made_up(20_000)
    for at in range(0, len(flood), 1_000):
        answers = await asyncio.gather(*(cache.check(k, NOW) for k in flood[at:at + 1_000]))
        assert set(answers) == {NOT_VALID}
        assert len(cache._unknown) <= 1_000 and len(cache._used) <= 1_001
    assert reads.count <= 1 + 2 * 20
    assert reads.most_in_flight == 1
    assert sorted(p for asked in reads.asked[1:] for p in asked) == sorted(map(key_id, flood))
    # Memory: at most the cap of unknown ids (the ones read last), nothing left waiting.
    assert len(cache._unknown) == 1_000 and cache.size == 1_001
    assert set(cache._unknown) == {key_id(k) for k in flood[-1_000:]}
    assert not cache._waiting and not cache._queued and cache._reader is None

    # The real key was never pushed out, and is still answered without a read.
    count = reads.count
    assert await cache.check(key, NOW) == record
    # A refresh reads what was used (the real key and the remembered ids) in one call,
    # and a made-up id asked again is answered from memory.
    await cache.refresh()
    assert reads.count == count + 1 and len(reads.asked[-1]) == 1_001
    assert await cache.check(flood[-1], NOW) == NOT_VALID
    assert reads.count == count + 1


async def test_a_prober_repeating_made_up_ids_reads_each_once(store):
    reads = Reads(store)
    cache = KeyCache(reads, ttl_s=5.0, clock=Clock(), max_unknown=1_000)
    made_up = _made_up(200)
    for i in range(20_000):  # one request at a time
        assert await cache.check(made_up[i % 200], NOW) == NOT_VALID
    assert reads.count == 200
    assert cache.size == 200


async def test_a_key_made_elsewhere_after_its_id_was_refused_works_within_the_ttl(store):
    key = new_api_key()
    reads, clock = Reads(store), Clock()
    cache = KeyCache(reads, ttl_s=5.0, clock=clock)
    assert await cache.check(key, NOW) == NOT_VALID
    made = await _add_elsewhere(store, key)

    # Remembered as unknown for no longer than a revoked key would be trusted: ttl_s.
    clock.now += 4.9
    assert await cache.check(key, NOW) == NOT_VALID
    assert reads.count == 1
    clock.now += 0.2
    assert await cache.check(key, NOW) == made
    assert reads.count == 2

    # A refresh sees it sooner, when the id was in use; forget (an admin route) at once.
    for see in ("refresh", "forget"):
        other = new_api_key()
        assert await cache.check(other, NOW) == NOT_VALID
        made = await _add_elsewhere(store, other)
        if see == "refresh":
            await cache.refresh()
        else:
            cache.forget(key_id(other))
        assert await cache.check(other, NOW) == made, see


async def test_unknown_is_trusted_from_before_its_read_and_not_after_a_forget(store):
    key = new_api_key()
    reads, clock = Reads(store), Clock()
    reads.gate = asyncio.Event()
    cache = KeyCache(reads, ttl_s=5.0, clock=clock)

    # A read that takes 3 s: its answer is trusted from when it began.
    pending = asyncio.create_task(cache.check(key, NOW))
    await reads.started.wait()
    clock.now += 3
    reads.gate.set()
    assert await pending == NOT_VALID
    clock.now += 2.01
    reads.gate, reads.started = asyncio.Event(), asyncio.Event()
    pending = asyncio.create_task(cache.check(key, NOW))
    await reads.started.wait()
    assert reads.count == 2

    # A forget while it is on its way (the key made meanwhile): that answer is not kept.
    made = await _add_elsewhere(store, key)
    cache.forget(key_id(key))
    reads.gate.set()
    assert await pending == NOT_VALID  # what that read found
    reads.gate = None
    assert await cache.check(key, NOW) == made


async def test_a_failed_read_answers_its_waiters_and_leaves_nothing_behind(store):
    reads = Reads(store)
    cache = KeyCache(reads, ttl_s=5.0, clock=Clock())
    made_up = [new_api_key() for _ in range(3)]
    reads.gate = asyncio.Event()
    first = asyncio.create_task(cache.check(made_up[0], NOW))
    await reads.started.wait()
    # These wait for the next read, which fails: each of them is told.
    reads.fail = StoreError("the store is down")
    rest = [asyncio.create_task(cache.check(k, NOW)) for k in made_up[1:]]
    await asyncio.sleep(0)
    reads.gate.set()
    assert await first == NOT_VALID
    for task in rest:
        with pytest.raises(StoreError):
            await task
    assert not cache._waiting and cache._reader is None
    # Nothing was remembered of what could not be read: the next request reads again.
    reads.gate = None
    assert await cache.check(made_up[1], NOW) == NOT_VALID
    assert reads.count == 3


async def test_a_request_that_goes_away_does_not_cancel_the_read_for_others(store):
    key, record = await create_api_key(store, "shared")
    reads = Reads(store)
    reads.gate = asyncio.Event()
    cache = KeyCache(reads, ttl_s=5.0, clock=Clock())
    leaving = asyncio.create_task(cache.check(key, NOW))
    staying = asyncio.create_task(cache.check(key, NOW))
    await reads.started.wait()
    leaving.cancel()
    reads.gate.set()
    assert await staying == record
    assert leaving.cancelled() and reads.count == 1


async def test_with_a_ttl_of_0_nothing_is_kept(store):
    reads = Reads(store)
    cache = KeyCache(reads, ttl_s=0, clock=Clock())
    made_up = new_api_key()
    for _ in range(3):
        assert await cache.check(made_up, NOW) == NOT_VALID
    assert reads.count == 3 and cache.size == 0
