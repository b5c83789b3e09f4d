"""A throwaway PostgreSQL database for tests, on the server at 127.0.0.1:5432.

Reusable by any test package:

    url = await create_database()   # postgresql+asyncpg://postgres@127.0.0.1:5432/llmgw_test_...
    ...
    await drop_database(url)

Where PostgreSQL cannot be reached, call `postgres_unavailable(exc)`: it skips the test on
a developer's machine and fails it in CI (CI=true), where PostgreSQL is required.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import asyncpg
import pytest
from sqlalchemy.engine import make_url

# Override with LLMGW_TEST_PG_ADMIN_DSN to point the tests at another server.
ADMIN_DSN = os.environ.get(
    "LLMGW_TEST_PG_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)
CONNECT_TIMEOUT_S = 5

# What "PostgreSQL is not there" looks like: refused, timed out, or refused us.
UNREACHABLE: tuple[type[BaseException], ...] = (OSError, asyncpg.PostgresError)

T = TypeVar("T")


def postgres_required() -> bool:
    """True in CI, where a missing PostgreSQL is a failure rather than a skip."""
    return os.environ.get("CI", "").strip().lower() == "true"


def postgres_unavailable(exc: BaseException) -> NoReturn:
    """Skip (developer machine) or fail (CI=true) because PostgreSQL cannot be reached."""
    reason = f"PostgreSQL at {ADMIN_DSN} is not reachable: {exc}"
    if postgres_required():
        pytest.fail(f"PostgreSQL is required in CI (CI=true). {reason}", pytrace=False)
    pytest.skip(reason)


async def create_database(prefix: str = "llmgw_test") -> str:
    """Create a fresh, empty database and return its SQLAlchemy asyncpg URL."""
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
    conn = await asyncpg.connect(ADMIN_DSN, timeout=CONNECT_TIMEOUT_S)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    url = make_url(ADMIN_DSN).set(drivername="postgresql+asyncpg", database=name)
    return url.render_as_string(hide_password=False)


async def drop_database(url: str) -> None:
    """Drop the database `url` names, closing any connections still open to it."""
    name = make_url(url).database
    conn = await asyncpg.connect(ADMIN_DSN, timeout=CONNECT_TIMEOUT_S)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def as_admin(*statements: str) -> None:
    """Run ``statements`` in order as the PostgreSQL admin (ADMIN_DSN)."""
    conn = await asyncpg.connect(ADMIN_DSN, timeout=CONNECT_TIMEOUT_S)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def close_database(name: str) -> None:
    """The database refuses new connections and its sessions are ended: to a server, its
    store stopped answering. ``open_database`` undoes it."""
    run_blocking(as_admin(
        f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false',
        f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"))


def open_database(name: str) -> None:
    run_blocking(as_admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))


async def reset_schema(url: str) -> None:
    """Empty the database: drop and recreate its public schema."""
    conn = await asyncpg.connect(_asyncpg_dsn(url), timeout=CONNECT_TIMEOUT_S)
    try:
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    finally:
        await conn.close()


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion from sync code (e.g. a session fixture), on its own loop in
    its own thread, so it never touches the event loop pytest-asyncio gives the tests."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _asyncpg_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
