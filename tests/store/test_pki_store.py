"""Join tokens and node certificates in the store (`llmgw.store.pki`), on both backends,
and migration 0004 up and down over a store in use."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import inspect, make_url, text
from sqlalchemy.ext.asyncio import create_async_engine

from llmgw.store import StoreError, migrate, open_store
from llmgw.store.pki import JoinTokenRecord, JoinTokenUnusable, NodeCertRecord

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
NEW_TABLES = {"join_tokens", "node_certs"}


def token(hash_: str = "a" * 64, node: str = "gpu-01", ttl: timedelta = HOUR) -> JoinTokenRecord:
    return JoinTokenRecord(token_hash=hash_, node=node, created_at=T0, expires_at=T0 + ttl,
                           created_by="alice")


def cert(serial: str, node: str = "gpu-01", days: float = 7) -> NodeCertRecord:
    return NodeCertRecord(serial=serial, node=node, not_before=T0,
                          not_after=T0 + timedelta(days=days))


async def test_a_token_is_redeemed_once_with_its_certificate(store) -> None:
    made = await store.add_join_token(token())
    assert made.used_at is None and made.created_by == "alice"
    used = await store.redeem_join_token("a" * 64, cert("101"), T0 + timedelta(minutes=5))
    assert used.used_at == T0 + timedelta(minutes=5) and used.node == "gpu-01"
    assert await store.list_node_certs("gpu-01") == [cert("101")]

    with pytest.raises(JoinTokenUnusable,
                       match="already used at 2026-11-29 12:05:00 UTC; make a new one with "
                             "llmgw ctl nodes add gpu-01") as refused:
        await store.redeem_join_token("a" * 64, cert("102"), T0 + timedelta(minutes=6))
    assert refused.value.reason == "used"
    assert [c.serial for c in await store.list_node_certs()] == ["101"]  # nothing recorded


async def test_unknown_and_expired_tokens_record_nothing(store) -> None:
    await store.add_join_token(token())
    with pytest.raises(JoinTokenUnusable, match="not known to the cluster") as refused:
        await store.redeem_join_token("b" * 64, cert("1"), T0)
    assert refused.value.reason == "unknown"
    with pytest.raises(JoinTokenUnusable, match="expired at 2026-11-29 13:00:00 UTC") as refused:
        await store.redeem_join_token("a" * 64, cert("1"), T0 + HOUR)  # expiry is exclusive
    assert refused.value.reason == "expired"
    assert await store.list_node_certs() == []
    assert (await store.find_join_token("a" * 64)).used_at is None


async def test_a_certificate_for_another_node_is_refused_and_the_token_kept(store) -> None:
    await store.add_join_token(token())
    with pytest.raises(StoreError, match="names node 'mallory' but the token is for 'gpu-01'"):
        await store.redeem_join_token("a" * 64, cert("7", node="mallory"), T0)
    assert (await store.find_join_token("a" * 64)).used_at is None  # rolled back
    assert await store.list_node_certs() == []


async def test_concurrent_redemptions_let_exactly_one_through(store) -> None:
    await store.add_join_token(token())
    results = await asyncio.wait_for(asyncio.gather(
        *(store.redeem_join_token("a" * 64, cert(str(1000 + i)), T0) for i in range(8)),
        return_exceptions=True), timeout=60)
    won = [r for r in results if isinstance(r, JoinTokenRecord)]
    lost = [r for r in results if not isinstance(r, JoinTokenRecord)]
    assert len(won) == 1 and all(isinstance(r, JoinTokenUnusable) for r in lost), results
    assert len(await store.list_node_certs()) == 1


async def test_token_rules(store) -> None:
    with pytest.raises(StoreError, match="must expire after it is made"):
        await store.add_join_token(token(ttl=timedelta(0)))
    await store.add_join_token(token())
    with pytest.raises(StoreError, match="exists already"):
        await store.add_join_token(token())
    await store.add_join_token(token("c" * 64, node="gpu-02"))
    assert [t.node for t in await store.list_join_tokens()] == ["gpu-01", "gpu-02"]
    assert [t.token_hash for t in await store.list_join_tokens("gpu-02")] == ["c" * 64]


async def test_revoking_a_node_revokes_its_live_certificates_only(store) -> None:
    await store.add_node_cert(cert("1"))
    await store.add_node_cert(cert("2", days=14))
    await store.add_node_cert(cert("3", days=0.5))  # expired by the time of revocation
    await store.add_node_cert(cert("4", node="gpu-02"))
    at = T0 + timedelta(days=1)
    assert await store.revoke_node_certs("gpu-01", at) == ["1", "2"]
    assert await store.revoke_node_certs("gpu-01", at + HOUR) == []  # the first time stays
    assert (await store.get_node_cert("1")).revoked_at == at
    assert (await store.get_node_cert("3")).revoked_at is None
    assert (await store.get_node_cert("4")).revoked_at is None
    assert await store.revoked_serials(at) == {"1", "2"}
    assert await store.revoked_serials(T0 + timedelta(days=10)) == {"2"}  # "1" has expired
    assert await store.get_node_cert("999") is None


async def test_a_serial_is_recorded_once_and_must_be_decimal(store) -> None:
    big = str(2**158 + 12345)  # X.509 serials are up to 159 bits: text, not an integer
    await store.add_node_cert(cert(big))
    assert (await store.get_node_cert(big)).serial == big
    with pytest.raises(StoreError, match="recorded already"):
        await store.add_node_cert(cert(big))
    with pytest.raises(StoreError, match="not decimal digits"):
        await store.add_node_cert(cert("0x1f"))


async def test_0004_up_and_down_over_0003_rows(empty_url: str) -> None:
    url = make_url(empty_url)
    if url.get_backend_name() == "sqlite":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url)

    async def tables() -> set[str]:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))

    try:
        await migrate.upgrade(engine, "0003")
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO settings (key, value) VALUES ('k', '1')"))
        assert not await tables() & NEW_TABLES

        store = await open_store(empty_url)  # 0003 -> head, as a server start does
        try:
            assert await store.get_setting("k") == 1
            await store.add_join_token(token())
            await store.redeem_join_token("a" * 64, cert("5"), T0)
            await migrate.downgrade(store.engine, "0003")
        finally:
            await store.close()
        assert await migrate.current_revision(engine) == "0003"
        assert not await tables() & NEW_TABLES
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT key FROM settings"))).scalar_one() == "k"

        store = await open_store(empty_url)  # up again: the new tables start empty
        try:
            assert await store.list_join_tokens() == [] and await store.list_node_certs() == []
        finally:
            await store.close()
        assert await tables() >= NEW_TABLES
    finally:
        await engine.dispose()
