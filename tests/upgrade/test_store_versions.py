"""Servers of two releases on one store, on SQLite and on PostgreSQL.

- A server of the previous release (release.py) keeps reading and writing, on the store it
  opened, while this release's server migrates that store under it: a rolling upgrade.
- This release's server starts, and restarts, on a store that a later release migrated
  (a test migration here stands in for it): it runs on it as it is, and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy.ext.asyncio import create_async_engine

from llmgw.server.auth import check_api_key, create_api_key
from llmgw.store import NodeRecord, Store, migrate, open_store, sqlite_url
from tests.upgrade import expand_contract, release


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request, tmp_path) -> str:
    """The URL of an empty store: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "llmgw.db")
    return request.getfixturevalue("postgres_database")


async def write_and_read(store: Store, who: str) -> None:
    """What a server does with its store, done once by ``who``; asserts it reads back."""
    now = datetime.now(UTC)
    await store.put_model(f"{who}-model", {"replicas": 1})
    await store.put_node(NodeRecord(id=f"{who}-node", address="127.0.0.1", state="ready",
                                    inventory={"hostname": who}, registered_at=now,
                                    last_seen_at=now, state_changed_at=now))
    key, _ = await create_api_key(store, who)
    assert (await check_api_key(store, key, now)).name == who
    assert (await store.get_model(f"{who}-model")).spec == {"replicas": 1}
    assert f"{who}-node" in {n.id for n in await store.list_nodes()}
    assert await store.next_epoch() >= 1


async def readline(stream: asyncio.StreamReader, what: str) -> dict:
    line = await asyncio.wait_for(stream.readline(), 30)
    assert line, f"the previous release's store script ended before {what}"
    return json.loads(line)


async def test_the_previous_release_works_on_while_its_store_is_migrated(store_url,
                                                                         previous_release):
    old = await asyncio.create_subprocess_exec(
        *release.prefix(previous_release), sys.executable, str(release.STORE_SCRIPT),
        "rolling", store_url, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        opened = await readline(old.stdout, "it opened the store")
        store = await open_store(store_url)  # this release's server starts: it migrates
        try:
            assert await migrate.current_revision(store.engine) == migrate.head_revision()
            assert (await check_api_key(store, opened["key"], datetime.now(UTC))).name == "old"
            await store.put_setting("written-by", "new")
            await write_and_read(store, "new")
            new_key, _ = await create_api_key(store, "new-for-old")
            old.stdin.write(f"migrated {new_key}\n".encode())
            await old.stdin.drain()
            seen = await readline(old.stdout, "it read the migrated store")
            assert seen == {
                "models": ["new-model", "old-after", "old-before"],
                "nodes": ["new-node"],
                "setting": "new",
                "new_key": "new-for-old",
                "own_key": "old",
                "epoch": 2,  # this release's write_and_read took 1
            }
            assert (await store.get_model("old-after")).spec == {"replicas": 2}
        finally:
            await store.close()
        assert await asyncio.wait_for(old.wait(), 30) == 0, await old.stderr.read()
    finally:
        with contextlib.suppress(ProcessLookupError):
            old.kill()
        await old.wait()


NEXT_RELEASE = '''\
"""A later release's migration, written by tests/upgrade: it only expands."""
import sqlalchemy as sa
from alembic import op

revision = "9001"
down_revision = {head!r}


def upgrade():
    op.add_column("nodes", sa.Column("zone", sa.String(64), nullable=True))
    op.create_table("zones", sa.Column("name", sa.String(64), primary_key=True))


def downgrade():
    op.drop_table("zones")
    op.drop_column("nodes", "zone")
'''


async def migrate_as_next_release(url: str, where: Path) -> None:
    """Migrate the store at ``url`` with this chain plus one later, expand-only revision."""
    chain = where / "migrations"
    shutil.copytree(migrate.migrations_dir(), chain,
                    ignore=shutil.ignore_patterns("__pycache__"))
    step = chain / "versions" / "9001_next_release.py"
    step.write_text(NEXT_RELEASE.format(head=migrate.head_revision()))
    assert expand_contract.contractions(expand_contract.load(step).operations) == []

    def upgrade(connection) -> None:
        config = migrate.alembic_config(connection)
        config.set_main_option("script_location", str(chain))
        command.upgrade(config, "head")

    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(upgrade)
            await conn.commit()
    finally:
        await engine.dispose()


async def test_this_release_starts_on_a_store_a_later_release_migrated(store_url, tmp_path,
                                                                       caplog):
    await migrate_as_next_release(store_url, tmp_path)
    for start in ("first", "again"):
        caplog.clear()
        store = await open_store(store_url)
        try:
            [said] = [r for r in caplog.records if r.name == "llmgw.store.migrate"]
            assert said.levelno == logging.WARNING
            assert said.getMessage().startswith(
                f"the store is at schema revision 9001, which this llmgw does not know "
                f"(its newest is {migrate.head_revision()}): a newer llmgw server migrated "
                "it"), start
            assert await migrate.current_revision(store.engine) == "9001"
            await write_and_read(store, start)
        finally:
            await store.close()
