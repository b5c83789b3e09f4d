"""The alembic chain on both backends, and what opening a store refuses."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from llmgw.store import StoreError, migrate, open_store, sqlite_url
from llmgw.store.tables import Base

TABLES = {"models", "nodes", "settings", "counters", "api_keys"}


async def table_names(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))


@pytest.fixture
async def engine(empty_url: str):
    """A bare engine (no store around it) on an empty database."""
    url = make_url(empty_url)
    if url.get_backend_name() == "sqlite":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    made = create_async_engine(url)
    try:
        yield made
    finally:
        await made.dispose()


async def test_upgrade_from_empty_creates_the_tables(engine: AsyncEngine) -> None:
    assert await migrate.current_revision(engine) is None
    assert await table_names(engine) == set()

    await migrate.upgrade(engine)

    assert await migrate.current_revision(engine) == migrate.head_revision()
    assert await table_names(engine) == TABLES | {"alembic_version"}
    async with engine.connect() as conn:
        unique = await conn.run_sync(lambda c: inspect(c).get_unique_constraints("api_keys"))
    assert [u["name"] for u in unique] == ["uq_api_keys_prefix"]


async def test_head_matches_the_table_classes(engine: AsyncEngine) -> None:
    await migrate.upgrade(engine)
    async with engine.connect() as conn:
        diff = await conn.run_sync(
            lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata)
        )
    assert diff == [], "tables.py and migrations/ disagree: add a migration"


async def test_downgrade_to_base_removes_the_tables(engine: AsyncEngine) -> None:
    await migrate.upgrade(engine)
    await migrate.downgrade(engine, "base")

    assert await migrate.current_revision(engine) is None
    assert await table_names(engine) <= {"alembic_version"}

    await migrate.upgrade(engine)  # and back up again
    assert await table_names(engine) == TABLES | {"alembic_version"}


async def test_upgrade_again_keeps_rows(empty_url: str) -> None:
    store = await open_store(empty_url)
    try:
        await store.put_model("qwen", {"replicas": 2})
        await store.put_setting("interval", 5)
        epoch = await store.next_epoch()
        await migrate.downgrade(store.engine, migrate.head_revision())  # nothing to undo
        await migrate.upgrade(store.engine)
    finally:
        await store.close()

    reopened = await open_store(empty_url)  # migrates to head once more
    try:
        assert await migrate.current_revision(reopened.engine) == migrate.head_revision()
        assert (await reopened.get_model("qwen")).spec == {"replicas": 2}
        assert await reopened.get_setting("interval") == 5
        assert await reopened.next_epoch() == epoch + 1
    finally:
        await reopened.close()


async def test_migrates_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert migrate.migrations_dir().joinpath("env.py").is_file()
    store = await open_store(sqlite_url("relative/llmgw.db"))
    try:
        assert store.url == sqlite_url(tmp_path / "relative" / "llmgw.db")
        assert store.backend == "sqlite"
    finally:
        await store.close()


async def test_sqlite_file_is_private_and_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "dir" / "llmgw.db"
    store = await open_store(sqlite_url(path))
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        async with store.engine.connect() as conn:
            assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await conn.execute(text("PRAGMA foreign_keys"))).scalar() == 1
            assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar() > 0
    finally:
        await store.close()


@pytest.mark.parametrize("url", ["mysql+aiomysql://u@h/db", "postgresql://u@h/db", "sqlite:///x"])
async def test_unknown_scheme_is_refused(url: str) -> None:
    scheme = url.split("://")[0]
    with pytest.raises(StoreError) as caught:
        await open_store(url)
    message = str(caught.value)
    assert f"scheme {scheme!r} is not supported" in message
    assert "sqlite+aiosqlite://" in message and "postgresql+asyncpg://" in message


async def test_unreachable_postgresql_names_the_url_without_password() -> None:
    with pytest.raises(StoreError) as caught:
        await open_store("postgresql+asyncpg://llmgw:hunter2@127.0.0.1:1/llmgw")
    message = str(caught.value)
    assert "postgresql+asyncpg://llmgw:***@127.0.0.1:1/llmgw" in message
    assert "hunter2" not in message
    assert "Connect call failed" in message or "refused" in message.lower()
