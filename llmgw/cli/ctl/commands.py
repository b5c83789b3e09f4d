"""How a ctl command is added to the parser: the options every command takes, groups of
commands, and the one place a `CtlError` (or a reader that left) becomes an exit code."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from collections.abc import Callable

from llmgw.cli.ctl.client import DEFAULT_SERVER, CtlError

Handler = Callable[[argparse.Namespace], None]

# What a shell reports for a command a closed pipe ended (128 + SIGPIPE): not 1, which
# ctl's callers read as "the server refused".
EXIT_READER_GONE = 128 + signal.SIGPIPE


class Commands:
    """Adds commands under an existing ``llmgw ctl`` parser."""

    def __init__(self, ctl: argparse._SubParsersAction) -> None:
        self._ctl = ctl
        self._common = _common_options()
        # Under a group that takes the options too (``nodes --json list``): a command's own
        # defaults would overwrite what the group parsed, so it has none.
        self._common_in_group = _common_options(argparse.SUPPRESS)
        self._listing_groups: list[argparse._SubParsersAction] = []

    def add(self, name: str, func: Handler, help_text: str,
            under: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
        """``llmgw ctl NAME`` running ``func``, or ``llmgw ctl GROUP NAME`` with ``under``."""
        parent = under or self._ctl
        options = self._common_in_group if parent in self._listing_groups else self._common
        p = parent.add_parser(name, parents=[options], help=help_text, description=help_text)
        p.set_defaults(func=functools.partial(_run, func))
        return p

    def group(self, name: str, help_text: str) -> argparse._SubParsersAction:
        """A group whose commands are named: ``llmgw ctl keys create``."""
        return self._ctl.add_parser(name, help=help_text).add_subparsers(
            dest=f"{name}_command", metavar="COMMAND", required=True)

    def listing_group(self, name: str, listing: Handler,
                      help_text: str) -> argparse._SubParsersAction:
        """A group whose bare name lists, as its ``list`` does."""
        p = self.add(name, listing, f"{help_text}; alone: list")
        self._listing_groups.append(
            p.add_subparsers(dest=f"{name}_command", metavar="COMMAND"))
        return self._listing_groups[-1]


def _common_options(default: object = None) -> argparse.ArgumentParser:
    """The options every command takes, each defaulting to ``default`` where given."""
    common = argparse.ArgumentParser(add_help=False, argument_default=default)
    common.add_argument("--server", help="the server's URL (default: $LLMGW_SERVER, the "
                        f"saved session's, or {DEFAULT_SERVER})")
    common.add_argument("--token", help="the admin token or a session token "
                        "(default: $LLMGW_TOKEN, or the saved session)")
    common.add_argument("--ca-file", help="the cluster CA's PEM file, to trust an https "
                        "server (default: $LLMGW_CA_FILE, else the system's CAs)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")
    return common


def _run(func: Handler, args: argparse.Namespace) -> int:
    try:
        func(args)
        # A reader that left shows here, not in the flush at exit, where it cannot be caught.
        sys.stdout.flush()
    except CtlError as err:
        print(f"llmgw ctl: {err}", file=sys.stderr)
        return err.code
    except BrokenPipeError:  # ``| head -1`` read what it wanted and closed the pipe
        return reader_gone()
    return 0


def reader_gone() -> int:
    """A closed stdout ends the command quietly: the exit code a shell reports for it."""
    _drop_stdout()
    return EXIT_READER_GONE


def _drop_stdout() -> None:
    """Send what is left in stdout's buffer to /dev/null: Python flushes stdout again at
    exit, and would print a traceback of the closed pipe then."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file (a test's buffer): nothing is flushed to a pipe at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
