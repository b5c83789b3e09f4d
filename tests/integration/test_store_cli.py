"""``llmgw store backup|restore|migrate-to-postgres`` as an operator runs them: a real
process on a real server.yaml and SQLite store, and a fresh PostgreSQL database."""

from __future__ import annotations

import hashlib
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import create_async_engine

from llmgw.config import ServerConfig, load
from llmgw.store import sqlite_url
from tests.integration.stand_ins import StandIns
from tests.integration.store_cli import ROOT, check_rows, llmgw_store, make_server

HOLDER = """
import sys
from llmgw.store.lock import hold_state_lock
with hold_state_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def rows(db: Path) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT * FROM api_keys ORDER BY id").fetchall()
    finally:
        con.close()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def lock_held_elsewhere(state_dir: Path) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(state_dir)],
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


@pytest.fixture
async def server(tmp_path: Path) -> Path:
    """A server.yaml (default SQLite store) and its store with a few rows; the config's path."""
    return await make_server(tmp_path)


@pytest.fixture
def stand_ins(tmp_path: Path, server: Path) -> Iterator[StandIns]:
    """A systemctl on PATH for which the server's unit is not running: no real unit of
    this machine is ever asked about, let alone stopped."""
    made = StandIns(tmp_path / "stand-ins", server, pg_port=0)
    yield made
    made.stop()


async def pg_tables(url: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    finally:
        await engine.dispose()


def test_backup_and_restore(server: Path, tmp_path: Path) -> None:
    dest = tmp_path / "backups" / "llmgw.db"

    done = llmgw_store("backup", dest, "--config", server)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        f"backed up sqlite+aiosqlite:///{tmp_path}/state/llmgw.db to {dest} ("
    )
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600

    again = llmgw_store("backup", dest, "--config", server)
    assert again.returncode == 1
    assert again.stderr.startswith(f"llmgw store backup: {dest} already exists")
    assert "Traceback" not in again.stderr
    assert llmgw_store("backup", dest, "--config", server, "--overwrite").returncode == 0

    restored = llmgw_store("restore", dest, "--config", server)
    assert restored.returncode == 0, restored.stderr
    assert "the database it replaced is kept as" in restored.stdout
    kept = [p for p in (tmp_path / "state").iterdir() if ".before-restore-" in p.name]
    assert len(kept) == 1
    assert rows(kept[0]) == rows(dest) == rows(tmp_path / "state" / "llmgw.db")


def test_a_missing_config_is_one_line_and_exit_1(tmp_path: Path) -> None:
    done = llmgw_store("backup", tmp_path / "b.db", "--config", tmp_path / "nope.yaml")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"llmgw store backup: {tmp_path}/nope.yaml: cannot read: No such file or directory"
    )


@pytest.mark.postgres
async def test_migrate_to_postgres(
    server: Path, tmp_path: Path, postgres_database: str, stand_ins: StandIns
) -> None:
    pg_url = postgres_database
    old_config, sqlite_file = server.read_bytes(), tmp_path / "state" / "llmgw.db"
    old_store = digest(sqlite_file)
    plain = pg_url.replace("postgresql+asyncpg://", "postgresql://")  # as libpq writes it

    # The URL from stdin (`--url -`), as a password is best given.
    done = llmgw_store("migrate-to-postgres", "--url", "-", "--config", server,
                       stdin=plain + "\n", env=stand_ins.env())

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"copied the store from {sqlite_url(sqlite_file)} to {pg_url}:"
    rows = dict(line.split() for line in lines[2:-2])
    assert rows["api_keys"] == "3" and rows["models"] == "1" and rows["settings"] == "1"
    kept = next(tmp_path.glob("server.yaml.before-postgres-*"))
    assert lines[-2] == (
        f"{server}: store.url now names PostgreSQL; the previous file is kept as {kept}"
    )
    # The unit was not running: nothing was stopped, so nothing is started.
    assert lines[-1] == (
        "the SQLite store is left as it was; start the server again, e.g. "
        "`systemctl start llmgw-server`"
    )
    assert stand_ins.calls() == [["systemctl", "is-active", "llmgw-server"]] * 2
    assert kept.read_bytes() == old_config
    assert stat.S_IMODE(server.stat().st_mode) == stat.S_IMODE(kept.stat().st_mode) == 0o640
    new_text = server.read_text()
    assert new_text.startswith(old_config.decode())  # every line kept; one block added
    assert load(server, ServerConfig).store.url == pg_url
    assert digest(sqlite_file) == old_store
    await check_rows(load(server, ServerConfig).store.url)

    twice = llmgw_store("migrate-to-postgres", "--url", pg_url, "--config", server,
                        env=stand_ins.env())
    assert twice.returncode == 1
    assert "moving one PostgreSQL store into another is not supported" in twice.stderr


@pytest.mark.postgres
async def test_refused_while_the_server_runs(
    server: Path, tmp_path: Path, postgres_database: str, stand_ins: StandIns
) -> None:
    old_config = server.read_bytes()
    dest = tmp_path / "b.db"

    # A server that is not the unit (`--service`): it cannot be stopped here.
    with lock_held_elsewhere(tmp_path / "state") as holder:
        backup = llmgw_store("backup", dest, "--config", server)
        move = llmgw_store("migrate-to-postgres", "--url", postgres_database, "--config",
                           server, env=stand_ins.env())

    stop_first = (
        f"the llmgw server using {tmp_path}/state is running (pid {holder.pid}); "
        "stop it first, e.g. `systemctl stop llmgw-server`"
    )
    # A backup is online: it runs beside the server. A move or a restore waits for it.
    assert backup.returncode == 0, backup.stderr
    assert dest.exists()
    assert move.returncode == 1
    assert move.stderr.strip() == f"llmgw store migrate-to-postgres: {stop_first}"
    assert server.read_bytes() == old_config
    assert not list(tmp_path.glob("server.yaml.*"))
    assert await pg_tables(postgres_database) == set()


@pytest.mark.postgres
def test_a_password_is_not_written_where_everyone_reads(
    server: Path, tmp_path: Path, postgres_database: str, stand_ins: StandIns
) -> None:
    server.chmod(0o644)
    with_password = postgres_database.replace("postgres@", "postgres:secret@")

    done = llmgw_store("migrate-to-postgres", "--url", with_password, "--config", server,
                       env=stand_ins.env())

    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"llmgw store migrate-to-postgres: {server} is readable by every user (mode 644) "
        f"and would hold the database password: run `chmod o-rwx {server}` (the server's "
        "group may keep reading it), then run this again"
    )
    assert "secret" not in done.stdout + done.stderr
    assert stand_ins.calls() == []
    assert not list(tmp_path.glob("server.yaml.*"))


def test_the_install_options_go_with_install(server: Path, stand_ins: StandIns) -> None:
    done = llmgw_store("migrate-to-postgres", "--url", "postgresql://db/x", "--role", "r",
                       "--port", "5433", "--config", server, env=stand_ins.env())

    assert done.returncode == 1
    assert done.stderr.strip() == (
        "llmgw store migrate-to-postgres: --role, --port: only with --install, not with --url"
    )
