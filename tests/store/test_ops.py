"""Store operations: backup, restore, the move to PostgreSQL, server.yaml's edit, the lock.

SQLite stores live in the test's temporary directory; each PostgreSQL test makes its own
fresh databases and drops them at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import inspect, select
from sqlalchemy.ext.asyncio import create_async_engine

from llmgw.config import ServerConfig, load
from llmgw.store import (
    AccountRecord,
    ApiKeyRecord,
    InviteRecord,
    NodeRecord,
    SessionRecord,
    Store,
    StoreError,
    open_store,
    ops,
    sqlite_url,
)
from llmgw.store.lock import hold_state_lock
from llmgw.store.pki import JoinTokenRecord, NodeCertRecord
from llmgw.store.tables import Base
from tests.pg import UNREACHABLE, create_database, drop_database, postgres_unavailable

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)
SPEC = {
    "name": "llama",
    "profiles": [{"engine": "llama.cpp", "args": ["-c", "4096"], "env": {}}],
    "ratio": 0.1,
    "big": 2**53 + 1,
    "snow ☃": 'ünïcödé "quoted" \\ back',
    "nested": {"a": [1, None, True, False, 1.5e-7]},
}


# --- helpers -----------------------------------------------------------------------------


async def populate(store: Store) -> None:
    """Rows in every table, with JSON and microsecond times worth comparing."""
    await store.put_model("llama", SPEC)
    await store.put_model("small", {"name": "small", "profiles": []})
    await store.put_node(
        NodeRecord(
            id="n1",
            address="10.0.0.1:9000",
            state="ready",
            inventory={"gpus": [{"name": "H100", "memory_mib": 81559}], "cpu": {"avx2": True}},
            registered_at=T0,
            last_seen_at=T0 + timedelta(seconds=3, microseconds=7),
        )
    )
    await store.put_node(
        NodeRecord(
            id="n2",
            address="[fe80::1]:9000",
            state="unreachable",
            inventory={},
            registered_at=T0,
            last_seen_at=T0,
            state_changed_at=T0 + timedelta(minutes=1),
        )
    )
    await store.add_join_token(JoinTokenRecord(
        token_hash="jt1", node="n3", created_at=T0, expires_at=T0 + timedelta(hours=1),
        created_by="alice"))
    await store.redeem_join_token("jt1", NodeCertRecord(
        serial="123456789012345678901234567890", node="n3", not_before=T0,
        not_after=T0 + timedelta(days=7)), T0 + timedelta(minutes=5, microseconds=9))
    await store.put_setting("null", None)
    await store.put_setting("list", [1, 2.5, "x", {"k": None}])
    await store.put_setting("text", "plain")
    await store.put_engine_build("n1", "llama.cpp", "vulkan")
    await store.take_lead("server-a", "10.0.0.1:8080", ttl_s=30)
    await store.server_alive("server-a", "10.0.0.1:8080", ttl_s=30)
    for _ in range(3):
        await store.next_epoch()
    alice = await store.add_account(
        AccountRecord(
            username="alice", password_hash="$argon2id$v=19$abc", role="admin", created_at=T0
        )
    )
    bob = await store.add_account(
        AccountRecord(
            username="bob",
            password_hash="$argon2id$v=19$def",
            role="user",
            created_at=T0,
            disabled_at=T0 + timedelta(days=1),
        )
    )
    await store.add_session(
        SessionRecord(
            token_hash="tok1", account_id=alice.id, created_at=T0, expires_at=T0 + timedelta(days=7)
        )
    )
    await store.add_invite(
        InviteRecord(
            code_hash="inv1",
            created_at=T0,
            expires_at=T0 + timedelta(days=2),
            created_by=alice.id,
            used_by=bob.id,
            used_at=T0 + timedelta(hours=1),
        )
    )
    await store.add_invite(
        InviteRecord(code_hash="inv2", created_at=T0, expires_at=T0 + timedelta(days=2))
    )
    await store.add_api_key(
        ApiKeyRecord(prefix="k1", secret_hash="h1", name="everything", created_at=T0)
    )
    await store.add_api_key(
        ApiKeyRecord(
            prefix="k2",
            secret_hash="h2",
            name="some",
            allowed_models=["llama", "small"],
            created_at=T0,
            expires_at=T0 + timedelta(days=30),
            account_id=bob.id,
        )
    )
    await store.add_api_key(
        ApiKeyRecord(
            prefix="k3", secret_hash="h3", name="revoked", allowed_models=[], created_at=T0
        )
    )
    await store.revoke_api_key("k3", T0 + timedelta(hours=2))
    limited = await store.update_api_key_limits("k2", rpm=60, tokens_per_month=10**12)
    assert await store.admit(limited.id, limited.limits, T0) is None
    await store.record_usage(limited.id, "llama", 120, 30, T0)


async def make_store(url: str) -> None:
    store = await open_store(url)
    try:
        await populate(store)
    finally:
        await store.close()


async def dump(url: str) -> dict[str, list[dict]]:
    """Every row of every table, sorted by primary key in Python (collations differ)."""
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            out = {}
            for table in Base.metadata.sorted_tables:
                rows = [dict(r) for r in (await conn.execute(select(table))).mappings()]
                pk = [c.name for c in table.primary_key.columns]
                out[table.name] = sorted(rows, key=lambda r, pk=pk: [r[c] for c in pk])
            return out
    finally:
        await engine.dispose()


async def table_names(url: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    finally:
        await engine.dispose()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> str:
    return sqlite_url(tmp_path / "state" / "llmgw.db")


@pytest.fixture
async def make_pg() -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """Make fresh, empty PostgreSQL databases; all of them are dropped at the end."""
    made: list[str] = []

    async def make() -> str:
        try:
            url = await create_database("llmgw_ops")
        except UNREACHABLE as exc:
            postgres_unavailable(exc)
        made.append(url)
        return url

    try:
        yield make
    finally:
        for url in made:
            await drop_database(url)


HOLDER = """
import sys
from llmgw.store.lock import hold_state_lock
from llmgw.store.pki import JoinTokenRecord, NodeCertRecord
with hold_state_lock(*sys.argv[1:]):
    print("held", flush=True)
    sys.stdin.read()
