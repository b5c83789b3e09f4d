"""`llmgw store migrate-to-postgres`: the whole move, with the server down only for the
copy.

Before anything stops, server.yaml is read, the SQLite store checked, and the target made
ready and checked: with `--install`, PostgreSQL installed and started where none answers
and a role and a database made (`pg_setup`); then a login with the new URL, into a
database that must hold no llmgw store. Then, one step at a time:

1. stopping the server: its systemd unit (`--service`) if that is active; a server that
   runs some other way holds the state-directory lock, and the move refuses as before;
2. copying the store, under the state-directory lock;
3. pointing server.yaml at PostgreSQL, the old file kept beside it;
4. starting the unit again, if it was stopped, and waiting until /healthz says ok.

A step that fails, or Ctrl-C, is undone: the unit is stopped, server.yaml put back, what
the move made in PostgreSQL dropped (llmgw's tables; with `--install` the database and role
this run made; never a database given by `--url`), and the unit started again on SQLite.
The SQLite store is only ever read.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmgw.cli import pg_setup
from llmgw.cli.gateway_unit import Unit
from llmgw.cli.store import LOCAL_NAME, LOCAL_PORT
from llmgw.config import ServerConfig
from llmgw.store import StoreError, ops
from llmgw.store.lock import hold_state_lock
from llmgw.store.urls import parse

say = functools.partial(print, flush=True)
_HOLDER = "`llmgw store migrate-to-postgres`"


def migrate(args: argparse.Namespace, config: ServerConfig, url: str) -> None:
    if ops.backend(url) == "postgresql":
        raise StoreError(
            f"the store is already on PostgreSQL ({ops.mask(url)}); moving "
            "one PostgreSQL store into another is not supported"
        )
    made = _local(args)
    new = "" if made else _given_url(args)
    ops.check_editable(Path(args.config), password=bool(made) or parse(new).password is not None)
    if Unit(args.service).state() != "active":
        # A server that is not the unit cannot be stopped here: refuse before installing.
        with hold_state_lock(config.state_dir, _HOLDER):
            pass
    try:
        if made:
            pg_setup.prepare(made, Path(config.state_dir), say)
            new = made.url
        asyncio.run(ops.check_move(url, new))
    except (StoreError, KeyboardInterrupt) as exc:
        undone = pg_setup.undo(made) if made else ""
        if not undone:
            raise
        raise StoreError(f"{_reason(exc)}; {undone}") from exc
    _Move(args, config, url, new, made).run()


def _local(args: argparse.Namespace) -> pg_setup.LocalDatabase | None:
    """What --install is to make, or None for --url."""
    given = [f"--{o}" for o in ("role", "database", "port") if getattr(args, o) is not None]
    if not args.install:
        if given:
            raise StoreError(f"{', '.join(given)}: only with --install, not with --url")
        return None
    return pg_setup.LocalDatabase(
        role=pg_setup.check_name("--role", args.role or LOCAL_NAME),
        database=pg_setup.check_name("--database", args.database or LOCAL_NAME),
        port=args.port or LOCAL_PORT,
    )


def _given_url(args: argparse.Namespace) -> str:
    given = sys.stdin.readline().strip() if args.url == "-" else args.url
    new = ops.asyncpg_url(given)
    if ops.backend(new) != "postgresql":
        raise StoreError(
            f"--url {ops.mask(new)} is not a PostgreSQL URL; give one like "
            "postgresql+asyncpg://llmgw:PASSWORD@HOST/DATABASE"
        )
    return new


def _reason(exc: BaseException) -> str:
    return "interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else str(exc)


class _Move:
    """The steps from stopping the server to starting it again, and their undoing."""

    def __init__(self, args: argparse.Namespace, config: ServerConfig, url: str, new: str,
                 made: pg_setup.LocalDatabase | None) -> None:
        self.config_path, self.config = Path(args.config), config
        self.url, self.new, self.made = url, new, made
        self.unit = Unit(args.service)
        self.stopped = self.copied = self.started = False
        self.kept: Path | None = None

    def run(self) -> None:
        unit = self.unit.name
        step = f"stopping {unit}"
        health = ""
        try:
            if self.unit.state() == "active":
                say(f"stopping {unit}")
                self.unit.stop()
                self.stopped = True
            step = "copying the store"
            with hold_state_lock(self.config.state_dir, _HOLDER):
                counts = asyncio.run(ops.migrate_to_postgres(self.url, self.new))
                self.copied = True
                step = "pointing server.yaml at PostgreSQL"
                self.kept = ops.point_config_at(self.config_path, self.new)
            if self.stopped:
                step = f"starting {unit} on PostgreSQL"
                say(f"starting {unit}, on PostgreSQL now")
                self.started = True
                self.unit.start()
                health = self.unit.wait_healthy(self.config)
        except (StoreError, KeyboardInterrupt) as exc:
            if not (self.stopped or self.copied or self.kept or self.made):
                raise  # nothing was changed: the refusal as it is
            raise StoreError(self._undo(step, exc)) from exc
        self._report(counts, health)

    def _undo(self, step: str, exc: BaseException) -> str:
        """Put everything back as it was before the move; the message saying so."""
        unit, done = self.unit.name, []
        if self.started:  # it may be running on PostgreSQL, or restarting
            try:
                self.unit.stop()
            except StoreError as err:
                done.append(f"stopping {unit} failed too ({err})")
        if self.kept is not None:
            try:
                ops.put_config_back(self.config_path, self.kept)
                done.append(f"{self.config_path} is back as it was")
            except StoreError as err:
                done.append(str(err))
        if self.made:
            done.append(pg_setup.undo(self.made))
        elif self.copied:
            try:
                asyncio.run(ops.drop_store(self.new))
                done.append("the copy in PostgreSQL was removed")
            except StoreError as err:
                done.append(f"removing the copy in PostgreSQL failed too ({err})")
        if self.stopped:
            try:
                self.unit.start()
                done.append(f"{unit} runs again on SQLite "
                            f"({self.unit.wait_healthy(self.config)} says ok)")
            except StoreError as err:
                done.append(f"starting {unit} on SQLite failed too ({err}): start it by "
                            f"hand, `systemctl start {unit}`")
        why = (f"see `journalctl -u {unit}` for why it did not start on PostgreSQL, then run "
               "this again" if self.started else "then run this again")
        undone = "; ".join(d for d in done if d)
        return (f"{step} failed: {_reason(exc).rstrip('.')}. Undone: {undone}. The SQLite "
                f"store is untouched; {why}")

    def _report(self, counts: dict[str, int], health: str) -> None:
        say(f"copied the store from {ops.mask(self.url)} to {ops.mask(self.new)}:")
        table = Table(box=None, pad_edge=False)
        table.add_column("table")
        table.add_column("rows", justify="right")
        for name, rows in counts.items():
            table.add_row(name, str(rows))
        Console(highlight=False, markup=False).print(table)
        say(f"{self.config_path}: store.url now names PostgreSQL; the previous file is kept "
            f"as {self.kept}")
        unit = self.unit.name
        if health:
            say(f"{unit} runs again, on PostgreSQL ({health} says ok); the SQLite store is "
                "left as it was")
        else:
            say(f"the SQLite store is left as it was; start the server again, e.g. "
                f"`systemctl start {unit}`")
