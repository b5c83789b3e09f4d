"""Fixtures that run every store test on both backends: a SQLite file and PostgreSQL.

PostgreSQL gets one database for the whole session (created on first use, dropped with
FORCE at the end); each test starts from clean tables, or from an empty schema.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import text

from llmgw.store import Store, open_store, sqlite_url
from llmgw.store.tables import Base
from tests.pg import (
    UNREACHABLE,
    create_database,
    drop_database,
    postgres_unavailable,
    reset_schema,
    run_blocking,
)

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgresql", id="postgresql", marks=pytest.mark.postgres),
]
# Every table of the schema, so a new one is emptied between tests without a change here.
TABLES = tuple(t.name for t in Base.metadata.sorted_tables)


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    try:
        url = run_blocking(create_database())
    except UNREACHABLE as exc:
        postgres_unavailable(exc)
    yield url
    run_blocking(drop_database(url))


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """The URL of a store on the test's backend; it may hold an earlier test's schema."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "state" / "llmgw.db")
    return request.getfixturevalue("pg_database")


@pytest.fixture
async def empty_url(backend_url: str) -> str:
    """The URL of an empty database: no tables, never migrated."""
    if backend_url.startswith("postgresql"):
        await reset_schema(backend_url)
    return backend_url


@pytest.fixture
async def store(backend_url: str) -> AsyncIterator[Store]:
    """An open store at head with empty tables."""
    opened = await open_store(backend_url)
    if opened.backend == "postgresql":
        async with opened.engine.begin() as conn:
            await conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    try:
        yield opened
    finally:
        await opened.close()
