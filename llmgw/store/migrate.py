"""Run the alembic chain from code: `open_store` upgrades to head on every start.

No alembic.ini is read, so this works from any working directory and from an installed
wheel, where the chain ships inside the package as `llmgw/_migrations`. In a checkout it
is `<repo root>/migrations`.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncEngine

# Two servers starting at once on one PostgreSQL must not both create the tables: the
# upgrade runs under this transaction-scoped advisory lock (an arbitrary, fixed key).
_PG_MIGRATION_LOCK = 0x6C6C6D67_6D696772


def migrations_dir() -> Path:
    """The packaged chain if this is an installed wheel, else the checkout's."""
    packaged = Path(__file__).resolve().parent.parent / "_migrations"
    if (packaged / "env.py").is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(connection: Connection | None = None) -> Config:
    """An in-memory alembic Config; `connection` is handed to env.py to migrate on."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()).replace("%", "%%"))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest revision in the chain."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {migrations_dir()}")
    return head


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Upgrade the database to `revision`; a database already there is left untouched."""
    async with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK}
            )
        await conn.run_sync(_run, command.upgrade, revision)
        await conn.commit()


async def downgrade(engine: AsyncEngine, revision: str = "base") -> None:
    """Downgrade to `revision` ("base" drops every table the chain made)."""
    async with engine.connect() as conn:
        await conn.run_sync(_run, command.downgrade, revision)
        await conn.commit()


async def current_revision(engine: AsyncEngine) -> str | None:
    """The revision the database is at; None for a database never migrated."""
    async with engine.connect() as conn:
        return await conn.run_sync(
            lambda sync_conn: MigrationContext.configure(sync_conn).get_current_revision()
        )


def _run(sync_conn: Connection, action, revision: str) -> None:
    action(alembic_config(sync_conn), revision)
