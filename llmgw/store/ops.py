"""Operations on a whole store: backup, restore, and the move from SQLite to PostgreSQL.

Restore and the move run with the server stopped: the caller holds the state-directory
lock (`llmgw.store.lock`) for the whole operation, so nothing writes while they run. A
backup is online: SQLite's backup API and pg_dump each take a consistent snapshot while
the server writes.

Files that hold the store (a backup, a restored database) are written into a private
temporary directory (mkdtemp, 0700) beside their destination, made 0600, synced, and only
then renamed into place: a half-written or world-readable copy never exists under the
final name, nor anywhere another user could open it.

The tables are never named here: every step walks `Base.metadata.sorted_tables` (parents
before children), so a table added by a later migration is carried along with no change.
A password in a URL never reaches a message or a log: URLs are shown masked (`***`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import sqlite3
from pathlib import Path
from typing import Any

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util import CommandError
from sqlalchemy import Integer, Table, event, func, insert, inspect, select, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from llmgw.store import StoreError, migrate, open_store, sqlite_url
from llmgw.store.config_edit import (
    check_editable,
    point_config_at,
    put_config_back,
    with_store_url,
)
from llmgw.store.files import (
    chown_like,
    create_private,
    fsync_dir,
    fsync_file,
    private_dir,
    publish,
    stamp,
    unique,
)
from llmgw.store.tables import Base
from llmgw.store.urls import (
    asyncpg_url,
    backend,
    libpq,
    mask,
    mask_text,
    parse,
    shown,
    sqlite_path,
    words,
)

log = logging.getLogger(__name__)

# What `llmgw store` calls, in one place.
__all__ = [
    "asyncpg_url", "backend", "backup", "check_editable", "check_move", "drop_store", "mask",
    "mask_text", "migrate_to_postgres", "point_config_at", "put_config_back", "restore",
    "with_store_url",
]

COPY_BATCH_ROWS = 1000
SQLITE_BUSY_TIMEOUT_S = 10.0
PG_CONNECT_TIMEOUT_S = 10
ALEMBIC_TABLE = "alembic_version"
SQLITE_MAGIC = b"SQLite format 3\x00"
PG_DUMP_MAGIC = b"PGDMP"


# --- backup ----------------------------------------------------------------------------


async def backup(url: str, dest: Path, *, overwrite: bool = False) -> Path:
    """Write a consistent snapshot of the store at `url` to `dest` (0600); returns dest.

    SQLite: a copy made with SQLite's online backup API. PostgreSQL: a `pg_dump` archive
    in its custom format, without owners. `dest` is only ever the complete file.
    """
    parsed = parse(url)
    dest = Path(dest).expanduser().absolute()
    if dest.is_dir():
        raise StoreError(f"{dest} is a directory; give the backup file's path")
    if dest.exists() and not overwrite:
        raise StoreError(f"{dest} already exists; choose another path, or overwrite it")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise StoreError(f"cannot make the directory {dest.parent}: {exc.strerror}") from exc
    with private_dir(dest.parent, "backup") as tmp:
        part = tmp / dest.name
        if parsed.get_backend_name() == "sqlite":
            await asyncio.to_thread(_sqlite_copy, sqlite_path(parsed), part)
        else:
            await _pg_dump(parsed, part)
        publish(part, dest)
    log.info("backed up %s to %s", shown(parsed), dest)
    return dest


def _sqlite_copy(src: Path, part: Path) -> None:
    """Copy the SQLite database `src` to the new file `part` (0600) with the online backup
    API: one read transaction, so writers elsewhere see no lock and the copy is a snapshot.
    The copy is left in rollback-journal mode, one self-contained file."""
    if not src.is_file():
        raise StoreError(f"there is no SQLite store at {src}")
    os.close(create_private(part))
    try:
        source = sqlite3.connect(src, timeout=SQLITE_BUSY_TIMEOUT_S)
        try:
            source.execute("PRAGMA query_only=ON")
            copy = sqlite3.connect(part)
            try:
                source.backup(copy)
                copy.execute("PRAGMA journal_mode=DELETE")
                verdict = copy.execute("PRAGMA quick_check").fetchone()[0]
            finally:
                copy.close()
        finally:
            source.close()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot copy the SQLite database {src}: {exc}") from exc
    if verdict != "ok":
        raise StoreError(f"the copy of {src} failed SQLite's check: {verdict}")


async def _pg_dump(url: URL, part: Path) -> None:
    dsn, env = libpq(url)
    fd = create_private(part)
    try:
        await _run_tool(
            "pg_dump", ["--format=custom", "--no-owner", f"--dbname={dsn}"], env, url, stdout=fd
        )
        os.fsync(fd)
    finally:
        os.close(fd)
    if ALEMBIC_TABLE not in await _archive_tables(part):
        raise StoreError(
            f"the database {shown(url)} holds no llmgw store (no {ALEMBIC_TABLE} "
            "table); is store.url the server's?"
        )


# --- restore ---------------------------------------------------------------------------


async def restore(url: str, src: Path) -> Path | None:
    """Put the backup `src` in place as the store at `url`, then migrate it to head.

    SQLite: the database it replaces is kept beside it as
    `<db>.before-restore-<UTC time>`, which is returned. PostgreSQL: the database must
    hold no llmgw tables; returns None.
    """
    parsed = parse(url)
    src = Path(src).expanduser().absolute()
    if not src.is_file():
        raise StoreError(f"{src} is not a file")
    kind = _backup_kind(src)
    want = parsed.get_backend_name()
    if kind != want:
        what = {"sqlite": "a SQLite database", "postgresql": "a pg_dump archive"}.get(
            kind, "neither a SQLite database nor a pg_dump archive"
        )
        raise StoreError(f"{src} is {what}; the store at {shown(parsed)} needs a {want} backup")
    kept = None
    if want == "sqlite":
        kept = await _restore_sqlite(parsed, src)
    else:
        await _restore_pg(parsed, src)
    store = await open_store(url)  # brings an older backup up to this llmgw's schema
    await store.close()
    log.info("restored %s into %s", src, shown(parsed))
    return kept


def _backup_kind(path: Path) -> str | None:
    with path.open("rb") as f:
        head = f.read(len(SQLITE_MAGIC))
    if head == SQLITE_MAGIC:
        return "sqlite"
    if head.startswith(PG_DUMP_MAGIC):
        return "postgresql"
    return None


async def _restore_sqlite(url: URL, src: Path) -> Path | None:
    db = sqlite_path(url)
    try:
        db.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise StoreError(f"cannot make the directory {db.parent}: {exc.strerror}") from exc
    with private_dir(db.parent, "restore") as tmp:
        part = tmp / db.name
        await asyncio.to_thread(_sqlite_copy, src, part)
        await asyncio.to_thread(_check_sqlite_store, part, src)
        # Migrate the copy before it goes in place: a backup this llmgw cannot bring up to
        # date never replaces the working database.
        store = await open_store(sqlite_url(part))
        await store.close()
        await asyncio.to_thread(_check_sqlite_tables, part, src)
        await asyncio.to_thread(_sqlite_rollback_mode, part)
        # The server may run as another user than this command (root, say): the new file
        # gets the owner of the one it replaces, or of the directory.
        chown_like(part, (db if db.exists() else db.parent).stat())
        fsync_file(part)
        kept = _set_aside(db, "before-restore") if db.exists() else None
        try:
            os.replace(part, db)
        except OSError as exc:
            if kept is not None:
                os.replace(kept, db)
            raise StoreError(f"cannot put the restored database at {db}: {exc}") from exc
        fsync_dir(db.parent)
    return kept


def _check_sqlite_store(path: Path, shown_as: Path) -> None:
    """An llmgw store: an alembic_version this llmgw knows, and at least one of our tables."""
    try:
        con = sqlite3.connect(path)
        try:
            names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            revisions = (
                [r[0] for r in con.execute(f"SELECT version_num FROM {ALEMBIC_TABLE}")]
                if ALEMBIC_TABLE in names
                else []
            )
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read {shown_as}: {exc}") from exc
    if ALEMBIC_TABLE not in names or not names & set(Base.metadata.tables):
        raise StoreError(f"{shown_as} is a SQLite database but not an llmgw store")
    _check_known_revision(revisions, str(shown_as))


def _check_sqlite_tables(path: Path, shown_as: Path) -> None:
    con = sqlite3.connect(path)
    try:
        names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        con.close()
    missing = sorted(set(Base.metadata.tables) - names)
    if missing:
        raise StoreError(f"{shown_as} lacks the llmgw tables {', '.join(missing)}")


def _check_known_revision(revisions: list[str], shown_as: str) -> None:
    if len(revisions) != 1:
        raise StoreError(
            f"{shown_as} has no single schema revision ({revisions}); is it an llmgw store?"
        )
    scripts = ScriptDirectory.from_config(migrate.alembic_config())
    try:
        known = scripts.get_revision(revisions[0]) is not None
    except (CommandError, RevisionError):  # an unknown or ambiguous id
        known = False
    if not known:
        raise StoreError(
            f"{shown_as} is at schema revision {revisions[0]!r}, which this llmgw "
            "does not know: it was made by a newer llmgw; upgrade llmgw first"
        )


def _sqlite_rollback_mode(path: Path) -> None:
    """Fold any WAL back into the file, so the one file is the whole database."""
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA journal_mode=DELETE")
    finally:
        con.close()


def _set_aside(db: Path, why: str) -> Path:
    """Rename `db` to `<db>.<why>-<UTC time>`; its WAL, if one is left, goes with it (as
    `<kept>-wal`, where SQLite looks for it), and its -shm index is dropped."""
    kept = unique(db.with_name(f"{db.name}.{why}-{stamp()}"))
    os.rename(db, kept)
    wal, shm = Path(f"{db}-wal"), Path(f"{db}-shm")
    if wal.exists():
        if wal.stat().st_size > 0:
            os.rename(wal, Path(f"{kept}-wal"))
        else:
            wal.unlink()
    shm.unlink(missing_ok=True)
    return kept


async def _restore_pg(url: URL, src: Path) -> None:
    if ALEMBIC_TABLE not in await _archive_tables(src):
        raise StoreError(f"{src} is a pg_dump archive but not of an llmgw store")
    present = await _pg_store_tables(url)
    if present:
        name = url.database or "<database>"
        raise StoreError(
            f"the database {shown(url)} already holds llmgw tables "
            f"({', '.join(sorted(present))}); restore only into an empty database. Make "
            f"one with `createdb -O {url.username or '<user>'} {name}` (after "
            f"`dropdb {name}` if this one may go), then run the restore again"
        )
    dsn, env = libpq(url)
    await _run_tool(
        "pg_restore",
        [
            "--no-owner",
            "--no-privileges",
            "--exit-on-error",
            "--single-transaction",
            f"--dbname={dsn}",
            str(src),
        ],
        env,
        url,
    )


async def _archive_tables(path: Path) -> set[str]:
    """The tables a pg_dump archive holds, from its table of contents."""
    listing = await _run_tool("pg_restore", ["--list", str(path)], dict(os.environ), None)
    return set(re.findall(r"^\d+; \d+ \d+ TABLE (?!DATA )\S+ (\S+) ", listing, re.M))


# --- SQLite to PostgreSQL ----------------------------------------------------------------


async def migrate_to_postgres(sqlite_url: str, pg_url: str) -> dict[str, int]:
    """Copy every row of the SQLite store into an empty PostgreSQL database; returns the
    rows per table, parents first.

    The PostgreSQL schema is made by the migration chain, the rows go in in one
    transaction, and the sequences are moved past the copied ids. On any failure what was
    made in PostgreSQL is dropped again. The SQLite store is only read.
    """
    src_url, dst_url = parse(sqlite_url, "sqlite"), parse(pg_url, "postgresql")
    src_path = _sqlite_source(src_url)
    await _check_empty(dst_url)
    source = _sqlite_reader(src_url)
    try:
        async with source.connect() as src:
            await _check_source_at_head(src, src_path)
            try:
                await _make_schema(pg_url)
                counts = await _copy_all(src, dst_url)
            except Exception as exc:
                undo = await _undo(dst_url)
                reason = exc if isinstance(exc, StoreError) else words(exc, dst_url)
                raise StoreError(
                    f"moving the store to {shown(dst_url)} failed: {reason}; {undo}; "
                    f"the SQLite store {src_path} is untouched"
                ) from exc
            except BaseException:
                await asyncio.shield(_undo(dst_url))
                raise
    except (DBAPIError, OSError) as exc:
        raise StoreError(f"cannot read the SQLite store {src_path}: {words(exc)}") from exc
    finally:
        await source.dispose()
    log.info("copied %d rows from %s to %s", sum(counts.values()), src_path, shown(dst_url))
    return counts


async def check_move(sqlite_url: str, pg_url: str) -> None:
    """Refuse, before anything stops, what `migrate_to_postgres` would: no SQLite store, or
    one at another schema revision; a PostgreSQL that cannot be logged into, or that
    already holds an llmgw store."""
    src_url, dst_url = parse(sqlite_url, "sqlite"), parse(pg_url, "postgresql")
    src_path = _sqlite_source(src_url)
    source = _sqlite_reader(src_url)
    try:
        async with source.connect() as src:
            await _check_source_at_head(src, src_path)
    except (DBAPIError, OSError) as exc:
        raise StoreError(f"cannot read the SQLite store {src_path}: {words(exc)}") from exc
    finally:
        await source.dispose()
    await _check_empty(dst_url)


def _sqlite_source(url: URL) -> Path:
    path = sqlite_path(url)
    if not path.is_file():
        raise StoreError(f"there is no SQLite store at {path}")
    return path


async def _check_empty(url: URL) -> None:
    present = await _pg_store_tables(url)
    if present:
        raise StoreError(
            f"the PostgreSQL database {shown(url)} already holds an llmgw store; point "
            f"--url at an empty database (it has {', '.join(sorted(present))})"
        )


async def drop_store(pg_url: str) -> None:
    """Drop every llmgw table and alembic_version from the PostgreSQL database."""
    url = parse(pg_url, "postgresql")
    engine = _pg_engine(url)
    try:
        try:
            # The chain's own downgrade also removes what is not a table (types, indexes).
            await migrate.downgrade(engine, "base")
        except (SQLAlchemyError, OSError):
            log.warning(
                "downgrading %s failed; dropping the tables instead", shown(url), exc_info=True
            )
        async with engine.begin() as conn:
            quote = conn.dialect.identifier_preparer.quote
            for table in reversed(Base.metadata.sorted_tables):
                await conn.execute(text(f"DROP TABLE IF EXISTS {quote(table.name)} CASCADE"))
            await conn.execute(text(f"DROP TABLE IF EXISTS {ALEMBIC_TABLE}"))
    except (DBAPIError, OSError) as exc:
        raise StoreError(
            f"cannot drop the llmgw tables in {shown(url)}: {words(exc, url)}"
        ) from exc
    finally:
        await engine.dispose()


async def _make_schema(pg_url: str) -> None:
    store = await open_store(pg_url)
    await store.close()


async def _undo(url: URL) -> str:
    """Drop what a failed move made; says how that went, for the error message."""
    try:
        await drop_store(url.render_as_string(hide_password=False))
    except StoreError as exc:
        names = ", ".join([ALEMBIC_TABLE, *(t.name for t in Base.metadata.sorted_tables)])
        return (
            f"removing what it made there failed too ({exc}); drop the tables {names} "
            "by hand before trying again"
        )
    return "what it had made in PostgreSQL was removed again"


def _sqlite_reader(url: URL) -> AsyncEngine:
    """An engine that can only read (query_only), in one transaction per connection."""
    engine = create_async_engine(url)

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA query_only=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.close()

    event.listen(engine.sync_engine, "connect", on_connect)
    event.listen(engine.sync_engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN"))
    return engine


def _pg_engine(url: URL) -> AsyncEngine:
    connect_args = {} if "timeout" in url.query else {"timeout": PG_CONNECT_TIMEOUT_S}
    return create_async_engine(url, connect_args=connect_args)


async def _pg_store_tables(url: URL) -> set[str]:
    """Which of our tables (alembic_version included) the database already has."""
    ours = {*Base.metadata.tables, ALEMBIC_TABLE}
    engine = _pg_engine(url)
    try:
        async with engine.connect() as conn:
            names = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    except (DBAPIError, OSError) as exc:
        raise StoreError(
            f"cannot connect to PostgreSQL at {shown(url)}: {words(exc, url)}"
        ) from exc
    finally:
        await engine.dispose()
    return names & ours


async def _check_source_at_head(src: AsyncConnection, path: Path) -> None:
    revision = await src.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
    head = migrate.head_revision()
    if revision is None:
        raise StoreError(f"{path} is not an llmgw store (it has no schema revision)")
    if revision not in migrate.known_revisions():
        raise StoreError(
            f"the SQLite store {path} is at schema revision {revision}, which this llmgw "
            f"(at {head}) does not know: a newer llmgw migrated it; run the move with that "
            "llmgw"
        )
    if revision != head:
        raise StoreError(
            f"the SQLite store {path} is at schema revision {revision}, this llmgw's is "
            f"{head}: start the server on it once (it upgrades the store), stop it, and "
            "run this again"
        )


async def _copy_all(src: AsyncConnection, dst_url: URL) -> dict[str, int]:
    engine = _pg_engine(dst_url)
    try:
        async with engine.begin() as dst:
            counts = {t.name: await _copy_table(src, dst, t) for t in Base.metadata.sorted_tables}
            await _bump_sequences(dst)
            for table in Base.metadata.sorted_tables:
                want = await src.scalar(select(func.count()).select_from(table))
                got = await dst.scalar(select(func.count()).select_from(table))
                if not want == got == counts[table.name]:
                    raise StoreError(
                        f"table {table.name}: {want} rows in SQLite, "
                        f"{counts[table.name]} copied, {got} in PostgreSQL"
                    )
    finally:
        await engine.dispose()
    return counts


async def _copy_table(src: AsyncConnection, dst: AsyncConnection, table: Table) -> int:
    """Copy every row of `table`, in batches, in primary-key order; returns how many."""
    result = await src.stream(select(table).order_by(*table.primary_key.columns))
    copied = 0
    async for batch in result.mappings().partitions(COPY_BATCH_ROWS):
        await dst.execute(insert(table), [dict(row) for row in batch])
        copied += len(batch)
    return copied


async def _bump_sequences(dst: AsyncConnection) -> None:
    """Set each integer primary key's sequence so its next value is max(id) + 1."""
    quote = dst.dialect.identifier_preparer.quote
    for table in Base.metadata.sorted_tables:
        for column in table.primary_key.columns:
            if not isinstance(column.type, Integer):
                continue
            sequence = await dst.scalar(
                text("SELECT pg_get_serial_sequence(:table, :column)"),
                {"table": quote(table.name), "column": column.name},
            )
            if sequence is None:
                continue
            await dst.execute(
                text(
                    f"SELECT setval(CAST(:sequence AS regclass), "
                    f"COALESCE((SELECT max({quote(column.name)}) FROM {quote(table.name)}), 0)"
                    " + 1, false)"
                ),
                {"sequence": sequence},
            )


async def _run_tool(
    name: str, args: list[str], env: dict[str, str], url: URL | None, stdout: int | None = None
) -> str:
    """Run pg_dump or pg_restore; its stdout (unless sent to `stdout`), or StoreError with
    the end of what it printed."""
    binary = shutil.which(name)
    if binary is None:
        raise StoreError(
            f"{name} is not installed; install the PostgreSQL client tools of "
            "the server's major version or newer (e.g. apt install "
            "postgresql-client)"
        )
    proc = await asyncio.create_subprocess_exec(
        binary,
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE if stdout is None else stdout,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        said = err.decode("utf-8", "replace").strip().splitlines()[-5:]
        detail = mask_text(" / ".join(said), *([url] if url else []))
        raise StoreError(f"{name} failed (exit {proc.returncode}): {detail or 'no message'}")
    return (out or b"").decode("utf-8", "replace")
