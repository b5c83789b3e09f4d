"""The leader's replica table as the store keeps it.

The leader writes it after each pass that changed it (fenced by its term). Followers read
it every ``controller.follow_interval_s`` and route by it; a server that starts, or that
takes the lead, starts from it: it routes at once to what was ready, and checks those
engines itself (server/probe.py) until their nodes report to it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw.core.replicas import Replica

SETTING = "replica_table"


class ReplicaTable(msgspec.Struct, kw_only=True):
    term: int
    replicas: list[Replica] = []
    # Replicas on a lost node, still routed to while their engines answer (make before
    # break), and stopped when the node returns; see Controller.orphans.
    orphans: list[Replica] = []
    # Replicas routed to only while the gateway's own health check passes: their node is
    # unreachable, lost, or has not reported since this leader took over.
    unsure: list[str] = []
    unplaced: dict[str, str] = {}
    # Models asleep (core/idle.py): placed only to their min_replicas until a request.
    asleep: list[str] = []


def encode(table: ReplicaTable) -> dict[str, Any]:
    return msgspec.to_builtins(table)


def decode(value: Any) -> ReplicaTable | None:
    """The table as stored, or None when there is none or it cannot be read (written by
    a release whose shape this one does not know: it is rewritten by the next pass)."""
    if value is None:
        return None
    try:
        return msgspec.convert(value, ReplicaTable)
    except msgspec.ValidationError:
        return None
