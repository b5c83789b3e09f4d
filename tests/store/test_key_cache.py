"""The gateway's cache of API keys over a real store (SQLite and PostgreSQL): one store
read per key per ``ttl_s`` however many requests, reads shared, changes made through this
server applied at once and changes made elsewhere within ``ttl_s``."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from llmgw.server.auth import KeyCache, create_api_key
from llmgw.server.auth.keys import _checksum, key_id, new_api_key
from llmgw.store import AccountRecord, ApiKeyRecord, Store

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


class Reads:
    """The real store, with its key reads counted; ``gate``, when given, holds what each
    read found until it is set, so a test can change the key while a read is on its way."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.count = 0
        self.started = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def find_api_key(self, prefix: str) -> ApiKeyRecord | None:
        self.count += 1
        found = await self.store.find_api_key(prefix)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        return found

    async def get_account(self, account_id: int) -> AccountRecord | None:
        return await self.store.get_account(account_id)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_key_is_read_once_per_ttl_however_many_requests_use_it(store):
    key, record = await create_api_key(store, "busy")
    reads, clock = Reads(store), Clock()
    cache = KeyCache(reads, ttl_s=5.0, clock=clock)

    # Twenty requests that find the key unread share one read.
    answers = await asyncio.gather(*(cache.check(key, NOW) for _ in range(20)))
    assert all(a == record for a in answers)
    assert reads.count == 1
    for _ in range(100):
        assert await cache.check(key, NOW) == record
    assert reads.count == 1

    clock.now += 5.1
    assert await cache.check(key, NOW) == record
    assert reads.count == 2


async def test_a_change_made_elsewhere_applies_within_the_ttl_and_forget_at_once(store):
    key, record = await create_api_key(store, "changing")
    clock = Clock()
    cache = KeyCache(store, ttl_s=5.0, clock=clock)
    assert await cache.check(key, NOW) == record

    # Another server revokes it: trusted here until the ttl runs out, then refused.
    await store.revoke_api_key(record.prefix, NOW)
    assert await cache.check(key, NOW) == record
    clock.now += 5.1
    assert await cache.check(key, NOW) == "the API key has been revoked"

    # Through this server (the admin routes call forget), the next request sees it.
    other, _ = await create_api_key(store, "limited")
    assert (await cache.check(other, NOW)).limits.rpm is None
    await store.update_api_key_limits(key_id(other), rpm=60)
    cache.forget(key_id(other))
    assert (await cache.check(other, NOW)).limits.rpm == 60


async def test_a_read_begun_before_a_change_is_not_kept_after_it(store):
    key, record = await create_api_key(store, "racing")
    reads = Reads(store)
    reads.gate = asyncio.Event()
    cache = KeyCache(reads, ttl_s=60.0)

    pending = asyncio.create_task(cache.check(key, NOW))
    await reads.started.wait()
    # The key was read before the revocation, whose forget comes while the read is on
    # its way: that request gets what was read, and nobody after it.
    await store.revoke_api_key(record.prefix, NOW)
    cache.forget(record.prefix)
    reads.gate.set()
    assert await pending == record

    assert await cache.check(key, NOW) == "the API key has been revoked"
    assert reads.count == 2


async def test_a_disabled_owner_and_a_wrong_secret_are_refused(store):
    owner = await store.add_account(AccountRecord(username="bob", password_hash="x",
                                                  role="user", created_at=NOW))
    key, record = await create_api_key(store, "bobs", account_id=owner.id)
    cache = KeyCache(store, ttl_s=60.0)
    assert await cache.check(key, NOW) == record

    # Same id, another secret: cached or not, the secret is checked on every request.
    body = key_id(key) + "x" * 32
    forged = body + _checksum(body)
    assert await cache.check(forged, NOW) == "the API key is not valid"
    typo = key[:-1] + ("a" if key[-1] != "a" else "b")
    assert await cache.check(typo, NOW) == ("the API key is malformed; it should start with "
                                            "llmgw_ and be copied whole")

    await store.update_account(owner.id, disabled_at=NOW)
    cache.forget()
    assert await cache.check(key, NOW) == "the account that owns this API key is disabled"


async def test_keys_the_store_does_not_have_are_not_kept(store):
    reads = Reads(store)
    cache = KeyCache(reads, ttl_s=60.0)
    made_up = [new_api_key() for _ in range(50)]
    for key in made_up * 2:
        assert await cache.check(key, NOW) == "the API key is not valid"
    # Each of the hundred requests read the store: nothing was kept for a key nobody has.
    assert reads.count == 100
