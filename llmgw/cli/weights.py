"""``llmgw weights``: write the manifest of weights placed by hand, and list what the
configured weights directories hold.

Exit codes: 0 fine, 1 a directory (or the weights given) has problems, 2 bad usage or a
configuration that cannot be used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from llmgw.config import AgentConfig, ConfigError, load
from llmgw.core.weights import SourceError, parse_source

DEFAULT_CONFIG = "/etc/llmgw/agent.yaml"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "weights",
        help="write a weights manifest, or list the weights this node holds",
        description="Weights are a directory of files and llmgw-manifest.json, which names "
        "their key and every file's size and checksum. Only weights whose every file checks "
        "out count as held.",
    )
    cmds = p.add_subparsers(dest="weights_command", metavar="COMMAND", required=True)

    m = cmds.add_parser(
        "manifest",
        help="hash the files of weights placed by hand and write their manifest",
        description="Hash every file under DIR (sha256; hidden folders such as .git are "
        "left out) and write DIR/llmgw-manifest.json, so an agent counts DIR as holding KEY. "
        "Put DIR directly inside one of the agent's weights directories.",
    )
    m.add_argument("directory", type=Path, metavar="DIR", help="the weights' directory")
    m.add_argument("--key", required=True, metavar="KEY",
                   help="what the weights are: ORG/NAME@REVISION (with [PATTERNS] when the "
                   "profile names files) for a hub source, else the model's name")
    m.add_argument("--source", default="", metavar="SRC",
                   help="where they came from, e.g. hf://Qwen/Qwen2.5-0.5B-Instruct@main")
    m.set_defaults(func=_manifest)

    ls = cmds.add_parser(
        "list",
        help="list the weights directories and the complete weights in each",
        description="Scan the weights directories agent.yaml names, hashing files the first "
        "time, and print what each holds and what was skipped. Exit 1 when a directory has "
        "problems.",
    )
    ls.add_argument("--config", "-c", default=DEFAULT_CONFIG, metavar="agent.yaml",
                    help=f"the agent's configuration file (default {DEFAULT_CONFIG})")
    ls.add_argument("--json", action="store_true", help="print the result as JSON")
    ls.set_defaults(func=_list)


def _manifest(args: argparse.Namespace) -> int:
    # Imported here, as in each command: every `llmgw` command builds this parser, and
    # the agent's weights code brings aiohttp and pyroute2 (0.4 s of CPU to import).
    from llmgw.agent.weights import WeightsError, read_manifest, write_manifest

    if args.source:
        try:
            parse_source(args.source)
        except SourceError as err:
            print(f"llmgw weights manifest: --source: {err}", file=sys.stderr)
            return 2
    console = Console(highlight=False, markup=False, stderr=True)

    def hashing(path: str, size: int) -> None:
        console.print(f"hashing {path} ({size:,} bytes)")

    try:
        path = write_manifest(args.directory, args.key, args.source, on_file=hashing)
        manifest = read_manifest(args.directory)
    except WeightsError as err:
        print(f"llmgw weights manifest: {err}", file=sys.stderr)
        return 1
    total = sum(f.size for f in manifest.files)
    count = len(manifest.files)
    print(f"wrote {path}: {args.key}, {count} file{'s' if count != 1 else ''}, {total:,} bytes")
    return 0


def _list(args: argparse.Namespace) -> int:
    from llmgw.agent.weights import WeightsError, WeightsStore

    try:
        config = load(args.config, AgentConfig)
        store = WeightsStore.from_config(config)
    except (ConfigError, WeightsError) as err:
        print(f"llmgw weights list: {err}", file=sys.stderr)
        return 2
    dirs = store.scan()
    if args.json:
        print(json.dumps([msgspec.structs.asdict(d) for d in dirs], indent=1))
    else:
        table = Table(box=None, pad_edge=False)
        for column in ("directory", "shared", "free", "held", "notes"):
            table.add_column(column, overflow="fold")
        for d in dirs:
            free = f"{d.free_mib / 1024:.1f} of {d.total_mib / 1024:.1f} GiB" if d.total_mib \
                else "-"
            table.add_row(d.path, "yes" if d.shared else "no", free,
                          "\n".join(d.held) or "-", d.note or "")
        width = None if sys.stdout.isatty() else 160  # a pipe gets every key whole
        Console(highlight=False, markup=False, width=width).print(table)
    return 1 if any(d.note for d in dirs) else 0


def main(argv: list[str] | None = None) -> int:
    """``llmgw weights ...`` on its own: for tests and until it is wired into main."""
    top = argparse.ArgumentParser(prog="llmgw")
    add_parser(top.add_subparsers(dest="command", metavar="COMMAND", required=True))
    try:
        args = top.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