"""


@contextmanager
def lock_held_elsewhere(state_dir: Path, *holder: str) -> Iterator[subprocess.Popen]:
    """Another process holding the state-directory lock until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(state_dir), *holder],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


# --- backup ------------------------------------------------------------------------------


async def test_sqlite_backup_is_private_and_complete(tmp_path: Path, sqlite_store: str) -> None:
    await make_store(sqlite_store)
    dest = tmp_path / "backups" / "llmgw-1.db"

    assert await ops.backup(sqlite_store, dest) == dest

    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert os.listdir(dest.parent) == ["llmgw-1.db"], "a temporary file was left behind"
    assert await dump(sqlite_url(dest)) == await dump(sqlite_store)
    assert all(await dump(sqlite_url(dest))), "populate() must fill every table"


async def test_backup_refuses_an_existing_file_unless_told(
    tmp_path: Path, sqlite_store: str
) -> None:
    await make_store(sqlite_store)
    dest = tmp_path / "b.db"
    dest.write_text("precious")

    with pytest.raises(StoreError, match="already exists"):
        await ops.backup(sqlite_store, dest)
    assert dest.read_text() == "precious"

    await ops.backup(sqlite_store, dest, overwrite=True)
    assert await dump(sqlite_url(dest)) == await dump(sqlite_store)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600


async def test_backup_of_a_missing_store_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no SQLite store"):
        await ops.backup(sqlite_url(tmp_path / "nothing.db"), tmp_path / "b.db")
    assert not (tmp_path / "nothing.db").exists()
    assert not (tmp_path / "b.db").exists()


