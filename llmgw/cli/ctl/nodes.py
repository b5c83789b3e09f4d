"""``llmgw ctl nodes``: the cluster's nodes, for admins: list, drain, join, revoke; and
``llmgw ctl engine-build``: the build of an engine a node installs."""

from __future__ import annotations

import argparse
import sys
import urllib.parse
from collections import Counter

from llmgw.cli.ctl.client import call
from llmgw.cli.ctl.commands import Commands
from llmgw.cli.ctl.output import done, print_json, show
from llmgw.core.desired_engines import BUILD_SOURCE_WORDS

_COLUMNS = ["node", "state", "address", "llmgw", "fabric", "gpus", "engines", "builds",
            "weights", "replicas", "warnings"]


def nodes_list(args: argparse.Namespace) -> None:
    nodes = call(args, "GET", "/api/nodes")
    show(args, nodes, _COLUMNS, "nodes", rows=[_row(n) for n in nodes])


def _row(node: dict) -> dict:
    disk = ", ".join(f"{d['path']} {d['free_mib'] / 1024:.0f} GiB free"
                     + (" (shared)" if d["shared"] else "")
                     for d in node.get("weights_dirs", []))
    return {"node": node["id"], "state": node["state"], "address": node["address"],
            "llmgw": node.get("llmgw_version", "unknown"),
            "fabric": node["fabric"], "gpus": _gpu_words(node["gpus"]),
            "engines": ", ".join(_engine_words(e) for e in node["engines"]),
            "builds": _build_words(node.get("engine_builds", {})),
            "weights": disk, "replicas": ", ".join(node["replicas"]),
            "warnings": "; ".join(node["warnings"])}


def _gpu_words(gpus: list[dict]) -> str:
    """``2 x NVIDIA H100 80GB HBM3 (80 GiB)``; "-" for a node without GPUs."""
    kinds = Counter((g["name"], round(g["memory_total_mib"] / 1024)) for g in gpus)
    return ", ".join(f"{count} x {name} ({gib} GiB)"
                     for (name, gib), count in kinds.items()) or "-"


def _build_words(builds: dict[str, dict]) -> str:
    """The builds something chose: ``llama.cpp vulkan (chosen), vllm none (server.yaml)``;
    an engine left to the node (auto, by default) is not named."""
    return ", ".join(f"{name} {b['build']} ({'chosen' if b['source'] == 'node' else b['source']})"
                     for name, b in builds.items() if b["source"] != "default")


def _engine_words(engine: dict) -> str:
    """``llama.cpp b11434 installed``; the node's own words where it is not usable:
    ``llama.cpp b11434 installing (installing: downloading … (16 MB))``."""
    words = " ".join(filter(None, [engine["name"], engine.get("version"), engine["state"]]))
    if engine.get("detail") and engine["state"] not in ("installed", "configured"):
        words += f" ({engine['detail']})"
    return words


def _act(args: argparse.Namespace, action: str, payload: dict | None = None) -> dict:
    """``POST /api/nodes/NODE/ACTION``."""
    return call(args, "POST", f"/api/nodes/{args.node}/{action}", payload or {})


def nodes_drain(args: argparse.Namespace) -> None:
    done(args, _act(args, "drain"), f"{args.node} is draining: its replicas move, each "
                                    "stopping once its replacement serves")


def nodes_undrain(args: argparse.Namespace) -> None:
    done(args, _act(args, "undrain"), f"{args.node} takes replicas again")


def nodes_add(args: argparse.Namespace) -> None:
    reply = _act(args, "join-tokens", {"ttl_s": args.ttl})
    if args.json:
        print_json(reply)
        return
    print(f"run this on {reply['node']} (as root), before {reply['expires_at']}; the token "
          "works once:", file=sys.stderr)
    print(reply["command"])


def nodes_revoke(args: argparse.Namespace) -> None:
    reply = _act(args, "revoke")
    if reply["revoked"]:
        # In hex, as the server's and agents' logs print serials (the API gives decimal).
        serials = ", ".join(f"{int(s):x}" for s in reply["revoked"])
        text = (f"revoked {args.node}: certificate serial(s) {serials}; "
                "its agent stream is closed and every handshake refused. To let it back, "
                f"llmgw ctl nodes add {args.node} and join it again")
    else:
        text = f"{args.node} has no unexpired certificate: nothing to revoke"
    done(args, reply, text)


# What decided a node's build, in the words ctl prints (EngineBuildView.source).
def engine_build(args: argparse.Namespace) -> None:
    path = "/api/nodes/{}/engine-builds/{}".format(
        *(urllib.parse.quote(part, safe="") for part in (args.node, args.engine)))
    reply = call(args, "PUT", path, {"build": args.choice})
    build = reply["build"]
    source = BUILD_SOURCE_WORDS.get(build["source"], build["source"])
    done(args, reply, f"{args.node} {args.engine}: {build['build']} ({source}); {reply['told']}")


def add_parsers(commands: Commands) -> None:
    nodes = commands.listing_group("nodes", nodes_list, "nodes (admins)")
    commands.add("list", nodes_list, "each node: state, address, GPUs, engines, warnings",
                 under=nodes)
    p = commands.add("drain", nodes_drain, "move a node's replicas away, for maintenance",
                     under=nodes)
    p.add_argument("node")
    p = commands.add("undrain", nodes_undrain, "let a drained node take replicas again",
                     under=nodes)
    p.add_argument("node")
    p = commands.add("add", nodes_add, "make a one-time join token for a new node and "
                     "print the command to run on it", under=nodes)
    p.add_argument("node", help="the node's id (its hostname)")
    p.add_argument("--ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="how long the token is good for (default 3600)")
    p = commands.add("revoke", nodes_revoke, "revoke a node's certificates: its stream is "
                     "closed and it cannot connect again until it joins again", under=nodes)
    p.add_argument("node")
    p = commands.add("engine-build", engine_build, "choose the build of an engine a node "
                     "installs; kept by the control plane, and the node told at once")
    p.add_argument("node")
    p.add_argument("engine", help="llama.cpp, vllm, sglang or comfyui")
    p.add_argument("choice", help="auto (the node takes its best), a build name (cu130, "
                   "cu129, cuda-12.8, vulkan, cpu …), none (not installed there), or default "
                   "(no choice of yours: server.yaml's engine_overrides, else auto)")
