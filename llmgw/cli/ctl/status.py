"""``llmgw ctl status``: models, their replicas, and what each fabric holds."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from llmgw.cli.ctl.client import call
from llmgw.cli.ctl.commands import Commands
from llmgw.cli.ctl.output import print_json, table, why_not_all


def status(args: argparse.Namespace) -> None:
    reply = call(args, "GET", "/api/status")
    if args.json:
        print_json(reply)
        return
    # An overview: a long value may be cut short rather than make a table unreadable.
    table([_model_row(m, reply["replicas"]) for m in reply["models"]],
          ["model", "ready", "wanted", "priority", "on", "weights in", "why not all"], "models",
          whole=False)
    table([_replica_row(r) for r in reply["replicas"]],
          ["replica", "model", "state", "where", "reason"], "replicas", whole=False)
    table(_fabric_rows(reply), ["fabric", "nodes", "gpus", "replicas", "weights of"],
          "fabrics", whole=False)
    table(_server_rows(reply), ["server", "address", "state", "since"], "servers",
          whole=False)


def _server_rows(reply: dict) -> list[dict]:
    """Each server: up or down, which one leads and since when (and which answered)."""
    leader = reply.get("leader")
    rows = []
    for server in reply.get("servers", []):
        if leader is not None and server["name"] == leader["name"]:
            state, since = f"leads (term {leader['term']})", leader["since"]
        else:
            state, since = ("follows" if server["up"] else "down"), server["since"]
        if server["name"] == reply.get("answered_by"):
            state += ", answered this"
        rows.append({"server": server["name"], "address": server["address"], "state": state,
                     "since": f"{datetime.fromtimestamp(since, UTC):%Y-%m-%d %H:%M:%S} UTC"})
    return rows


def _model_row(model: dict, replicas: list[dict]) -> dict:
    nodes = sorted({s["node"] for r in replicas if r["model"] == model["name"]
                    for s in r["shards"]})
    return {"model": model["name"], "ready": model["replicas_ready"],
            "wanted": model["replicas_wanted"], "priority": model["priority"],
            "on": ", ".join(nodes) or "-", "weights in": _weights_words(model.get("weights", [])),
            "why not all": why_not_all(model)}


def _replica_row(replica: dict) -> dict:
    # While starting, the shards' own words say what they are doing ("fetching …").
    doing = "; ".join(f"rank {s['rank']}: {s['detail']}" for s in replica["shards"]
                      if s["detail"] and s["state"] != "ready")
    return {"replica": replica["id"], "model": replica["model"], "state": replica["state"],
            "where": "+".join(f"{s['node']}:{s['port']}" for s in replica["shards"]),
            "reason": doing if replica["state"] == "starting" and doing else replica["reason"]}


def _weights_words(held: list[dict]) -> str:
    """``ib-a: shared /lustre/w; ib-b: node3, node4``; "-" when no node holds them."""
    parts = []
    for entry in held:
        where = [f"shared {p}" for p in entry["shared"]] + entry["nodes"]
        parts.append(f"{entry['fabric'] or 'no fabric'}: {', '.join(where)}")
    return "; ".join(parts) or "-"


def _fabric_rows(reply: dict) -> list[dict]:
    """What each fabric holds: its nodes, their GPUs, the replicas on them, and the models
    whose weights are already there (a replica spans one fabric, never two)."""
    by_fabric: dict[str | None, list[dict]] = {}
    for node in reply["nodes"]:
        by_fabric.setdefault(node["fabric"], []).append(node)
    rows = []
    for fabric in sorted(by_fabric, key=lambda f: (f is None, f or "")):
        nodes = by_fabric[fabric]
        weights = [m["name"] for m in reply["models"]
                   if any(w["fabric"] == fabric for w in m.get("weights", []))]
        rows.append({"fabric": fabric or "no fabric",
                     "nodes": ", ".join(f"{n['id']} ({n['state']})" for n in nodes),
                     "gpus": sum(len(n["gpus"]) for n in nodes),
                     # A replica on two of the fabric's nodes is named once.
                     "replicas": ", ".join(sorted({r for n in nodes for r in n["replicas"]}))
                     or "-",
                     "weights of": ", ".join(weights) or "-"})
    return rows


def add_parsers(commands: Commands) -> None:
    commands.add("status", status, "models, their replicas and where they run")