async def test_sqlite_backup_is_consistent_while_another_connection_writes(
    tmp_path: Path, sqlite_store: str
) -> None:
    await make_store(sqlite_store)
    path = tmp_path / "state" / "llmgw.db"
    writes, started = 3000, threading.Event()

    def writer() -> None:
        con = sqlite3.connect(path, timeout=10, isolation_level=None)
        try:
            for i in range(writes):
                con.execute(
                    "INSERT INTO settings (key, value) VALUES (?, ?)",
                    (f"w{i:05d}", json.dumps({"i": i})),
                )
                if i == 50:
                    started.set()
        finally:
            started.set()
            con.close()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert await asyncio.to_thread(started.wait, 30)
        dest = await ops.backup(sqlite_store, tmp_path / "during.db")
    finally:
        thread.join()

    con = sqlite3.connect(dest)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        keys = [
            k for (k,) in con.execute("SELECT key FROM settings WHERE key LIKE 'w%' ORDER BY key")
        ]
    finally:
        con.close()
    # A snapshot: the writes before some moment, every one of them, and none after.
    assert 51 <= len(keys) <= writes
    assert keys == [f"w{i:05d}" for i in range(len(keys))]


@pytest.mark.postgres
async def test_postgres_backup_and_restore_into_a_fresh_database(tmp_path: Path, make_pg) -> None:
    source, target = await make_pg(), await make_pg()
    await make_store(source)
    dest = tmp_path / "pg.dump"

    await ops.backup(source, dest)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["pg.dump"]
    assert dest.read_bytes().startswith(b"PGDMP")

    assert await ops.restore(target, dest) is None
    assert await dump(target) == await dump(source)

    # The sequences came along: a new key gets the next id.
    store = await open_store(target)
    try:
        key = await store.add_api_key(
            ApiKeyRecord(prefix="k4", secret_hash="h4", name="new", created_at=T0)
        )
    finally:
        await store.close()
    assert key.id == 4


@pytest.mark.postgres
async def test_postgres_restore_into_a_database_holding_a_store_is_refused(
    tmp_path: Path, make_pg
) -> None:
    source, target = await make_pg(), await make_pg()
    await make_store(source)
    dest = await ops.backup(source, tmp_path / "pg.dump")
    store = await open_store(target)
    await store.put_setting("mine", 1)
    await store.close()
    before = await dump(target)

    with pytest.raises(StoreError, match=r"already holds llmgw tables.*createdb"):
        await ops.restore(target, dest)
    assert await dump(target) == before


@pytest.mark.postgres
async def test_postgres_backup_with_a_password_never_shows_it(make_pg, tmp_path) -> None:
    url = (await make_pg()).replace("postgres@", "postgres:s3cret-pw@")
    await make_store(url)  # trust auth: the password is sent and ignored
    with pytest.raises(StoreError) as err:
        await ops.backup(url.replace("/llmgw_ops", "/nope_llmgw_ops"), tmp_path / "x.dump")
    assert "s3cret-pw" not in str(err.value)
    assert "pg_dump failed" in str(err.value)
    assert ops.mask(url).count("***") == 1 and "s3cret-pw" not in ops.mask(url)


# --- restore -----------------------------------------------------------------------------


async def test_sqlite_restore_keeps_the_database_it_replaces(
    tmp_path: Path, sqlite_store: str
) -> None:
    await make_store(sqlite_store)
    saved = await ops.backup(sqlite_store, tmp_path / "saved.db")
    store = await open_store(sqlite_store)
    await store.put_setting("after-backup", True)
    await store.close()
    changed = await dump(sqlite_store)

    kept = await ops.restore(sqlite_store, saved)

    db = tmp_path / "state" / "llmgw.db"
    assert kept is not None and kept.parent == db.parent
    assert kept.name.startswith("llmgw.db.before-restore-")
    assert await dump(sqlite_url(kept)) == changed
    assert await dump(sqlite_store) == await dump(sqlite_url(saved))
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    leftovers = {p.name for p in db.parent.iterdir()} - {"llmgw.db", kept.name}
    assert leftovers == set(), "stale WAL files or temporary directories were left"


