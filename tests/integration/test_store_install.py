"""``llmgw store migrate-to-postgres --install`` against the real PostgreSQL here, with the
package and service managers as stand-ins (tests/integration/stand_ins.py): a real server
runs as the "unit", is stopped, and comes back on PostgreSQL, or on SQLite when a step
fails. Role and database names are new per test, and dropped after it."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from llmgw.config import ServerConfig, load
from tests.integration.cluster import free_port, wait_for
from tests.integration.stand_ins import StandIns
from tests.integration.store_cli import check_rows, llmgw_store, make_server
from tests.pg import ADMIN_DSN, postgres_required, run_blocking

pytestmark = pytest.mark.postgres
UNIT = "llmgw-test-server"


def _superuser_over_the_socket() -> str | None:
    """Why --install cannot act as the postgres user here, or None."""
    if os.geteuid() != 0:
        return "needs root (runuser -u postgres)"
    if shutil.which("runuser") is None or shutil.which("psql") is None:
        return "needs runuser and psql"
    return None


@pytest.fixture(autouse=True)
def _as_root() -> None:
    why = _superuser_over_the_socket()
    if why and postgres_required():
        pytest.fail(f"--install's tests run in CI: {why}")
    if why:
        pytest.skip(why)


@pytest.fixture
def name() -> Iterator[str]:
    """A role and database name no one has; both dropped after the test."""
    made = f"llmgw_t_{secrets.token_hex(4)}"
    yield made

    async def drop() -> None:
        conn = await asyncpg.connect(ADMIN_DSN)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{made}" WITH (FORCE)')
            await conn.execute(f'DROP ROLE IF EXISTS "{made}"')
        finally:
            await conn.close()

    run_blocking(drop())


@pytest.fixture
async def server(tmp_path: Path) -> Path:
    return await make_server(tmp_path, port=free_port())


@pytest.fixture
def stand_ins(tmp_path: Path, server: Path) -> Iterator[StandIns]:
    made = StandIns(tmp_path / "stand-ins", server, pg_port=free_port())
    yield made
    made.stop()


@pytest.fixture
def unit(stand_ins: StandIns, server: Path) -> Iterator[str]:
    """The server, running as the stand-in unit on its SQLite store; its /healthz URL."""
    assert stand_ins.systemctl("start", UNIT) == 0
    url = f"http://127.0.0.1:{load(server, ServerConfig).listen.port}/healthz"
    try:
        wait_for(lambda: healthy(url), 30, "the server to answer on SQLite")
    except AssertionError:
        print(stand_ins.log(UNIT))
        raise
    stand_ins.forget_calls()  # the test's own start: not the command's
    yield url


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).json()["status"] == "ok"
    except httpx.HTTPError:
        return False


async def roles_and_databases(name: str) -> tuple[list[str], list[str]]:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        roles = await conn.fetch("SELECT rolname FROM pg_roles WHERE rolname = $1", name)
        owners = await conn.fetch(
            "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = $1", name)
        return [r[0] for r in roles], [r[0] for r in owners]
    finally:
        await conn.close()


async def sessions_of(role: str) -> int:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        return await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND datname = $1", role)
    finally:
        await conn.close()


def migrate(stand_ins: StandIns, server: Path, name: str, *more: str):
    return llmgw_store("migrate-to-postgres", "--install", "--role", name, "--database", name,
                       "--service", UNIT, "--config", server, *more,
                       env=stand_ins.env(forwarded="--port" in more))


async def test_installs_postgresql_where_none_answers_and_moves_the_running_server(
    server: Path, tmp_path: Path, stand_ins: StandIns, unit: str, name: str
) -> None:
    port = stand_ins.pg_port  # where nothing answers until pg_ctlcluster starts it
    old_config = server.read_bytes()
    sqlite_pid = stand_ins.pid(UNIT)

    done = migrate(stand_ins, server, name, "--port", str(port))

    assert done.returncode == 0, done.stderr + stand_ins.log(UNIT)
    password_file = tmp_path / "state" / "secrets" / "postgres-password"
    lines = done.stdout.splitlines()
    assert lines[:5] == [
        f"no PostgreSQL answers on 127.0.0.1:{port}: installing it with apt-get",
        "starting PostgreSQL",
        f"making the role {name} and the database {name} in PostgreSQL; the role's "
        f"password is kept in {password_file} (0600)",
        f"stopping {UNIT}",
        f"starting {UNIT}, on PostgreSQL now",
    ]
    assert lines[-1] == (
        f"{UNIT} runs again, on PostgreSQL ({unit} says ok); the SQLite store is left as it was"
    )
    calls = stand_ins.calls()
    assert calls[:4] == [
        ["systemctl", "is-active", UNIT],
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "postgresql"],
        ["pg_lsclusters", "--no-header"],
    ]
    assert calls[4] == ["pg_ctlcluster", "15", "main", "start"]
    assert [c for c in calls if c[1] in ("stop", "start")] == [
        ["systemctl", "stop", UNIT], ["systemctl", "start", UNIT]]

    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(password_file.parent.stat().st_mode) == 0o700
    password = password_file.read_text().strip()
    url = load(server, ServerConfig).store.url
    assert url == f"postgresql+asyncpg://{name}:{password}@127.0.0.1:{port}/{name}"
    assert password not in done.stdout + done.stderr
    assert server.read_text().startswith(old_config.decode())
    assert next(tmp_path.glob("server.yaml.before-postgres-*")).read_bytes() == old_config
    # The server that answers is a new one, and it is connected as the new role.
    assert stand_ins.pid(UNIT) != sqlite_pid
    assert healthy(unit)
    assert (tmp_path / "state" / "llmgw.lock").read_text().split()[0] == str(stand_ins.pid(UNIT))
    assert await sessions_of(name) > 0
    assert await roles_and_databases(name) == ([name], [name])
    await check_rows(url, models=False)  # the server on SQLite kept only server.yaml's


async def test_a_failed_start_puts_everything_back_and_the_server_runs_on_sqlite(
    server: Path, tmp_path: Path, stand_ins: StandIns, unit: str, name: str
) -> None:
    old_config = server.read_bytes()
    (stand_ins.state / "start-fails").write_text("1")

    done = migrate(stand_ins, server, name)  # the real PostgreSQL on 5432: nothing installed

    assert done.returncode == 1, done.stdout
    assert done.stderr.count("\n") == 1
    assert done.stderr.strip() == (
        f"llmgw store migrate-to-postgres: starting {UNIT} on PostgreSQL failed: "
        f"`systemctl start {UNIT}` failed (exit 1): Job for {UNIT}.service failed because "
        f"the control process exited with error code. Undone: {server} is back as it was; "
        f"the database {name} and the role {name} this run made were dropped; {UNIT} runs "
        f"again on SQLite ({unit} says ok). The SQLite store is untouched; see `journalctl "
        f"-u {UNIT}` for why it did not start on PostgreSQL, then run this again"
    )
    assert server.read_bytes() == old_config
    assert stat.S_IMODE(server.stat().st_mode) == 0o640
    assert not list(tmp_path.glob("server.yaml.*"))
    assert not (tmp_path / "state" / "secrets" / "postgres-password").exists()
    assert await roles_and_databases(name) == ([], [])
    calls = stand_ins.calls()
    assert not [c for c in calls if c[0] != "systemctl"]  # PostgreSQL answered: no install
    assert [c[1] for c in calls if c[1] != "is-active"] == ["stop", "start", "stop", "start"]
    assert healthy(unit)
    assert load(server, ServerConfig).store.url == ""


def test_a_failed_install_stops_nothing(
    server: Path, tmp_path: Path, stand_ins: StandIns, unit: str, name: str
) -> None:
    (stand_ins.state / "apt-fails").touch()
    old_config, pid = server.read_bytes(), stand_ins.pid(UNIT)

    done = migrate(stand_ins, server, name, "--port", str(stand_ins.pg_port))

    assert done.returncode == 1
    assert done.stderr.strip() == (
        "llmgw store migrate-to-postgres: `apt-get install -y -q --no-install-recommends "
        "postgresql` failed (exit 100): E: Unable to locate package postgresql"
    )
    assert [c[:2] for c in stand_ins.calls()] == [
        ["systemctl", "is-active"], ["apt-get", "update"], ["apt-get", "install"]]
    assert stand_ins.pid(UNIT) == pid and healthy(unit)
    assert server.read_bytes() == old_config
    assert not (tmp_path / "state" / "secrets" / "postgres-password").exists()


async def test_a_role_that_is_there_is_left_alone(
    server: Path, tmp_path: Path, stand_ins: StandIns, name: str
) -> None:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(f'CREATE ROLE "{name}"')
    finally:
        await conn.close()

    done = migrate(stand_ins, server, name)

    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"llmgw store migrate-to-postgres: the PostgreSQL on port 5432 already has the role "
        f"{name}; --install makes its own: give --role and --database names not taken, or "
        "give --url with that role's password"
    )
    assert await roles_and_databases(name) == ([name], [])
    assert not (tmp_path / "state" / "secrets").exists()


def test_a_store_on_postgresql_is_not_moved_again(
    server: Path, stand_ins: StandIns, name: str
) -> None:
    server.write_text(server.read_text() + 'store:\n  url: "postgresql+asyncpg://db.example/llmgw"\n')

    done = migrate(stand_ins, server, name)

    assert done.returncode == 1
    assert "moving one PostgreSQL store into another is not supported" in done.stderr
    assert stand_ins.calls() == []
