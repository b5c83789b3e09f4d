"""Migration 0003 (key limits, usage windows, usage per day) up and down, on both backends,
over a store made by 0002 and in use."""

from __future__ import annotations

from datetime import UTC, date, datetime
from pathlib import Path

import pytest
from sqlalchemy import inspect, make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from llmgw.core.usage import Limits
from llmgw.store import AccountRecord, ApiKeyRecord, migrate, open_store

T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
LIMIT_COLUMNS = {"rpm", "tpm", "tokens_per_day", "tokens_per_month"}
NEW_TABLES = {"usage_windows", "usage_days"}


@pytest.fixture
async def engine(empty_url: str):
    url = make_url(empty_url)
    if url.get_backend_name() == "sqlite":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    made = create_async_engine(url)
    try:
        yield made
    finally:
        await made.dispose()


async def shape(engine: AsyncEngine) -> tuple[set[str], set[str]]:
    """The tables, and the columns of api_keys."""
    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: (
            set(inspect(c).get_table_names()),
            {col["name"] for col in inspect(c).get_columns("api_keys")},
        ))


async def test_0003_up_and_down_over_0002_rows(empty_url: str, engine: AsyncEngine) -> None:
    pg = engine.dialect.name == "postgresql"
    when = T0 if pg else T0.replace(tzinfo=None).isoformat(" ")
    await migrate.upgrade(engine, "0002")
    async with engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO accounts (username, password_hash, role, created_at)"
            " VALUES ('alice', 'x', 'user', :t)"), {"t": when})
        await conn.execute(text(
            "INSERT INTO api_keys (prefix, secret_hash, name, allowed_models, created_at,"
            " account_id) VALUES ('llmgw_old1', 'h1', 'up', NULL, :t, NULL),"
            " ('llmgw_old2', 'h2', 'alice', :allowed, :t, 1)"),
            {"t": when, "allowed": '["qwen"]'})
    tables, columns = await shape(engine)
    assert not tables & NEW_TABLES and not columns & LIMIT_COLUMNS

    store = await open_store(empty_url)  # 0002 -> head, as a server start does
    try:
        assert await migrate.current_revision(store.engine) == migrate.head_revision()
        keys = await store.list_api_keys()
        assert [(k.prefix, k.account_id, k.allowed_models, k.limits) for k in keys] == [
            ("llmgw_old1", None, None, Limits()),
            ("llmgw_old2", 1, ["qwen"], Limits()),
        ]
        old = await store.update_api_key_limits("llmgw_old2", rpm=1, tokens_per_day=500)
        assert old.limits == Limits(rpm=1, tokens_per_day=500)
        assert await store.admit(old.id, old.limits, T0) is None
        assert (await store.admit(old.id, old.limits, T0)).limit == "rpm"
        await store.record_usage(old.id, "qwen", 20, 22, T0)
        assert [(u.day, u.total_tokens) for u in await store.list_usage(old.id)] == [
            (date(2025, 3, 1), 42)]

        await migrate.downgrade(store.engine, "0002")
    finally:
        await store.close()

    assert await migrate.current_revision(engine) == "0002"
    tables, columns = await shape(engine)
    assert not tables & NEW_TABLES and not columns & LIMIT_COLUMNS
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT prefix, account_id FROM api_keys ORDER BY id"))).all()
    assert [tuple(r) for r in rows] == [("llmgw_old1", None), ("llmgw_old2", 1)]

    store = await open_store(empty_url)  # and up again: limits start empty
    try:
        assert [k.limits for k in await store.list_api_keys()] == [Limits(), Limits()]
        assert await store.list_usage() == []
    finally:
        await store.close()
    tables, columns = await shape(engine)
    assert tables >= NEW_TABLES and columns >= LIMIT_COLUMNS


async def test_usage_goes_with_its_key(empty_url: str) -> None:
    """The usage tables cascade from api_keys, as api_keys does from accounts."""
    store = await open_store(empty_url)
    try:
        bob = await store.add_account(AccountRecord(username="bob", password_hash="x",
                                                    role="user", created_at=T0))
        key = await store.add_api_key(ApiKeyRecord(
            prefix="llmgw_bob", secret_hash="h", name="bob's", created_at=T0,
            account_id=bob.id, limits=Limits(rpm=5)))
        assert await store.admit(key.id, key.limits, T0) is None
        await store.record_usage(key.id, "qwen", 1, 1, T0)
        async with store.engine.begin() as conn:
            await conn.execute(text("DELETE FROM accounts WHERE id = :id"), {"id": bob.id})
        assert await store.list_api_keys() == []
        assert await store.list_usage() == []
        async with store.engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM usage_windows"))).scalar() == 0
    finally:
        await store.close()
