"""What ctl prints: a table for people, or with ``--json`` one JSON document on stdout.

rich is imported only when a table is printed: every ``llmgw`` command builds ctl's
parser first, and most never print a table.
"""

from __future__ import annotations

import argparse
import json


def console(**options):
    """A rich Console whose reader leaving (a closed pipe) raises BrokenPipeError, for
    the command to end as any command whose reader left (`commands.reader_gone`): rich
    would exit with 1, ctl's "refused"."""
    from rich.console import Console

    class PipeAwareConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return PipeAwareConsole(**options)


def print_json(value) -> None:
    print(json.dumps(value, indent=2))


def table(rows: list[dict], columns: list[str], title: str | None = None,
          whole: bool = True) -> None:
    """One table: a column per name in ``columns``, a row per dict (a missing value blank).

    ``whole``: the first column names the row (a key's prefix, a node, a model) for the
    next command, so it stays on one line, and nothing is cut short with "…": a narrow
    terminal folds a value onto more lines. Without it, rich's defaults: a word too long
    for its column is cut short, which keeps a wide overview readable on a narrow terminal.
    """
    from rich.table import Table

    shown = Table(title=title, title_justify="left")
    for n, column in enumerate(columns):
        if whole:
            shown.add_column(column, no_wrap=n == 0, overflow="fold")
        else:
            shown.add_column(column)
    for row in rows:
        shown.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    console(highlight=False).print(shown)


def show(args: argparse.Namespace, value: list[dict], columns: list[str], title: str,
         rows: list[dict] | None = None) -> None:
    """``value`` as the API gave it with ``--json``; else a table of ``rows`` (by default
    ``value`` itself), the people's version of it."""
    if args.json:
        print_json(value)
    else:
        table(value if rows is None else rows, columns, title)


def done(args: argparse.Namespace, reply, text: str) -> None:
    """What a command that acts prints: the server's reply with ``--json``, else ``text``."""
    if args.json:
        print_json(reply)
    else:
        print(text)


def why_not_all(model: dict) -> str | None:
    """Why a model (as /api/status or /api/models gives it) runs fewer replicas than it
    wants: placement's reason, or that it sleeps until its next request."""
    if model.get("unplaced"):
        return model["unplaced"]
    if model.get("asleep"):
        return (f"asleep (no request for {model['idle_unload_s']:g} s); the next one "
                "wakes it")
    return None
