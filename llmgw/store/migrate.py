"""Run the alembic chain from code: `open_store` upgrades to head on every start.

A store at a revision this chain does not have was migrated by a newer llmgw: it is left
as it is and the server runs on it, logging so. Migrations are expand-then-contract
(docs/development.md), so a server of the release before keeps working on such a store
until it is replaced, and may restart meanwhile.

No alembic.ini is read, so this works from any working directory and from an installed
wheel, where the chain ships inside the package as `llmgw/_migrations`. In a checkout it
is `<repo root>/migrations`.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)


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
    """Upgrade the database to `revision`; a database already there, or at a revision
    newer than this chain knows, is left untouched."""
    async with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK}
            )
        await conn.run_sync(_upgrade_unless_newer, revision)
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


def known_revisions() -> set[str]:
    """Every revision of this llmgw's chain."""
    script = ScriptDirectory.from_config(alembic_config())
    return {s.revision for s in script.walk_revisions()}


def _upgrade_unless_newer(sync_conn: Connection, revision: str) -> None:
    config = alembic_config(sync_conn)
    current = MigrationContext.configure(sync_conn).get_current_revision()
    script = ScriptDirectory.from_config(config)
    if current is not None and current not in {s.revision for s in script.walk_revisions()}:
        log.warning(
            "the store is at schema revision %s, which this llmgw does not know (its "
            "newest is %s): a newer llmgw server migrated it. Running on it as it is; "
            "upgrade this server to the release the other servers run",
            current, script.get_current_head())
        return
    command.upgrade(config, revision)
