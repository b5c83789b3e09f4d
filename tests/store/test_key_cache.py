"""The gateway's cache of API keys over a real store (SQLite and PostgreSQL): one store
read per key per ``ttl_s`` however many requests, reads shared, changes made through this
server applied at once and changes made elsewhere within ``ttl_s``; the keys in use read
again together, in one query, so that they never expire under their requests."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from sqlalchemy import text

from llmgw.server.auth import KeyCache, create_api_key, keys
from llmgw.server.auth.keys import _CRC_LEN, _checksum, key_id, new_api_key
from llmgw.store import AccountRecord, ApiKeyRecord, Store
from llmgw.store import store as store_module
from tests.store.controllers import Clock

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


class Reads:
    """The real store, with its key reads counted (and the keys each asked for);
    ``gate``, when given, holds what each read found until it is set, so a test can change
    a key while a read is on its way."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.count = 0
        self.asked: list[set[str]] = []
        self.started = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def find_api_keys(self, prefixes) -> list[tuple[ApiKeyRecord, bool]]:
        self.count += 1
        self.asked.append(set(prefixes))
        found = await self.store.find_api_keys(prefixes)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        return found


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


async def test_ids_the_store_does_not_have_are_read_once_per_ttl_too(store):
    reads = Reads(store)
    cache = KeyCache(reads, ttl_s=60.0)
    made_up = [new_api_key() for _ in range(50)]
    for key in made_up * 2:
        assert await cache.check(key, NOW) == "the API key is not valid"
    # Each made-up id was read once; its second request was answered from memory, as a
    # known id's would be (tests/store/test_key_cache_unknown_ids.py says more).
    assert reads.count == 50


async def test_keys_in_use_are_read_again_together_and_never_expire_under_requests(store):
    keys = [await create_api_key(store, f"tenant{i}") for i in range(3)]
    idle, _ = await create_api_key(store, "idle")
    reads, clock = Reads(store), Clock()
    cache = KeyCache(reads, ttl_s=5.0, clock=clock)
    for key, record in keys:
        assert await cache.check(key, NOW) == record
    assert await cache.check(idle, NOW) != "the API key is not valid"
    assert reads.count == 4

    # The first refresh reads all four (each was used since) in one query.
    await cache.refresh()
    assert reads.count == 5 and len(reads.asked[-1]) == 4
    # Only the three tenants are used from here; each refresh, within the ttl of the one
    # before, reads them again together: their requests never read the store.
    for _ in range(4):
        clock.now += 2.5
        for key, record in keys:
            assert await cache.check(key, NOW) == record
        await cache.refresh()
    assert reads.count == 9
    assert reads.asked[-1] == {key_id(key) for key, _ in keys}  # idle was dropped
    clock.now += 2.5
    assert await cache.check(idle, NOW) != "the API key is not valid"
    assert reads.count == 10  # idle's next request read it: not kept while unused


async def test_a_refresh_sees_a_change_made_elsewhere_and_a_key_deleted(store):
    (kept, kept_record), (revoked, revoked_record) = [
        await create_api_key(store, name) for name in ("kept", "revoked")]
    reads, clock = Reads(store), Clock()
    cache = KeyCache(reads, ttl_s=5.0, clock=clock)
    owner = await store.add_account(AccountRecord(username="carol", password_hash="x",
                                                  role="user", created_at=NOW))
    owned, _ = await create_api_key(store, "carols", account_id=owner.id)
    for key in (kept, revoked, owned):
        assert not isinstance(await cache.check(key, NOW), str)

    # Another server revokes one key and disables an owner: the next refresh sees both,
    # within the ttl, without a request having to read.
    await store.revoke_api_key(revoked_record.prefix, NOW)
    await store.update_account(owner.id, disabled_at=NOW)
    await cache.refresh()
    assert reads.count == 4  # three requests' reads, then the refresh's one
    assert await cache.check(kept, NOW) == kept_record
    assert await cache.check(revoked, NOW) == "the API key has been revoked"
    assert await cache.check(owned, NOW) == "the account that owns this API key is disabled"
    assert reads.count == 4  # what the refresh read, not read again

    # A key gone from the store (a backup restored from before it was made, say): the
    # refresh drops it, and its next request finds it unknown.
    async with store.engine.begin() as conn:
        await conn.execute(text("DELETE FROM api_keys WHERE prefix = :p"),
                           {"p": kept_record.prefix})
    await cache.refresh()
    assert await cache.check(kept, NOW) == "the API key is not valid"


