"""A PostgreSQL on this machine for the store (`llmgw store migrate-to-postgres --install`):
installed with the machine's own package manager when none answers, started, and given a
role and a database of llmgw's own.

The superuser's work (checking names, creating and dropping the role and the database)
goes through `runuser -u postgres -- psql` over the local socket: that works as the
packages set PostgreSQL up, with peer authentication and no superuser password, on
Debian's family as on Red Hat's. The new role's password is written to psql's stdin, never
onto a command line, and kept in `<state_dir>/secrets/postgres-password` (0600).

What a run made is recorded in its `LocalDatabase` as it is made, so that a failed move
drops exactly that again (`undo`); a role or a database that was there before is never
touched.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.discovery.host import os_release
from llmgw.agent.install import ospkg
from llmgw.agent.install.pypi import InstallError
from llmgw.files import write_atomically
from llmgw.store import StoreError
from llmgw.store.files import chown_like

HOST = "127.0.0.1"
PASSWORD_FILE = Path("secrets") / "postgres-password"
START_TIMEOUT_S = 60.0
INSTALL_TIMEOUT_S = 1800.0
PSQL_TIMEOUT_S = 60.0
# Red Hat's initdb trusts `ident` on 127.0.0.1 unless told otherwise; the store logs in
# there with a password.
RHEL_INITDB_OPTIONS = "--auth-local=peer --auth-host=scram-sha-256"
RHEL_DATA = Path("/var/lib/pgsql/data")
_NAME_RULE = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_ENV = {"DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C", "LANG": "C", "LANGUAGE": "C",
        "NEEDRESTART_SUSPEND": "1"}

# psql scripts; names arrive as psql variables (`-v`), checked by _NAME_RULE, and the
# password as a `\set` line on stdin.
_TAKEN = """SELECT 'the role ' || rolname FROM pg_roles WHERE rolname = :'role'
UNION ALL SELECT 'the database ' || datname FROM pg_database WHERE datname = :'database';
"""
_CREATE_ROLE = "CREATE ROLE :\"role\" LOGIN PASSWORD :'secret';\n"
_CREATE_DATABASE = 'CREATE DATABASE :"database" OWNER :"role";\n'
_DROP_DATABASE = 'DROP DATABASE IF EXISTS :"database" WITH (FORCE);\n'
_DROP_ROLE = 'DROP ROLE IF EXISTS :"role";\n'


@dataclass(slots=True)
class LocalDatabase:
    """The database the store moves to, and what this run made for it so far."""

    role: str
    database: str
    port: int
    url: str = ""
    password_file: Path | None = None
    made_role: bool = False
    made_database: bool = False


def check_name(option: str, name: str) -> str:
    """A role or database name written as is in SQL and in the URL: lower-case letters,
    digits and `_`, the way PostgreSQL keeps an unquoted name."""
    if not _NAME_RULE.fullmatch(name):
        raise StoreError(f"{option} {name!r} is not a name --install makes: use lower-case "
                         "letters, digits and _, starting with a letter or _, at most 63")
    return name


def package_manager(release: Mapping[str, str]) -> ospkg.PackageManager:
    """The package manager that installs PostgreSQL here, from /etc/os-release's fields."""
    if release.get("ID") == "nixos":
        raise StoreError(
            "this is NixOS: set services.postgresql (with ensureDatabases and ensureUsers) "
            "in the configuration, then give --url instead of --install")
    name = release.get("PRETTY_NAME") or release.get("ID") or "this machine's OS"
    family = ospkg.family(release)
    if family not in ("debian", "rhel"):
        raise StoreError(
            f"--install knows apt-get (Debian, Ubuntu) and dnf (Fedora, RHEL), not {name}: "
            "install PostgreSQL, make a role and a database, and give --url")
    manager = ospkg.package_manager(release)
    if manager is None:
        raise StoreError(ospkg.unsupported(release, ["PostgreSQL"]))
    return manager