async def test_sqlite_restore_refuses_what_is_not_a_store(
    tmp_path: Path, sqlite_store: str
) -> None:
    await make_store(sqlite_store)
    before = await dump(sqlite_store)
    other = tmp_path / "other.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    text = tmp_path / "notes.txt"
    text.write_text("not a database")

    with pytest.raises(StoreError, match="not an llmgw store"):
        await ops.restore(sqlite_store, other)
    with pytest.raises(StoreError, match="neither a SQLite database nor a pg_dump archive"):
        await ops.restore(sqlite_store, text)
    assert await dump(sqlite_store) == before
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["llmgw.db"]


async def test_sqlite_restore_of_an_older_backup_brings_it_to_head(
    tmp_path: Path, sqlite_store: str
) -> None:
    from llmgw.store import migrate

    old = tmp_path / "old.db"
    engine = create_async_engine(sqlite_url(old))
    try:
        await migrate.upgrade(engine, "0001")
    finally:
        await engine.dispose()
    await make_store(sqlite_store)

    await ops.restore(sqlite_store, old)

    assert await table_names(sqlite_store) >= set(Base.metadata.tables)
    store = await open_store(sqlite_store)
    try:
        assert await store.list_api_keys() == []
    finally:
        await store.close()


# --- SQLite to PostgreSQL ----------------------------------------------------------------


@pytest.mark.postgres
async def test_migrate_to_postgres_copies_every_row(
    tmp_path: Path, sqlite_store: str, make_pg
) -> None:
    await make_store(sqlite_store)
    pg = await make_pg()
    before = await dump(sqlite_store)

    counts = await ops.migrate_to_postgres(sqlite_store, pg)

    assert counts == {name: len(rows) for name, rows in before.items()}
    assert list(counts) == [t.name for t in Base.metadata.sorted_tables]
    assert all(counts.values()), "populate() must fill every table"
    assert await dump(pg) == before
    assert await dump(sqlite_store) == before

    store = await open_store(pg)
    try:
        key = await store.add_api_key(
            ApiKeyRecord(prefix="k4", secret_hash="h4", name="after the move", created_at=T0)
        )
        account = await store.add_account(
            AccountRecord(username="carol", password_hash="x", role="user", created_at=T0)
        )
        assert (await store.get_model("llama")).spec == SPEC
        assert await store.next_epoch() == 4
    finally:
        await store.close()
    assert key.id == 1 + max(r["id"] for r in before["api_keys"])
    assert account.id == 1 + max(r["id"] for r in before["accounts"])


@pytest.mark.postgres
async def test_migrate_refuses_a_database_holding_a_store(sqlite_store: str, make_pg) -> None:
    await make_store(sqlite_store)
    pg = await make_pg()
    store = await open_store(pg)
    await store.put_setting("theirs", {"keep": True})
    await store.close()
    before = await dump(pg)

    with pytest.raises(
        StoreError, match="already holds an llmgw store; point --url at an empty database"
    ):
        await ops.migrate_to_postgres(sqlite_store, pg)
    assert await dump(pg) == before