async def test_a_refresh_that_a_forget_overtakes_is_not_kept(store):
    key, record = await create_api_key(store, "overtaken")
    reads, clock = Reads(store), Clock()
    cache = KeyCache(reads, ttl_s=5.0, clock=clock)
    assert await cache.check(key, NOW) == record
    reads.gate, reads.started = asyncio.Event(), asyncio.Event()
    refreshing = asyncio.create_task(cache.refresh())
    await reads.started.wait()  # the refresh read the key: it was not revoked yet
    await store.revoke_api_key(record.prefix, NOW)
    cache.forget(record.prefix)  # as the admin route does
    reads.gate.set()
    await refreshing
    reads.gate = None
    assert await cache.check(key, NOW) == "the API key has been revoked"


async def test_find_api_keys_reads_many_keys_and_whether_their_owners_let_them(store,
                                                                              monkeypatch):
    alice, bob = [await store.add_account(AccountRecord(
        username=name, password_hash="x", role="user", created_at=NOW))
        for name in ("alice", "bob")]
    await store.update_account(bob.id, disabled_at=NOW)
    made = {name: (await create_api_key(store, name, account_id=owner))[1]
            for name, owner in (("admins", None), ("alices", alice.id), ("bobs", bob.id))}
    await store.revoke_api_key(made["admins"].prefix, NOW)  # revoked: still found
    monkeypatch.setattr(store_module, "_PREFIXES_PER_READ", 2)  # three queries for five
    found = await store.find_api_keys([r.prefix for r in made.values()]
                                      + ["llmgw_nobodyhasit", "llmgw_norhasthis"])
    assert sorted((record.name, enabled) for record, enabled in found) == [
        ("admins", True), ("alices", True), ("bobs", False)]
    assert {record.prefix: record for record, _ in found}[made["admins"].prefix] == (
        await store.find_api_key(made["admins"].prefix))
    assert await store.find_api_keys([]) == []


async def test_a_connection_that_keeps_sending_its_key_has_it_hashed_once(store, monkeypatch):
    # With a connection's memo, a key read lately is hashed once for as long as the
    # connection keeps sending it. Another key on the same connection (a proxy's, carrying
    # several clients' requests) is hashed and judged on its own; a forged one with a real
    # key's id is refused; the memo never stands in for what the store said of the key.
    key, record = await create_api_key(store, "kept-alive")
    other, other_record = await create_api_key(store, "another client")
    cache = KeyCache(store, ttl_s=5.0, clock=Clock())
    assert await cache.check(key, NOW) == record
    assert await cache.check(other, NOW) == other_record
    hashed: list[str] = []
    digest = keys._digest
    monkeypatch.setattr(keys, "_digest", lambda k: hashed.append(k) or digest(k))
    memo: dict = {}

    assert [cache.good_now(key, memo) for _ in range(5)] == [record] * 5
    assert hashed == [key]
    assert cache.good_now(other, memo) == other_record
    assert cache.good_now(key, memo) == record
    assert hashed == [key, other, key]

    body = key[:-_CRC_LEN]
    secret = body[len(body) - 1] + body[:-1]  # the same id, another secret
    forged = body[:-32] + secret[-32:]
    forged += _checksum(forged)
    assert key_id(forged) == key_id(key) and forged != key
    assert cache.good_now(forged, memo) is None
    assert cache.good_now(key, memo) == record  # the forged one took the memo's place
    assert hashed == [key, other, key, forged, key]

    await store.revoke_api_key(key_id(key), NOW)
    cache.forget(key_id(key))
    assert await cache.check(key, NOW) == "the API key has been revoked"
    assert cache.good_now(key, memo) is None
