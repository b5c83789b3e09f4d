"""``llmgw ctl upgrade``: roll the nodes' llmgw forward to the release the mirror holds,
one node at a time, each back and serving before the next, stopping at the first failure.

The server does each node's upgrade (server/admin/upgrade.py); this walks the plan and
follows each. Running it again resumes: nodes at the release already are skipped.
"""

from __future__ import annotations

import argparse
import sys
import time

from llmgw.cli.ctl.client import CtlError, call
from llmgw.cli.ctl.commands import Commands
from llmgw.cli.ctl.output import print_json, table

_POLL_S = 0.5
# Past the server's own deadline for a node, for the last answer to arrive.
_SLACK_S = 60.0
_FINISHED = ("done", "failed")


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, flush=True)


def _follow(args: argparse.Namespace, node: str, started: dict) -> dict:
    """Poll the node's upgrade until it is done or failed, printing each new step."""
    deadline = time.monotonic() + args.timeout + _SLACK_S
    view, said = started, ""
    while True:
        if view["detail"] != said:
            said = view["detail"]
            _say(args, f"  {node}: {view['state']}: {said}")
        if view["state"] in _FINISHED:
            return view
        if time.monotonic() > deadline:
            raise CtlError(f"{node}: the server said nothing new for {args.timeout:g} s "
                           f"(last: {view['state']}: {view['detail']}); see `llmgw ctl "
                           f"nodes list` and the agent's log", 1)
        time.sleep(_POLL_S)
        view = call(args, "GET", f"/api/nodes/{node}/upgrade")


def upgrade(args: argparse.Namespace) -> None:
    plan = call(args, "GET", "/api/upgrade")
    version = plan["version"]
    if version is None:
        raise CtlError(plan["detail"], 1)
    nodes = [n for n in plan["nodes"] if not args.node or n["node"] in args.node]
    missing = sorted(set(args.node or ()) - {n["node"] for n in plan["nodes"]})
    if missing:
        raise CtlError(f"no node {', '.join(missing)} has registered", 1)
    if not args.json:
        print(f"{plan['detail']}")
        table([{"node": n["node"], "llmgw": n["version"], "action": n["action"],
                "detail": n["detail"]} for n in nodes], ["node", "llmgw", "action", "detail"])
        for n in nodes:
            if n["steps"]:
                print(f"{n['node']} (NixOS): run on it, as root:")
                for step in n["steps"]:
                    print(f"  {step}")
    todo = [n["node"] for n in nodes if n["action"] == "upgrade"]
    results: list[dict] = []
    if args.dry_run:
        if args.json:
            print_json({"plan": plan, "upgraded": []})
        return
    busy = plan.get("under_way")
    if busy is not None:
        _say(args, f"{busy['node']} is upgrading already; following it first")
        view = _follow(args, busy["node"], busy)
        results.append(view)
        if view["state"] == "failed":
            _stop(args, plan, results, view, todo)
    for node in todo:
        if any(r["node"] == node for r in results):
            continue
        _say(args, f"upgrading {node} to llmgw {version}")
        started = call(args, "POST", f"/api/nodes/{node}/upgrade?timeout_s={args.timeout:g}",
                       {})
        view = _follow(args, node, started)
        results.append(view)
        if view["state"] == "failed":
            _stop(args, plan, results, view, todo)
    left = [n for n in nodes if n["action"] == "cannot"]
    if args.json:
        print_json({"plan": plan, "upgraded": results})
    else:
        upgraded = [r["node"] for r in results if r["state"] == "done"]
        print(f"upgraded {len(upgraded)} node(s) to llmgw {version}"
              + (f": {', '.join(upgraded)}" if upgraded else ""))
    if left:
        raise CtlError("not upgraded: " + "; ".join(f"{n['node']}: {n['detail']}"
                                                    for n in left), 1)


def _stop(args: argparse.Namespace, plan: dict, results: list[dict], failed: dict,
          todo: list[str]) -> None:
    done_nodes = [r["node"] for r in results if r["state"] == "done"]
    not_yet = [n for n in todo if n != failed["node"] and n not in done_nodes]
    if args.json:
        print_json({"plan": plan, "upgraded": results})
    print(f"stopped at {failed['node']}: {failed['detail']}", file=sys.stderr)
    print(f"upgraded: {', '.join(done_nodes) or 'none'}; not tried: "
          f"{', '.join(not_yet) or 'none'}", file=sys.stderr)
    raise CtlError("fix the cause, then run `llmgw ctl upgrade` again: it resumes, "
                   f"skipping the nodes at llmgw {plan['version']} already", 1)


def add_parsers(commands: Commands) -> None:
    p = commands.add("upgrade", upgrade, "upgrade the nodes' llmgw to the release the "
                     "mirror holds, one node at a time, engines kept serving (admins)")
    p.add_argument("--node", action="append", metavar="NODE",
                   help="only this node (repeat for several); default every node")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be done, and do nothing")
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                   help="how long each node has to be back and serving (default 900)")
