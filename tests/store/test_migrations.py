"""The alembic chain on both backends, and what opening a store refuses."""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from llmgw.store import StoreError, migrate, open_store, sqlite_url
from llmgw.store.tables import Base

TABLES_0001 = {"models", "nodes", "settings", "counters", "api_keys"}
TABLES_0002 = TABLES_0001 | {"accounts", "sessions", "invites"}
TABLES = TABLES_0002 | {"usage_windows", "usage_days", "join_tokens", "node_certs", "leases",
                        "engine_builds"}
T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


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


async def test_foreign_keys_cascade_or_set_null(engine: AsyncEngine) -> None:
    await migrate.upgrade(engine)

    def foreign_keys(sync_conn) -> dict[str, tuple]:
        found = {}
        for table in ("api_keys", "sessions", "invites"):
            for fk in inspect(sync_conn).get_foreign_keys(table):
                found[fk["name"]] = (
                    table,
                    fk["constrained_columns"],
                    fk["referred_table"],
                    fk["referred_columns"],
                    fk["options"].get("ondelete"),
                )
        return found

    async with engine.connect() as conn:
        found = await conn.run_sync(foreign_keys)
    assert found == {
        "fk_api_keys_account_id_accounts": (
            "api_keys",
            ["account_id"],
            "accounts",
            ["id"],
            "CASCADE",
        ),
        "fk_sessions_account_id_accounts": (
            "sessions",
            ["account_id"],
            "accounts",
            ["id"],
            "CASCADE",
        ),
        "fk_invites_created_by_accounts": (
            "invites",
            ["created_by"],
            "accounts",
            ["id"],
            "SET NULL",
        ),
        "fk_invites_used_by_accounts": ("invites", ["used_by"], "accounts", ["id"], "SET NULL"),
    }


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


async def test_upgrade_from_0001_with_rows_in_it(empty_url: str, engine: AsyncEngine) -> None:
    """A store made by 0001 and in use: the upgrade keeps every row, the downgrade too."""
    pg = engine.dialect.name == "postgresql"
    when = T0 if pg else T0.replace(tzinfo=None).isoformat(" ")  # how each stores it
    await migrate.upgrade(engine, "0001")
    async with engine.begin() as conn:
        for sql, values in [
            (
                "INSERT INTO models (name, spec, created_at, updated_at)"
                " VALUES ('qwen', :spec, :t, :t)",
                {"spec": '{"replicas": 2}'},
            ),
            (
                "INSERT INTO nodes (id, address, state, inventory, registered_at, last_seen_at)"
                " VALUES ('gpu-1', 'gpu-1.lan:7000', 'ready', :inv, :t, :t)",
                {"inv": '{"cpus": 64}'},
            ),
            ("INSERT INTO settings (key, value) VALUES ('interval', '5')", {}),
            (
                "INSERT INTO api_keys (prefix, secret_hash, name, allowed_models, created_at)"
                " VALUES ('llmgw_old1', 'hash1', 'up', NULL, :t),"
                " ('llmgw_old2', 'hash2', 'ci', :allowed, :t)",
                {"allowed": '["qwen"]'},
            ),
        ]:
            await conn.execute(text(sql), {"t": when, **values} if ":t" in sql else values)

    store = await open_store(empty_url)  # upgrades 0001 -> head, as a server start does
    try:
        assert await migrate.current_revision(store.engine) == migrate.head_revision()
        assert (await store.get_model("qwen")).spec == {"replicas": 2}
        assert (await store.get_model("qwen")).created_at == T0
        assert (await store.get_node("gpu-1")).inventory == {"cpus": 64}
        assert await store.get_setting("interval") == 5
        keys = await store.list_api_keys()
        assert [(k.prefix, k.secret_hash, k.allowed_models) for k in keys] == [
            ("llmgw_old1", "hash1", None),
            ("llmgw_old2", "hash2", ["qwen"]),
        ]
        assert [k.account_id for k in keys] == [None, None]
        assert keys[0].created_at == T0
        new = msgspec.structs.replace(keys[0], id=None, prefix="llmgw_new1")
        key = await store.add_api_key(new)
        assert key.id == 3  # the id sequence carried on past the old rows

        await migrate.downgrade(store.engine, "0001")
    finally:
        await store.close()

    assert await migrate.current_revision(engine) == "0001"
    assert await table_names(engine) == TABLES_0001 | {"alembic_version"}
    async with engine.connect() as conn:
        columns = await conn.run_sync(lambda c: inspect(c).get_columns("api_keys"))
        counts = {
            table: (await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar()
            for table in ("models", "nodes", "settings", "api_keys")
        }
        prefixes = (await conn.execute(text("SELECT prefix FROM api_keys ORDER BY id"))).all()
    assert "account_id" not in {c["name"] for c in columns}
    assert counts == {"models": 1, "nodes": 1, "settings": 1, "api_keys": 3}
    assert [p for (p,) in prefixes] == ["llmgw_old1", "llmgw_old2", "llmgw_new1"]


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