def install_commands(manager: ospkg.PackageManager) -> list[list[str]]:
    """The commands that install the PostgreSQL server, in order."""
    if manager.family == "debian":
        return [[manager.path, "update", "-q"],
                [manager.path, "install", "-y", "-q", "--no-install-recommends", "postgresql"]]
    return [[manager.path, "install", "-y", "-q", "postgresql-server", "postgresql"]]


def answers(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return True
    except OSError:
        return False


def prepare(made: LocalDatabase, state_dir: Path, say: Callable[[str], None]) -> None:
    """Make PostgreSQL answer on 127.0.0.1 at `made.port` (installing and starting it if
    nothing does), then a new role and database owned by it; `made` records each thing as
    it is made, and gets the URL (password in it) at the end. The caller undoes `made` if
    this raises."""
    if os.geteuid() != 0:
        raise StoreError("--install installs packages and acts as the postgres user: run it "
                         "as root (e.g. with sudo)")
    if not answers(made.port):
        manager = package_manager(os_release())
        say(f"no PostgreSQL answers on {HOST}:{made.port}: installing it with {manager.tool}")
        for argv in install_commands(manager):
            _run(argv, manager.tool, INSTALL_TIMEOUT_S)
        if not answers(made.port):
            say("starting PostgreSQL")
            _start(manager, made.port)
        _wait_until_it_answers(made.port)
    taken = _psql(made.port, "checking the names", _TAKEN, role=made.role,
                  database=made.database)
    if taken:
        raise StoreError(
            f"the PostgreSQL on port {made.port} already has {' and '.join(taken)}; "
            "--install makes its own: give --role and --database names not taken, or give "
            "--url with that role's password")
    password = secrets.token_urlsafe(24)  # URL-safe: no quoting in SQL nor in the URL
    made.password_file = _write_password(state_dir, password)
    say(f"making the role {made.role} and the database {made.database} in PostgreSQL; the "
        f"role's password is kept in {made.password_file} (0600)")
    _psql(made.port, f"making the role {made.role}", _CREATE_ROLE, role=made.role,
          secret=password)
    made.made_role = True
    _psql(made.port, f"making the database {made.database}", _CREATE_DATABASE,
          role=made.role, database=made.database)
    made.made_database = True
    made.url = f"postgresql+asyncpg://{made.role}:{password}@{HOST}:{made.port}/{made.database}"


def undo(made: LocalDatabase) -> str:
    """Drop the database and role this run made and remove the password file; says how
    that went, for the message."""
    dropped = [f"the database {made.database}"] if made.made_database else []
    dropped += [f"the role {made.role}"] if made.made_role else []
    if made.password_file is not None:
        made.password_file.unlink(missing_ok=True)
    try:
        if made.made_database:
            _psql(made.port, "dropping the database", _DROP_DATABASE, database=made.database)
            made.made_database = False
        if made.made_role:
            _psql(made.port, "dropping the role", _DROP_ROLE, role=made.role)
            made.made_role = False
    except StoreError as exc:
        return (f"dropping {' and '.join(dropped)} this run made failed too ({exc}): "
                "drop them by hand before trying again")
    return f"{' and '.join(dropped)} this run made were dropped" if dropped else ""


# --- installing and starting -------------------------------------------------------------


def _run(argv: list[str], tool: str, timeout_s: float,
         env: Mapping[str, str] | None = None) -> list[str]:
    """Run a command to its end (its process group killed after `timeout_s`); the last
    lines it printed, or StoreError with them."""
    shown = " ".join([os.path.basename(argv[0]), *argv[1:]])
    try:
        result = asyncio.run(ospkg.run_command(argv, env={**os.environ, **_ENV, **(env or {})},
                                               timeout_s=timeout_s))
    except InstallError as exc:
        raise StoreError(f"`{shown}`: {' / '.join(str(exc).splitlines())}") from None
    if result.returncode == 0:
        return result.tail
    said = " / ".join(line for line in result.tail[-6:] if line.strip())
    if ospkg.held_lock(tool, result.tail):
        raise StoreError(f"another {tool} holds the package lock ({said}); let it finish, "
                         "then run this again")
    raise StoreError(f"`{shown}` failed (exit {result.returncode}): {said or 'no message'}")


def _start(manager: ospkg.PackageManager, port: int) -> None:
    """Start the server the packages installed: Debian's cluster for `port` with
    pg_ctlcluster (systemctl under it where systemd runs); Red Hat's after its initdb."""
    if manager.family == "rhel":
        if not (RHEL_DATA / "PG_VERSION").exists():
            _run(["postgresql-setup", "--initdb"], "postgresql-setup", PSQL_TIMEOUT_S,
                 {"PGSETUP_INITDB_OPTIONS": RHEL_INITDB_OPTIONS})
        _run(["systemctl", "enable", "--now", "postgresql"], "systemctl", PSQL_TIMEOUT_S)
        return
    listing = _run(["pg_lsclusters", "--no-header"], "pg_lsclusters", PSQL_TIMEOUT_S)
    for line in listing:
        version, cluster, cluster_port, *_ = [*line.split(), "", "", ""]
        if cluster_port == str(port):
            _run(["pg_ctlcluster", version, cluster, "start"], "pg_ctlcluster", PSQL_TIMEOUT_S)
            return
    raise StoreError(
        f"no PostgreSQL cluster is set up for port {port} (pg_lsclusters lists "
        f"{' / '.join(listing) or 'none'}): make one with `pg_createcluster --start "
        f"--port {port} VERSION main`, or give --port")


def _wait_until_it_answers(port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not answers(port):
        if time.monotonic() > deadline:
            raise StoreError(
                f"PostgreSQL did not answer on {HOST}:{port} within {START_TIMEOUT_S:g} s of "
                "being started: see its log (journalctl -u postgresql, or /var/log/postgresql)")
        time.sleep(0.2)


# --- as the postgres user ------------------------------------------------------------------


def _psql(port: int, what: str, script: str, secret: str = "", **names: str) -> list[str]:
    """Run `script` as PostgreSQL's superuser over the local socket; the rows it printed."""
    argv = ["runuser", "-u", "postgres", "--", "psql", "-X", "-q", "-A", "-t",
            "-v", "ON_ERROR_STOP=1", "-p", str(port), "-d", "postgres"]
    for key, value in names.items():
        argv += ["-v", f"{key}={value}"]
    stdin = (f"\\set secret '{secret}'\n" if secret else "") + script
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, cwd="/",
                              timeout=PSQL_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise StoreError("runuser (util-linux) is not installed; it runs psql as the "
                         "postgres user") from None
    except subprocess.TimeoutExpired:
        raise StoreError(f"{what}: psql did not finish in {PSQL_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        said = " / ".join(line for line in done.stderr.splitlines() if line.strip())
        raise StoreError(
            f"{what} as the postgres user failed ({said or f'exit {done.returncode}'}); "
            "--install needs the postgres superuser over the local socket (as the packages "
            "set it up): otherwise make the role and database yourself and give --url")
    return [line for line in done.stdout.splitlines() if line.strip()]


def _write_password(state_dir: Path, password: str) -> Path:
    """`<state_dir>/secrets/postgres-password`, 0600, owned like the state directory (the
    server's user), as is the secrets directory it makes."""
    directory = state_dir / PASSWORD_FILE.parent
    like = state_dir.stat()
    try:
        if not directory.is_dir():
            directory.mkdir(mode=0o700)
            chown_like(directory, like)
        path = directory / PASSWORD_FILE.name
        write_atomically(path, (password + "\n").encode(), mode=0o600)
    except OSError as exc:
        raise StoreError(f"cannot write {directory / PASSWORD_FILE.name}: {exc.strerror}") from exc
    chown_like(path, like)
    return path