@pytest.mark.postgres
async def test_a_failed_move_leaves_postgres_empty_and_sqlite_alone(
    tmp_path: Path, sqlite_store: str, make_pg, monkeypatch
) -> None:
    await make_store(sqlite_store)
    pg = await make_pg()
    before, file_before = await dump(sqlite_store), digest(tmp_path / "state" / "llmgw.db")
    real = ops._copy_table
    copied: list[str] = []

    async def failing(src, dst, table):
        if table.name == "api_keys":
            raise RuntimeError("disk full, say")
        copied.append(table.name)
        return await real(src, dst, table)

    monkeypatch.setattr(ops, "_copy_table", failing)

    with pytest.raises(StoreError, match=r"disk full, say.*removed again.*is untouched"):
        await ops.migrate_to_postgres(sqlite_store, pg)

    assert copied, "the failure should come after some tables were copied"
    assert await table_names(pg) == set()
    assert await dump(sqlite_store) == before
    assert digest(tmp_path / "state" / "llmgw.db") == file_before

    monkeypatch.setattr(ops, "_copy_table", real)
    await ops.migrate_to_postgres(sqlite_store, pg)  # and it can simply be run again
    assert await dump(pg) == before


@pytest.mark.postgres
async def test_migrate_refuses_a_sqlite_store_behind_head(tmp_path: Path, make_pg) -> None:
    from llmgw.store import migrate

    old = tmp_path / "old.db"
    engine = create_async_engine(sqlite_url(old))
    try:
        await migrate.upgrade(engine, "0001")
    finally:
        await engine.dispose()
    pg = await make_pg()

    with pytest.raises(StoreError, match="start the server on it once"):
        await ops.migrate_to_postgres(sqlite_url(old), pg)
    assert await table_names(pg) == set()


# --- server.yaml -------------------------------------------------------------------------

NEW_URL = "postgresql+asyncpg://llmgw:p%40ss#w'rd\"x@db.example:5432/llmgw"
HEAD = """\
# llmgw server: managed by hand
listen:
  host: 0.0.0.0   # every interface
  port: 8080

state_dir: {state}
"""
TAIL = """\
auth:
  require_api_key: true  # keep it on
models:
  - name: m   # a comment that must survive
    profiles:
      - engine: sim
"""


def write_config(tmp_path: Path, store_block: str, mode: int = 0o640) -> Path:
    path = tmp_path / "server.yaml"
    path.write_text(HEAD.format(state=tmp_path / "state") + store_block + TAIL)
    path.chmod(mode)
    return path


def check_kept(path: Path, kept: Path, old: bytes, mode: int) -> None:
    assert kept.parent == path.parent
    assert kept.name.startswith("server.yaml.before-postgres-")
    assert kept.read_bytes() == old
    assert stat.S_IMODE(kept.stat().st_mode) == mode
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert load(path, ServerConfig).store.url == NEW_URL
    assert sorted(p.name for p in path.parent.iterdir() if p.is_file()) == sorted(
        ["server.yaml", kept.name]
    )


def test_point_config_replaces_the_url_line(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        "store:\n  # the old one\n"
        '  url: "sqlite+aiosqlite:////var/lib/llmgw/llmgw.db"   # default\n',
    )
    old = path.read_bytes()

    kept = ops.point_config_at(path, NEW_URL)

    old_lines, new_lines = old.decode().splitlines(), path.read_text().splitlines()
    changed = [i for i, (a, b) in enumerate(zip(old_lines, new_lines, strict=True)) if a != b]
    assert len(changed) == 1
    assert new_lines[changed[0]] == f"  url: {json.dumps(NEW_URL)}"
    check_kept(path, kept, old, 0o640)


def test_point_config_adds_url_under_a_store_block(tmp_path: Path) -> None:
    path = write_config(tmp_path, "store:   # set by hand later\n", mode=0o600)
    old = path.read_bytes()

    kept = ops.point_config_at(path, NEW_URL)

    expected = old.decode().replace(
        "store:   # set by hand later\n",
        f"store:   # set by hand later\n  url: {json.dumps(NEW_URL)}\n",
    )
    assert path.read_text() == expected
    check_kept(path, kept, old, 0o600)


