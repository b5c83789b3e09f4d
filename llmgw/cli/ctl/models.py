"""``llmgw ctl models``: list, add, remove and scale models (docs/ctl.md#models)."""

from __future__ import annotations

import argparse
import sys
import urllib.parse
from pathlib import Path

import yaml

from llmgw.cli.ctl.client import EXIT_REFUSED, EXIT_USAGE, CtlError, call
from llmgw.cli.ctl.commands import Commands
from llmgw.cli.ctl.output import done, show, why_not_all
from llmgw.config import _StrictLoader

_MODEL_FLAGS = ("engine", "replicas", "gpus", "nodes", "source", "weights", "arg", "priority",
                "description")


def models_list(args: argparse.Namespace) -> None:
    models = call(args, "GET", "/api/models")
    rows = [{**m, "model": m["name"], "replicas": _replicas_words(m),
             "ready": m["replicas_ready"], "aliases": ", ".join(m.get("aliases", [])),
             "fallbacks": ", ".join(m.get("fallbacks", [])),
             "engines": ", ".join(f"{p['name']}: {p['engine']}" for p in m.get("profiles", [])),
             "endpoints": _endpoints_words(m),
             "on": ", ".join(m.get("placed_on", [])),
             "why not all": why_not_all(m)} for m in models]
    show(args, models, ["model", "aliases", "fallbacks", "source", "replicas", "ready",
                        "engines", "endpoints", "on", "why not all"], "models", rows=rows)


def _endpoints_words(model: dict) -> str:
    """Each static endpoint and its health (``http://10.0.0.5:8000/v1 down: connection
    refused``); for a user, how many of them are up."""
    endpoints = model.get("endpoints")
    if endpoints is None:
        declared = model.get("endpoints_declared", 0)
        return f"{model.get('endpoints_ready', 0)}/{declared} up" if declared else ""
    return ", ".join(f"{e['url']} {e['health']}" + (f": {e['reason']}" if e.get("reason")
                                                   else "") for e in endpoints)


def _replicas_words(model: dict) -> str:
    """``3 (server.yaml: 1)`` for a server.yaml model scaled over the API."""
    if model.get("overridden"):
        return f"{model['replicas']} (server.yaml: {model['replicas_in_config']})"
    return str(model["replicas"])


def models_add(args: argparse.Namespace) -> None:
    if args.file:
        given = [f"--{f}" for f in _MODEL_FLAGS if getattr(args, f) not in (None, [])]
        if args.name or given:
            raise CtlError("with --file, write the whole model in the file; NAME and "
                           f"{', '.join(given) or 'the flags'} are for the simple case",
                           EXIT_USAGE)
        spec = _model_file(args.file)
    else:
        if not args.name or not args.engine:
            raise CtlError("give NAME and --engine (sim, llama.cpp, vllm, sglang, comfyui), "
                           "or --file model.yaml with the model as in server.yaml's models:",
                           EXIT_USAGE)
        profile = {"engine": args.engine, "gpus": args.gpus, "nodes": args.nodes,
                   "source": args.source, "weights": args.weights, "args": args.arg}
        spec = {"name": args.name, "replicas": args.replicas, "priority": args.priority,
                "description": args.description,
                "profiles": [{k: v for k, v in profile.items() if v not in (None, [])}]}
        spec = {k: v for k, v in spec.items() if v is not None}
    try:
        reply = call(args, "POST", "/api/models", spec)
    except CtlError as err:
        if args.file and err.code == EXIT_REFUSED:
            raise CtlError(f"{err} (in {args.file})", err.code) from None
        raise
    done(args, reply, f"added {reply['name']}: {reply['replicas']} replica(s) wanted; "
                      "`llmgw ctl status` shows where they start")


def _model_file(path: str) -> dict:
    """One model as written under server.yaml's ``models:`` (YAML or JSON; - for stdin)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        data = yaml.load(text, Loader=_StrictLoader)
    except OSError as err:
        raise CtlError(f"{path}: cannot read: {err.strerror}", EXIT_USAGE) from None
    except UnicodeDecodeError:
        raise CtlError(f"{path}: not a text file (not UTF-8)", EXIT_USAGE) from None
    except yaml.YAMLError as err:
        raise CtlError(f"{path}: not valid YAML or JSON: {err}", EXIT_USAGE) from None
    if isinstance(data, list) and len(data) == 1:
        data = data[0]  # an entry copied with its dash
    if isinstance(data, dict) and "models" in data:
        raise CtlError(f"{path} looks like a whole server.yaml: give one model, one entry "
                       "of its models: list", EXIT_USAGE)
    if not isinstance(data, dict):
        raise CtlError(f"{path}: expected one model (name, profiles, ...), as one entry of "
                       "server.yaml's models:", EXIT_USAGE)
    return data


def models_remove(args: argparse.Namespace) -> None:
    reply = call(args, "DELETE", _model_path(args.name))
    done(args, reply, f"removed {args.name}: its replicas stop")


def models_scale(args: argparse.Namespace) -> None:
    if (args.replicas is None) == (not args.reset):
        raise CtlError("give the number of replicas, or --reset to go back to "
                       "server.yaml's", EXIT_USAGE)
    reply = call(args, "PATCH", _model_path(args.name), {"replicas": args.replicas})
    name = reply["name"]
    text = f"{name}: {reply['replicas']} replica(s) wanted"
    if reply.get("overridden"):
        text += (f" (server.yaml: {reply['replicas_in_config']}; `llmgw ctl models scale "
                 f"{name} --reset` goes back to it)")
    done(args, reply, text)


def _model_path(name: str) -> str:
    return "/api/models/" + urllib.parse.quote(name, safe="/:")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: give a whole number "
                                         "from 0 up")
    return value


def add_parsers(commands: Commands) -> None:
    models = commands.listing_group("models", models_list, "models: list, add, remove, scale")
    commands.add("list", models_list, "every model: where it is declared, replicas wanted "
                 "and ready, where they run", under=models)
    p = commands.add("add", models_add, "add a model (admins); it is kept in the store "
                     "and survives restarts", under=models)
    p.add_argument("name", nargs="?", help="the model's name (with --engine)")
    p.add_argument("--file", "-f", metavar="model.yaml", help="the model as one entry of "
                   "server.yaml's models: (YAML or JSON; - reads stdin)")
    p.add_argument("--engine", help="the engine of its one profile")
    p.add_argument("--replicas", type=_count, help="default 1")
    p.add_argument("--gpus", type=_count, help="GPUs per shard (default 0)")
    p.add_argument("--nodes", type=_count, help="nodes per replica (default 1)")
    p.add_argument("--source", help="where weights come from: hf://ORG/NAME[@REV]")
    p.add_argument("--weights", help="a path on the node that the engine loads")
    p.add_argument("--arg", action="append", default=[], help="an engine argument (repeat)")
    p.add_argument("--priority", type=int)
    p.add_argument("--description")
    p = commands.add("remove", models_remove, "remove a model added over the API "
                     "(admins); its replicas stop. server.yaml's models are removed there",
                     under=models)
    p.add_argument("name")
    p = commands.add("scale", models_scale, "set how many replicas a model keeps "
                     "(admins); for a server.yaml model, an override kept until --reset",
                     under=models)
    p.add_argument("name")
    p.add_argument("replicas", nargs="?", type=_count)
    p.add_argument("--reset", action="store_true", help="back to server.yaml's replicas")
