"""``llmgw store backup|restore|migrate-to-postgres`` as an operator runs them: a real
process on a real server.yaml and SQLite store, and a fresh PostgreSQL database."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import create_async_engine

from llmgw.config import ServerConfig, load
from llmgw.store import ApiKeyRecord, open_store, sqlite_url
from tests.pg import UNREACHABLE, create_database, drop_database, postgres_unavailable

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 3, 4, 5, 6, 7, 891011, tzinfo=UTC)
CONFIG = """\
# the server's configuration; this comment must survive the move
listen:
  port: 8080   # the API

state_dir: {state}
auth:
  require_api_key: true
"""
# Until `llmgw store` is wired into llmgw/cli/main.py, run it through add_parser alone.
SHIM = """
import argparse, sys
from llmgw.cli import store
top = argparse.ArgumentParser(prog="llmgw")
store.add_parser(top.add_subparsers(dest="command", required=True))
args = top.parse_args()
sys.exit(args.func(args))
"""
HOLDER = """
import sys
from llmgw.store.lock import hold_state_lock
with hold_state_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def _wired() -> bool:
    from llmgw.cli.main import parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parser().parse_args(["store", "backup", "x"])
    except SystemExit:
        return False
    return True


ENTRY = ["-m", "llmgw"] if _wired() else ["-c", SHIM]


def llmgw_store(*args: str | os.PathLike, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *ENTRY, "store", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        input=stdin,
        env={**os.environ, "COLUMNS": "120"},
    )


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
    state = tmp_path / "state"
    config = tmp_path / "server.yaml"
    config.write_text(CONFIG.format(state=state))
    config.chmod(0o640)
    store = await open_store(sqlite_url(state / "llmgw.db"))
    try:
        await store.put_model("m", {"name": "m", "profiles": [{"engine": "sim"}], "x": 0.1})
        await store.put_setting("s", {"nested": [1, None]})
        for i in range(3):
            await store.add_api_key(
                ApiKeyRecord(
                    prefix=f"k{i}",
                    secret_hash=f"h{i}",
                    name=f"key {i}",
                    created_at=T0,
                    allowed_models=["m"] if i else None,
                )
            )
    finally:
        await store.close()
    return config


@pytest.fixture
async def pg_url() -> str:
    try:
        url = await create_database("llmgw_cli")
    except UNREACHABLE as exc:
        postgres_unavailable(exc)
    try:
        yield url
    finally:
        await drop_database(url)


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
async def test_migrate_to_postgres(server: Path, tmp_path: Path, pg_url: str) -> None:
    old_config, sqlite_file = server.read_bytes(), tmp_path / "state" / "llmgw.db"
    old_store = digest(sqlite_file)
    plain = pg_url.replace("postgresql+asyncpg://", "postgresql://")  # as libpq writes it

    # The URL from stdin (`--url -`), as a password is best given.
    done = llmgw_store("migrate-to-postgres", "--url", "-", "--config", server, stdin=plain + "\n")

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"copied the store from {sqlite_url(sqlite_file)} to {pg_url}:"
    rows = dict(line.split() for line in lines[2:-2])
    assert rows["api_keys"] == "3" and rows["models"] == "1" and rows["settings"] == "1"
    kept = next(tmp_path.glob("server.yaml.before-postgres-*"))
    assert lines[-2] == (
        f"{server}: store.url now names PostgreSQL; the previous file is kept as {kept}"
    )
    assert kept.read_bytes() == old_config
    assert stat.S_IMODE(server.stat().st_mode) == stat.S_IMODE(kept.stat().st_mode) == 0o640
    new_text = server.read_text()
    assert new_text.startswith(old_config.decode())  # every line kept; one block added
    assert load(server, ServerConfig).store.url == pg_url
    assert digest(sqlite_file) == old_store

    store = await open_store(load(server, ServerConfig).store.url)
    try:
        assert [k.prefix for k in await store.list_api_keys()] == ["k0", "k1", "k2"]
        assert (await store.get_model("m")).spec["x"] == 0.1
        assert await store.get_setting("s") == {"nested": [1, None]}
        assert (await store.list_api_keys())[0].created_at == T0
    finally:
        await store.close()

    twice = llmgw_store("migrate-to-postgres", "--url", pg_url, "--config", server)
    assert twice.returncode == 1
    assert "moving one PostgreSQL store into another is not supported" in twice.stderr


@pytest.mark.postgres
async def test_refused_while_the_server_runs(server: Path, tmp_path: Path, pg_url: str) -> None:
    old_config = server.read_bytes()
    dest = tmp_path / "b.db"

    with lock_held_elsewhere(tmp_path / "state") as holder:
        backup = llmgw_store("backup", dest, "--config", server)
        move = llmgw_store("migrate-to-postgres", "--url", pg_url, "--config", server)

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
    assert await pg_tables(pg_url) == set()
