"""Alembic environment for llmgw: one chain for SQLite and PostgreSQL, async drivers.

Two ways in:
- from code (`llmgw.store.migrate`): a live connection arrives in
  `config.attributes["connection"]` and the migration runs on it;
- by hand (`alembic upgrade head` at the repo root): the URL comes from the environment
  variable LLMGW_STORE_URL (e.g. sqlite+aiosqlite:////var/lib/llmgw/llmgw.db).
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from llmgw.store.tables import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = os.environ.get("LLMGW_STORE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit(
            "set LLMGW_STORE_URL to the store's URL, e.g. "
            "sqlite+aiosqlite:////var/lib/llmgw/llmgw.db or postgresql+asyncpg://user@host/db"
        )
    return url


def _render_item(type_: str, obj, autogen_context):
    """Write our UTC wrapper as the column type it stores, so a generated revision needs
    no import from llmgw."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=_render_item,
    )


def run_on_connection(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


async def run_with_own_engine() -> None:
    engine = create_async_engine(_url())
    try:
        async with engine.connect() as conn:
            await conn.run_sync(run_on_connection)
            await conn.commit()
    finally:
        await engine.dispose()


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
elif (given := config.attributes.get("connection")) is not None:
    run_on_connection(given)
else:
    asyncio.run(run_with_own_engine())
