"""``llmgw store``: back up or restore the server's store, or move it to PostgreSQL.

Each command reads server.yaml for the store and the state directory. Restore holds the
state-directory lock for its whole run, and the move for its copy (`store_move`): each
refuses while a server runs that it cannot stop, and the server cannot start half way
through. A backup runs beside the server. Failures are one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from pathlib import Path

from llmgw.config import ConfigError, ServerConfig, load

DEFAULT_CONFIG = "/etc/llmgw/server.yaml"
SERVICE = "llmgw-server"
LOCAL_NAME = "llmgw"  # --install's role and database
LOCAL_PORT = 5432
_RESTART = f"start the server again, e.g. `systemctl start {SERVICE}`"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "store",
        help="back up, restore, or move the server's store",
        description="Back up or restore the server's store, or move it from SQLite to "
        "PostgreSQL. A backup runs beside the server; restore and the move refuse while it runs.",
    )
    cmds = p.add_subparsers(dest="store_command", metavar="COMMAND", required=True)

    b = cmds.add_parser(
        "backup",
        help="write a consistent copy of the store to a file",
        description="Write a consistent copy of the store to PATH (mode 0600): a SQLite "
        "database, or for PostgreSQL a pg_dump archive (custom format, no owners).",
    )
    b.add_argument("path", type=Path, metavar="PATH", help="the backup file to write")
    b.add_argument("--overwrite", action="store_true", help="replace PATH if it exists")
    _config_option(b)
    b.set_defaults(func=_backup)

    r = cmds.add_parser(
        "restore",
        help="replace the store with a backup",
        description="Replace the store with the backup at PATH and bring it up to this "
        "llmgw's schema. SQLite: the database it replaces is kept beside it. PostgreSQL: "
        "the database must hold no llmgw tables.",
    )
    r.add_argument("path", type=Path, metavar="PATH", help="a file `llmgw store backup` made")
    _config_option(r)
    r.set_defaults(func=_restore)

    m = cmds.add_parser(
        "migrate-to-postgres",
        help="copy the SQLite store into PostgreSQL and use it",
        description="Copy every row of the SQLite store into an empty PostgreSQL database "
        "and set store.url in server.yaml to it (the old file is kept beside it). If the "
        "server runs as its systemd unit, it is stopped for the copy and started again on "
        "PostgreSQL; if any step fails, server.yaml is put back and the server started "
        "again on SQLite. The SQLite store is only read.",
    )
    target = m.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--url",
        metavar="URL",
        help="the empty database, e.g. postgresql+asyncpg://llmgw:PASSWORD@db/llmgw; "
        "`-` reads it from the first line of stdin, which keeps a password out of "
        "the process list and the shell's history",
    )
    target.add_argument(
        "--install",
        action="store_true",
        help="use a PostgreSQL on this machine, installed with apt-get or dnf if none "
        "answers on 127.0.0.1, with a new role and database whose generated password is "
        "kept in <state_dir>/secrets/postgres-password; as root",
    )
    m.add_argument("--role", metavar="NAME", help="with --install: the role to make "
                   f"(default {LOCAL_NAME})")
    m.add_argument("--database", metavar="NAME", help="with --install: the database to "
                   f"make (default {LOCAL_NAME})")
    m.add_argument("--port", type=int, metavar="PORT", help="with --install: the port the "
                   f"local PostgreSQL answers on (default {LOCAL_PORT})")
    m.add_argument("--service", default=SERVICE, metavar="UNIT", help="the server's systemd "
                   f"unit, stopped for the move and started again if active (default {SERVICE})")
    _config_option(m)
    m.set_defaults(func=_migrate)


def _config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        "-c",
        default=DEFAULT_CONFIG,
        metavar="server.yaml",
        help=f"the server's configuration file (default {DEFAULT_CONFIG})",
    )


def _command(action, *, locked: bool = True):
    """Load the config, hold the state-directory lock (unless the operation is safe beside a
    running server), run `action` with the store's URL; StoreError and ConfigError exit 1
    with their message."""

    def run(args: argparse.Namespace) -> int:
        from llmgw.store import StoreError, ops  # here: `llmgw agent` does not load the store
        from llmgw.store.lock import hold_state_lock
        from llmgw.store.urls import store_url

        try:
            config = load(args.config, ServerConfig)
            if not locked:
                action(args, config, store_url(config))
                return 0
            with hold_state_lock(config.state_dir, f"`llmgw store {args.store_command}`"):
                action(args, config, store_url(config))
        except (StoreError, ConfigError) as err:
            print(f"llmgw store {args.store_command}: {ops.mask_text(str(err))}", file=sys.stderr)
            return 1
        return 0

    return run


def _locked(action):
    return _command(action)


# Online: SQLite's backup API and pg_dump both take a consistent snapshot while the
# server keeps writing, so a backup needs no downtime.
@functools.partial(_command, locked=False)
def _backup(args: argparse.Namespace, _config: ServerConfig, url: str) -> None:
    from llmgw.store import ops
    dest = asyncio.run(ops.backup(url, args.path, overwrite=args.overwrite))
    size = dest.stat().st_size
    print(f"backed up {ops.mask(url)} to {dest} ({_size(size)}, mode 0600)")


@_locked
def _restore(args: argparse.Namespace, _config: ServerConfig, url: str) -> None:
    from llmgw.store import ops
    kept = asyncio.run(ops.restore(url, args.path))
    aside = f"; the database it replaced is kept as {kept}" if kept else ""
    print(f"restored {args.path} into {ops.mask(url)}{aside}; {_RESTART}")


@functools.partial(_command, locked=False)  # store_move takes the lock for the copy alone
def _migrate(args: argparse.Namespace, config: ServerConfig, url: str) -> None:
    from llmgw.cli.store_move import migrate
    migrate(args, config, url)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"
