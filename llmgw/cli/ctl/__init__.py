"""``llmgw ctl``: the operator's commands over the admin API.

Credentials, first found wins: ``--token``, ``$LLMGW_TOKEN``, then the session saved by
``llmgw ctl login``. The server: ``--server``, ``$LLMGW_SERVER``, the saved session's,
then http://127.0.0.1:8080. An https server's certificate is checked against
``--ca-file`` or ``$LLMGW_CA_FILE`` (the cluster CA), else the system's CAs.

Every command that prints takes ``--json``: one JSON document on stdout, for scripts.
Exit codes: 0 done, 1 refused by the server (the message says why), 2 bad usage (a wrong
option, a file that cannot be read, no credentials), 3 the server could not be reached or
its certificate is not trusted.

One module per command group, each with its commands and an ``add_parsers``; they share
`client` (the request, credentials and exit codes), `output` (tables and JSON) and
`commands` (the common options, and the one place an error becomes an exit code).
"""

from __future__ import annotations

import argparse

from llmgw.cli.ctl import (
    keys,
    logs,
    models,
    nodes,
    session,
    signup,
    status,
    upgrade,
    users,
)
from llmgw.cli.ctl.commands import Commands


def add_parsers(ctl: argparse._SubParsersAction) -> None:
    """ctl's commands, under an existing ``llmgw ctl`` parser, in the order help lists them."""
    commands = Commands(ctl)
    for group in (session, keys, users, status, nodes, models, logs, upgrade, signup):
        group.add_parsers(commands)
