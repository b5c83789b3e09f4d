"""``llmgw doctor`` (and ``llmgw agent --check``): what this node is, what it can run, and
each problem with its fix. Exit 0 when nothing blocks the node, 1 when something does, 2
for bad usage or an unreadable configuration."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmgw.config import AgentConfig, ConfigError, load

if TYPE_CHECKING:  # loaded when doctor runs: the other subcommands need none of it
    from llmgw.agent import doctor

_STYLE = {"blocking": "bold red", "warning": "yellow", "info": "cyan", "ok": "green"}
_DESCRIPTION = (
    "Describe this node (OS, CPU, memory, GPUs, RDMA ports, disks, the route to the control "
    "plane), say which engines it can run, and list each problem with its fix. Exit 0 when "
    "nothing blocks the node, 1 when something does, 2 for bad usage or an unreadable "
    "configuration.")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor", help="check this node: what it is, what it can run, what stops it",
        description=_DESCRIPTION)
    _arguments(p)
    p.set_defaults(func=run)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="agent.yaml",
                   help="the agent's configuration (servers, TLS files, directories); "
                   "without it only what needs no configuration is checked")
    p.add_argument("--server", action="append", metavar="URL",
                   help="a control-plane address to check instead of the configuration's "
                   "servers (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")


def run(args: argparse.Namespace) -> int:
    try:
        config = load(args.config, AgentConfig) if args.config else None
    except ConfigError as err:
        print(f"llmgw doctor: {err}", file=sys.stderr)
        return 2
    return check(config, args.server, args.json)


def run_check(config: AgentConfig, json_output: bool) -> int:
    """``llmgw agent --check``: the doctor over an already loaded agent.yaml."""
    return check(config, None, json_output)


def check(config: AgentConfig | None, servers: Sequence[str] | None, json_output: bool,
          sources: doctor.Sources | None = None) -> int:
    from llmgw.agent import doctor

    facts = doctor.gather(config, servers, sources)
    findings = doctor.checks(facts, config)
    capabilities = doctor.can_run(facts, config)
    if json_output:
        print(json.dumps(report(facts, findings, capabilities, config), indent=2))
    else:
        show(facts, findings, capabilities, config)
    return doctor.exit_code(findings)


def report(facts: doctor.Facts, findings: Sequence[doctor.Finding],
           capabilities: Sequence[doctor.Capability], config: AgentConfig | None) -> dict:
    from llmgw.agent import doctor

    return {
        "node": describe(facts, config),
        "can_run": [{"engine": c.engine, "build": c.build, "can": c.can, "why": c.why}
                    for c in capabilities],
        "findings": [{"severity": f.severity, "check": f.check, "summary": f.summary,
                      "fix": f.fix} for f in findings],
        "blocking": doctor.blocks(findings),
    }


def describe(facts: doctor.Facts, config: AgentConfig | None = None) -> dict:
    """The node part of the doctor's report, as plain data (``--json``'s ``node``)."""
    release = facts.os_release
    report = facts.gpus
    return {
        "hostname": facts.hostname, "node_id": facts.node_id,
        "os": " ".join(filter(None, [release.get("ID", ""), release.get("VERSION_ID", "")])),
        "os_name": release.get("PRETTY_NAME", ""),
        "os_family": release.get("ID_LIKE", "") or release.get("ID", ""),
        "kernel": facts.kernel, "arch": facts.arch, "cpu_model": facts.cpu_model,
        "cpu_count": facts.cpu_count, "cpu_flags": list(facts.cpu_flags),
        "virtual": facts.virtual, "ram_total_mib": facts.ram_total_mib,
        "ram_available_mib": facts.ram_available_mib,
        "gpus": [{"index": g.index, "name": g.name, "memory_total_mib": g.memory_total_mib,
                  "memory_free_mib": g.memory_free_mib, "uuid": g.uuid,
                  "pci_bus_id": g.pci_bus_id,
                  "compute_capability": ".".join(map(str, report.compute_capability[g.uuid]))
                  if g.uuid in report.compute_capability else None} for g in report.gpus],
        "driver": report.driver, "cuda": report.cuda, "gpu_note": report.note,
        "infiniband": [{"adapter": p.adapter, "port": p.port, "state": p.state,
                        "rate_gbps": p.rate_gbps, "link_layer": p.link_layer}
                       for p in facts.infiniband],
        "fabric": config.fabric if config else None,
        "identity": facts.tls.identity if facts.tls is not None else None,
        "engine_dir": _dir_dict(facts.engine_dir),
        "weights": [_dir_dict(d) for d in facts.weights],
        "servers": [{
            "url": s.url,
            "route": None if s.route is None else {
                "destination": s.route.destination, "source": s.route.source,
                "interface": s.route.interface, "gateway": s.route.gateway},
            "route_error": s.route_error,
            "reachable": None if s.probe is None else s.probe.ok,
            "error": s.probe.error if s.probe else "",
            "round_trip_s": s.probe.round_trip_s if s.probe and s.probe.ok else None,
            "skew_s": s.probe.skew_s if s.probe else None} for s in facts.servers],
    }


def _dir_dict(d: doctor.DirFact) -> dict:
    return {"path": d.path, "measured": d.measured, "exists": d.exists, "shared": d.shared,
            "writable": d.writable, "total_mib": d.total_mib, "free_mib": d.free_mib}


def _gib(mib: int | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.1f} GiB"


def show(facts: doctor.Facts, findings: Sequence[doctor.Finding],
         capabilities: Sequence[doctor.Capability], config: AgentConfig | None) -> None:
    console = Console(highlight=False)
    node = describe(facts, config)
    table = Table(title="what this node is", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()

    def row(key: str, value: str) -> None:
        table.add_row(key, escape(value))

    name = node["hostname"] + (f" (node id {node['node_id']})"
                               if node["node_id"] != node["hostname"] else "")
    row("node", name)
    row("OS", f"{node['os_name'] or node['os'] or '?'}; family {node['os_family'] or '?'}; "
        f"kernel {node['kernel']}")
    row("CPU", f"{node['cpu_model'] or '?'} ({node['arch']}), {node['cpu_count']} cores"
        + (", virtual machine" if node["virtual"] else ""))
    row("vector extensions", " ".join(node["cpu_flags"]) or "none")
    row("RAM", f"{_gib(node['ram_total_mib'])} total, "
        f"{_gib(node['ram_available_mib'])} available")
    gpus = [f"{g['index']}: {g['name']}, {_gib(g['memory_total_mib'])} "
            f"({_gib(g['memory_free_mib'])} free), CC {g['compute_capability'] or '?'}"
            for g in node["gpus"]]
    row("GPUs", "\n".join(gpus) or f"none ({node['gpu_note'] or 'no NVIDIA GPU'})")
    if node["driver"]:
        row("NVIDIA driver", f"{node['driver']}, CUDA {node['cuda'] or '?'}")
    ports = [f"{p['adapter']}/{p['port']} {p['state'] or '?'} {p['rate_gbps']:g} Gb/s "
             f"{p['link_layer']}" for p in node["infiniband"]]
    row("RDMA ports", "\n".join(ports) or "none")
    row("fabric", node["fabric"] or "(not configured)")
    engine_dir = node["engine_dir"]
    row("engines dir", f"{engine_dir['path']}: {_gib(engine_dir['free_mib'])} free on "
        f"{engine_dir['measured']}")
    row("weights dirs", "\n".join(
        f"{d['path']}{' (shared)' if d['shared'] else ''}: {_gib(d['free_mib'])} free"
        + ("" if d["exists"] else " (missing)") for d in node["weights"]) or "none")
    row("control plane", "\n".join(map(_server_line, node["servers"])) or "none given")
    row("certificate", node["identity"] or "(no tls in agent.yaml)")
    console.print(table)

    runs = Table(title="what it can run", title_justify="left")
    runs.add_column("engine")
    runs.add_column("can")
    runs.add_column("why")
    for c in capabilities:
        label = f"{c.engine} ({c.build})" if c.build else c.engine
        runs.add_row(escape(label), "[green]yes[/]" if c.can else "[red]no[/]", escape(c.why))
    console.print(runs)

    found = Table(title="findings", title_justify="left")
    found.add_column("severity")
    found.add_column("check")
    found.add_column("what")
    found.add_column("fix")
    for f in findings:
        found.add_row(f"[{_STYLE[f.severity]}]{f.severity}[/]", f.check, escape(f.summary),
                      escape(f.fix))
    console.print(found)
    blocking = sum(f.severity == "blocking" for f in findings)
    warnings = sum(f.severity == "warning" for f in findings)
    if blocking:
        console.print(f"[bold red]{blocking} problem(s) block this node[/]"
                      + (f", {warnings} warning(s)" if warnings else ""))
    else:
        console.print("[green]nothing blocks this node[/]"
                      + (f"; {warnings} warning(s)" if warnings else ""))


def _server_line(s: dict) -> str:
    route = s["route"]
    if route is None:
        return f"{s['url']}: no route ({s['route_error']})"
    via = f" through {route['gateway']}" if route["gateway"] else ""
    line = f"{s['url']}: from {route['source']} via {route['interface']}{via}"
    if s["reachable"] is False:
        return f"{line}; not answering ({s['error']})"
    if s["reachable"]:
        line += f"; answers in {s['round_trip_s'] * 1000:.0f} ms"
        if s["skew_s"] is not None:
            line += f", clock skew {s['skew_s']:+.1f} s"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    """Run the doctor as its own program (``python -m llmgw.cli.doctor``)."""
    parser = argparse.ArgumentParser(prog="llmgw doctor", description=_DESCRIPTION)
    _arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