def test_point_config_appends_a_store_block(tmp_path: Path) -> None:
    path = write_config(tmp_path, "")
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # no newline at the end, even
    old = path.read_bytes()

    kept = ops.point_config_at(path, NEW_URL)

    assert path.read_bytes() == old + f"\nstore:\n  url: {json.dumps(NEW_URL)}\n".encode()
    check_kept(path, kept, old, 0o640)


def test_with_store_url_other_shapes() -> None:
    new = json.dumps(NEW_URL)
    assert (
        ops.with_store_url("store: {}\r\nx: 1\r\n", NEW_URL)
        == f"store:\r\n  url: {new}\r\nx: 1\r\n"
    )
    folded = "store:\n    url: >-\n      sqlite+aiosqlite:////a\n      /b.db\n\n# end\nx: 1\n"
    assert ops.with_store_url(folded, NEW_URL) == f"store:\n    url: {new}\n\n# end\nx: 1\n"
    assert ops.with_store_url("", NEW_URL) == f"store:\n  url: {new}\n"
    with pytest.raises(StoreError, match="on one line"):
        ops.with_store_url('store: {url: "x"}\n', NEW_URL)


def test_point_config_puts_the_file_back_when_the_result_does_not_load(
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path, "store:\n  url: x\n")
    path.write_text(path.read_text() + "colour: blue\n")  # an unknown key: never loads
    old = path.read_bytes()

    with pytest.raises(StoreError, match=r"unknown field colour.*back as it was"):
        ops.point_config_at(path, NEW_URL)

    assert path.read_bytes() == old
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["server.yaml"]


def test_point_config_never_shows_the_password(tmp_path: Path) -> None:
    path = write_config(tmp_path, "store: {url: x}\n")
    with pytest.raises(StoreError) as err:
        ops.point_config_at(path, NEW_URL)
    assert "p%40ss" not in str(err.value)


# --- the lock ----------------------------------------------------------------------------


def test_the_lock_refuses_a_second_holder_and_names_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with lock_held_elsewhere(state) as holder:
        lock_file = state / "llmgw.lock"
        assert stat.S_IMODE(lock_file.stat().st_mode) == 0o600
        assert lock_file.read_text().split("\n")[0] == str(holder.pid)
        with pytest.raises(StoreError) as err, hold_state_lock(state):
            pass
        assert str(err.value) == (
            f"the llmgw server using {state} is running (pid {holder.pid}); stop it first, "
            "e.g. `systemctl stop llmgw-server`"
        )

    with hold_state_lock(state) as held:  # released when its holder exits
        assert held.read_text() == f"{os.getpid()}\nthe llmgw server\n"
    assert held.read_text() == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
async def test_files_keep_the_server_users_ownership(tmp_path: Path, sqlite_store: str) -> None:
    """Run as root, the commands must leave nothing the server's own user cannot open."""
    nobody = 65534
    await make_store(sqlite_store)
    state = tmp_path / "state"
    for path in (state, state / "llmgw.db"):
        os.chown(path, nobody, nobody)
    config = write_config(tmp_path, "")
    os.chown(config, nobody, nobody)
    saved = await ops.backup(sqlite_store, tmp_path / "saved.db")

    with hold_state_lock(state) as lock_file:
        assert (lock_file.stat().st_uid, lock_file.stat().st_gid) == (nobody, nobody)
        kept = await ops.restore(sqlite_store, saved)
        kept_config = ops.point_config_at(config, NEW_URL)

    for path in (state / "llmgw.db", kept, config, kept_config):
        assert (path.stat().st_uid, path.stat().st_gid) == (nobody, nobody), path


def test_a_server_is_told_which_command_holds_the_lock(tmp_path: Path) -> None:
    with (
        lock_held_elsewhere(tmp_path, "`llmgw store restore`") as holder,
        pytest.raises(StoreError) as err,
        hold_state_lock(tmp_path),
    ):
        pass
    assert str(err.value) == (
        f"`llmgw store restore` is using {tmp_path} (pid {holder.pid}); wait for it to "
        "finish, then try again"
    )
