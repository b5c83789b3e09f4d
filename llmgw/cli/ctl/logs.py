"""``llmgw ctl logs``: a shard's engine output, from the node that runs it.

The output goes to stdout as it comes, byte for byte, each piece flushed at once; with
``--follow`` it goes on until Ctrl-C or the shard stops. A reader that stops reading
(``| head``) ends it quietly, as it ends every ctl command (`commands`).
"""

from __future__ import annotations

import argparse
import http.client
import sys
from urllib.parse import quote, urlencode

from llmgw.cli.ctl.client import EXIT_UNREACHABLE, EXIT_USAGE, CtlError, server_url, stream
from llmgw.cli.ctl.commands import Commands

_READ_BYTES = 64 * 1024


def logs(args: argparse.Namespace) -> None:
    if args.json:
        raise CtlError("logs prints the engine's output as it is: it has no --json",
                       EXIT_USAGE)
    query = urlencode({"rank": args.rank, "tail": args.tail,
                       "follow": "true" if args.follow else "false"})
    path = f"/api/replicas/{quote(args.replica, safe='')}/logs?{query}"
    # Following, the engine may say nothing for hours: wait for it.
    with stream(args, path, timeout_s=None if args.follow else 30) as resp:
        while True:
            try:
                piece = resp.read1(_READ_BYTES)
            except (OSError, http.client.HTTPException) as err:
                raise CtlError(f"the output from {server_url(args)} broke off: "
                               f"{err or type(err).__name__}", EXIT_UNREACHABLE) from None
            if not piece:
                return
            _write(piece)


def _write(piece: bytes) -> None:
    """Write to stdout now. Once nobody reads it, BrokenPipeError ends the command
    quietly (`commands`)."""
    out = getattr(sys.stdout, "buffer", None)
    if out is None:  # a text stream in place of stdout
        sys.stdout.write(piece.decode(errors="replace"))
    else:
        out.write(piece)
    sys.stdout.flush()


def add_parsers(commands: Commands) -> None:
    p = commands.add("logs", logs, "a shard's engine output, from the node that runs it "
                     "(admins)")
    p.add_argument("replica", help="the replica's id, as `llmgw ctl status` lists it")
    p.add_argument("--rank", type=int, default=0, metavar="N",
                   help="which shard of a replica on several nodes (default 0)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="go on printing what the engine writes, until Ctrl-C or the "
                   "shard stops")
    p.add_argument("--tail", type=int, default=64 * 1024, metavar="BYTES",
                   help="print the last BYTES of output first, from the first whole line "
                   "in them (default 65536, at most 1048576)")
