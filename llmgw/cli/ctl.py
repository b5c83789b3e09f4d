"""``llmgw ctl``: the operator's commands over the admin API.

Credentials, first found wins: ``--token``, ``$LLMGW_TOKEN``, then the session saved by
``llmgw ctl login``. The server: ``--server``, ``$LLMGW_SERVER``, the saved session's,
then http://127.0.0.1:8080. An https server's certificate is checked against
``--ca-file`` or ``$LLMGW_CA_FILE`` (the cluster CA), else the system's CAs.

Every command that prints takes ``--json``: one JSON document on stdout, for scripts.
Exit codes: 0 done, 1 refused by the server (the message says why), 2 bad usage (a wrong
option, a file that cannot be read, no credentials), 3 the server could not be reached or
its certificate is not trusted.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from datetime import date
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from llmgw.config import _StrictLoader
from llmgw.core.usage import duration_words

DEFAULT_SERVER = "http://127.0.0.1:8080"
EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3


class CtlError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def session_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "llmgw" / "session.json"


def _saved() -> dict:
    try:
        return json.loads(session_file().read_text())
    except (OSError, ValueError):
        return {}


def _server(args: argparse.Namespace) -> str:
    return (args.server or os.environ.get("LLMGW_SERVER") or _saved().get("server")
            or DEFAULT_SERVER).rstrip("/")


def _token(args: argparse.Namespace) -> str | None:
    return args.token or os.environ.get("LLMGW_TOKEN") or _saved().get("token")


def call(args: argparse.Namespace, method: str, path: str, payload: dict | None = None,
         auth: bool = True):
    headers = {"content-type": "application/json"}
    token = _token(args) if auth else None
    if auth and not token:
        raise CtlError("no credentials: pass --token (the admin token), set LLMGW_TOKEN, or "
                       "`llmgw ctl login USER` first", EXIT_USAGE)
    if token:
        headers["authorization"] = f"Bearer {token}"
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(_server(args) + path, data=data, headers=headers,
                                     method=method)
    context = _tls_context(args) if request.type == "https" else None
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = err.reason
        raise CtlError(f"{method} {path}: {err.code} {message}", EXIT_REFUSED) from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise CtlError(
                f"{_server(args)} sent a certificate this machine does not trust "
                f"({reason.verify_message}): pass --ca-file with the cluster CA (the "
                "server's tls.ca_file, ca.pem from `llmgw server init`), or set "
                "LLMGW_CA_FILE", EXIT_UNREACHABLE) from None
        raise CtlError(f"cannot reach {_server(args)}: {reason}; is the server running, "
                       "and is --server right?", EXIT_UNREACHABLE) from None


def _tls_context(args: argparse.Namespace) -> ssl.SSLContext:
    """The cluster CA when given, else the system's."""
    ca_file = getattr(args, "ca_file", None) or os.environ.get("LLMGW_CA_FILE")
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as err:
        raise CtlError(f"cannot use {ca_file} as the CA: {getattr(err, 'strerror', None) or err}"
                       "; give the cluster CA's PEM file (the server's tls.ca_file)",
                       EXIT_USAGE) from None


def _password(args: argparse.Namespace, prompt: str = "password: ") -> str:
    if getattr(args, "password_stdin", False):
        return sys.stdin.readline().rstrip("\n")
    if not sys.stdin.isatty():
        raise CtlError("no terminal to ask for the password on: use --password-stdin",
                       EXIT_USAGE)
    return getpass.getpass(prompt)


def _print(args: argparse.Namespace, value, columns: list[str] | None = None,
           title: str | None = None) -> None:
    if args.json or columns is None:
        print(json.dumps(value, indent=2))
        return
    table = Table(title=title, title_justify="left")
    for n, column in enumerate(columns):
        # The first column names the row (a key's prefix, a node, a model) for the next
        # command: whole on one line. Nothing is cut short with "…": a narrow terminal
        # folds a value onto more lines.
        table.add_column(column, no_wrap=n == 0, overflow="fold")
    for row in value:
        table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    Console(highlight=False).print(table)


# --- commands --------------------------------------------------------------------------------


def login(args):
    reply = call(args, "POST", "/api/auth/token",
                 {"username": args.username, "password": _password(args)}, auth=False)
    path = session_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file may have been looser
    with os.fdopen(fd, "w") as f:
        json.dump({"server": _server(args), "token": reply["token"]}, f)
    # Never the token itself: it is in the session file, for ctl alone.
    shown = {"server": _server(args), "username": reply["username"], "role": reply["role"],
             "expires_at": reply["expires_at"], "session_file": str(path)}
    _done(args, shown, f"logged in to {_server(args)} as {reply['username']} "
                       f"({reply['role']}) until {reply['expires_at']}")


def logout(args):
    saved = _saved().get("token")
    if saved:
        # The saved session, whatever --token or $LLMGW_TOKEN say: it is the one to end.
        args.token = saved
        call(args, "POST", "/api/auth/logout", {})
    session_file().unlink(missing_ok=True)
    _done(args, {"logged_out": True, "session_ended": bool(saved)}, "logged out")


LIMIT_OPTIONS = ("rpm", "tpm", "tokens_per_day", "tokens_per_month")
_LIMIT_SHORT = {"rpm": "rpm", "tpm": "tpm", "tokens_per_day": "tokens/day",
                "tokens_per_month": "tokens/month"}
_NO_LIMIT = ("none", "off", "unlimited")
_UNSET = object()  # a limit option not given


def _limit_value(text: str) -> int | None:
    """``--rpm 60``; ``none`` (or off, unlimited) lifts the limit."""
    if text.strip().lower() in _NO_LIMIT:
        return None
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a limit: give a whole number from 1 up, or none to lift it")
    return value


def _given_limits(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in LIMIT_OPTIONS
            if getattr(args, name, _UNSET) is not _UNSET}


def _limits_words(limits: dict | None) -> str:
    """``60 rpm, 100,000 tokens/day``; empty for a key without limits."""
    return ", ".join(f"{v:,} {_LIMIT_SHORT[k]}" for k, v in (limits or {}).items()
                     if v is not None and k in _LIMIT_SHORT)


def keys_create(args):
    payload = {"name": args.name, "models": args.model or None,
               "expires_in_days": args.expires_days, "owner": args.owner,
               "limits": {k: v for k, v in _given_limits(args).items() if v is not None}
               or None}
    reply = call(args, "POST", "/api/keys", {k: v for k, v in payload.items() if v is not None})
    if args.json:
        _print(args, reply)
        return
    print(reply["key"])
    print(f"(shown once: only its hash is kept; listed as {reply['prefix']})", file=sys.stderr)


def keys_list(args):
    keys = call(args, "GET", "/api/keys")
    if not args.json:
        keys = [{**k, "limits": _limits_words(k.get("limits"))} for k in keys]
    _print(args, keys, ["prefix", "name", "owner", "models", "limits", "expires_at",
                        "revoked_at"], "API keys")


def keys_limits(args):
    """Set the limits given; with none given, show them and what is used of them now."""
    change = _given_limits(args)
    if change:
        reply = call(args, "PATCH", f"/api/keys/{args.prefix}", {"limits": change})
        _done(args, reply, f"{args.prefix}: {_limits_words(reply['limits']) or 'no limits'} "
                           "(from its next request on)")
        return
    reply = call(args, "GET", f"/api/keys/{args.prefix}/usage")
    if args.json:
        _print(args, reply["limits"])
        return
    _print_limits(args, reply)


def _print_limits(args: argparse.Namespace, reply: dict) -> None:
    rows = [{"limit": row["limit"],
             "value": "none" if row["value"] is None else f"{row['value']:,}",
             "used now": f"{row['used']:,}",
             "window ends in": duration_words(row["resets_in_s"])} for row in reply["limits"]]
    _print(args, rows, ["limit", "value", "used now", "window ends in"],
           f"limits of {reply['prefix']} (UTC windows)")


def keys_usage(args):
    query = [f"{name}={value}" for name, value in (("since", args.since), ("until", args.until))
             if value]
    path = f"/api/keys/{args.prefix}/usage" + ("?" + "&".join(query) if query else "")
    reply = call(args, "GET", path)
    if args.json:
        _print(args, reply)
        return
    _print_limits(args, reply)
    period = f"{reply['since']} to {reply['until']}"
    if not reply["days"]:
        print(f"no usage recorded from {period}")
        return
    _print(args, [_thousands(r) for r in reply["models"]], ["model", *_USAGE_COLUMNS],
           f"usage per model, {period}")
    _print(args, [_thousands(r) for r in reply["days"]], ["day", "model", *_USAGE_COLUMNS],
           "usage per day (UTC)")


_USAGE_COLUMNS = ["requests", "prompt_tokens", "completion_tokens", "total_tokens"]


def _thousands(row: dict) -> dict:
    return {**row, **{c: f"{row[c]:,}" for c in _USAGE_COLUMNS}}


def _done(args: argparse.Namespace, reply, text: str) -> None:
    if args.json:
        _print(args, reply)
    else:
        print(text)


def keys_revoke(args):
    reply = call(args, "DELETE", f"/api/keys/{args.prefix}")
    _done(args, reply, f"revoked {args.prefix}: it stops working at once")


def users_list(args):
    _print(args, call(args, "GET", "/api/users"),
           ["username", "role", "disabled", "created_at"], "users")


def users_add(args):
    reply = call(args, "POST", "/api/users", {"username": args.username, "role": args.role,
                                              "password": _password(args)})
    _done(args, reply, f"added {reply['username']} ({reply['role']})")


def users_set(args):
    change: dict = {}
    if args.role:
        change["role"] = args.role
    if args.disable or args.enable:
        change["disabled"] = bool(args.disable)
    if args.password_stdin or args.password:
        change["password"] = _password(args, "new password: ")
    if not change:
        raise CtlError("nothing to change: give --role, --disable, --enable or --password",
                       EXIT_USAGE)
    reply = call(args, "PATCH", f"/api/users/{args.username}", change)
    state = ", disabled" if reply["disabled"] else ""
    _done(args, reply, f"{reply['username']}: {reply['role']}{state}")


def invites_create(args):
    reply = call(args, "POST", "/api/invites", {"expires_in_hours": args.hours})
    _done(args, reply, reply["invite"])


def signup(args):
    if args.mode:
        reply = call(args, "PUT", "/api/settings", {"signup": args.mode})
    else:
        reply = call(args, "GET", "/api/settings")
    _done(args, reply, f"signup: {reply['signup']}")


def nodes_list(args):
    nodes = call(args, "GET", "/api/nodes")
    if args.json:
        _print(args, nodes)
        return
    rows = []
    for n in nodes:
        engines = ", ".join(_engine_words(e) for e in n["engines"])
        disk = ", ".join(f"{d['path']} {d['free_mib'] / 1024:.0f} GiB free"
                         + (" (shared)" if d["shared"] else "")
                         for d in n.get("weights_dirs", []))
        rows.append({"node": n["id"], "state": n["state"], "address": n["address"],
                     "fabric": n["fabric"], "gpus": _gpu_words(n["gpus"]), "engines": engines,
                     "weights": disk, "replicas": ", ".join(n["replicas"]),
                     "warnings": "; ".join(n["warnings"])})
    _print(args, rows, ["node", "state", "address", "fabric", "gpus", "engines", "weights",
                        "replicas", "warnings"], "nodes")


def _gpu_words(gpus: list[dict]) -> str:
    """``2 x NVIDIA H100 80GB HBM3 (80 GiB)``; "-" for a node without GPUs."""
    kinds = Counter((g["name"], round(g["memory_total_mib"] / 1024)) for g in gpus)
    return ", ".join(f"{count} x {name} ({gib} GiB)"
                     for (name, gib), count in kinds.items()) or "-"


def _engine_words(engine: dict) -> str:
    """``llama.cpp b11434 installed``; the node's own words where it is not usable:
    ``llama.cpp b11434 installing (installing: downloading … (16 MB))``."""
    words = " ".join(filter(None, [engine["name"], engine.get("version"), engine["state"]]))
    if engine.get("detail") and engine["state"] not in ("installed", "configured"):
        words += f" ({engine['detail']})"
    return words


def nodes_drain(args):
    reply = call(args, "POST", f"/api/nodes/{args.node}/drain", {})
    _done(args, reply, f"{args.node} is draining: its replicas move, each stopping once its "
                       "replacement serves")


def nodes_undrain(args):
    reply = call(args, "POST", f"/api/nodes/{args.node}/undrain", {})
    _done(args, reply, f"{args.node} takes replicas again")


def nodes_add(args):
    reply = call(args, "POST", f"/api/nodes/{args.node}/join-tokens", {"ttl_s": args.ttl})
    if args.json:
        _print(args, reply)
        return
    print(f"run this on {reply['node']} (as root), before {reply['expires_at']}; the token "
          "works once:", file=sys.stderr)
    print(reply["command"])


def nodes_revoke(args):
    reply = call(args, "POST", f"/api/nodes/{args.node}/revoke", {})
    if reply["revoked"]:
        text = (f"revoked {args.node}: certificate serial(s) {', '.join(reply['revoked'])}; "
                "its agent stream is closed and every handshake refused. To let it back, "
                f"llmgw ctl nodes add {args.node} and join it again")
    else:
        text = f"{args.node} has no unexpired certificate: nothing to revoke"
    _done(args, reply, text)


def _weights_words(held: list[dict]) -> str:
    """``ib-a: shared /lustre/w; ib-b: node3, node4``; "-" when no node holds them."""
    parts = []
    for entry in held:
        where = [f"shared {p}" for p in entry["shared"]] + entry["nodes"]
        parts.append(f"{entry['fabric'] or 'no fabric'}: {', '.join(where)}")
    return "; ".join(parts) or "-"


def status(args):
    reply = call(args, "GET", "/api/status")
    if args.json:
        _print(args, reply)
        return
    console = Console(highlight=False)
    models = Table(title="models", title_justify="left")
    for column in ("model", "ready", "wanted", "priority", "on", "weights in", "why not all"):
        models.add_column(column)
    for m in reply["models"]:
        nodes = sorted({s["node"] for r in reply["replicas"] if r["model"] == m["name"]
                        for s in r["shards"]})
        models.add_row(m["name"], str(m["replicas_ready"]), str(m["replicas_wanted"]),
                       str(m["priority"]), ", ".join(nodes) or "-",
                       _weights_words(m.get("weights", [])), m["unplaced"] or "")
    console.print(models)
    replicas = Table(title="replicas", title_justify="left")
    for column in ("replica", "model", "state", "where", "reason"):
        replicas.add_column(column)
    for r in reply["replicas"]:
        where = "+".join(f"{s['node']}:{s['port']}" for s in r["shards"])
        # While starting, the shards' own words say what they are doing ("fetching …").
        doing = "; ".join(f"rank {s['rank']}: {s['detail']}" for s in r["shards"]
                          if s["detail"] and s["state"] != "ready")
        replicas.add_row(r["id"], r["model"], r["state"], where,
                         doing if r["state"] == "starting" and doing else r["reason"])
    console.print(replicas)
    fabrics = Table(title="fabrics", title_justify="left")
    for column in ("fabric", "nodes", "gpus", "replicas", "weights of"):
        fabrics.add_column(column)
    for row in _fabric_rows(reply):
        fabrics.add_row(*row)
    console.print(fabrics)


def _fabric_rows(reply: dict) -> list[tuple[str, ...]]:
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
        rows.append((fabric or "no fabric",
                     ", ".join(f"{n['id']} ({n['state']})" for n in nodes),
                     str(sum(len(n["gpus"]) for n in nodes)),
                     ", ".join(sorted(r for n in nodes for r in n["replicas"])) or "-",
                     ", ".join(weights) or "-"))
    return rows


def _model_path(name: str) -> str:
    return "/api/models/" + urllib.parse.quote(name, safe="/:")


def _replicas_words(model: dict) -> str:
    """``3 (server.yaml: 1)`` for a server.yaml model scaled over the API."""
    if model.get("overridden"):
        return f"{model['replicas']} (server.yaml: {model['replicas_in_config']})"
    return str(model["replicas"])


def models_list(args):
    models = call(args, "GET", "/api/models")
    if not args.json:
        models = [{**m, "model": m["name"], "replicas": _replicas_words(m),
                   "ready": m["replicas_ready"],
                   "engines": ", ".join(f"{p['name']}: {p['engine']}"
                                        for p in m.get("profiles", [])),
                   "on": ", ".join(m.get("placed_on", [])),
                   "why not all": m.get("unplaced")} for m in models]
    _print(args, models, ["model", "source", "replicas", "ready", "engines", "on",
                          "why not all"], "models")


_MODEL_FLAGS = ("engine", "replicas", "gpus", "nodes", "source", "weights", "arg", "priority",
                "description")


def models_add(args):
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
    _done(args, reply, f"added {reply['name']}: {reply['replicas']} replica(s) wanted; "
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


def models_remove(args):
    reply = call(args, "DELETE", _model_path(args.name))
    _done(args, reply, f"removed {args.name}: its replicas stop")


def models_scale(args):
    if (args.replicas is None) == (not args.reset):
        raise CtlError("give the number of replicas, or --reset to go back to "
                       "server.yaml's", EXIT_USAGE)
    reply = call(args, "PATCH", _model_path(args.name), {"replicas": args.replicas})
    name = reply["name"]
    text = f"{name}: {reply['replicas']} replica(s) wanted"
    if reply.get("overridden"):
        text += (f" (server.yaml: {reply['replicas_in_config']}; `llmgw ctl models scale "
                 f"{name} --reset` goes back to it)")
    _done(args, reply, text)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: give a whole number "
                                         "from 0 up")
    return value


def _common_options(default: object = None) -> argparse.ArgumentParser:
    """The options every command takes, each defaulting to ``default`` where given."""
    common = argparse.ArgumentParser(add_help=False, argument_default=default)
    common.add_argument("--server", help="the server's URL (default: $LLMGW_SERVER, the "
                        f"saved session's, or {DEFAULT_SERVER})")
    common.add_argument("--token", help="the admin token or a session token "
                        "(default: $LLMGW_TOKEN, or the saved session)")
    common.add_argument("--ca-file", help="the cluster CA's PEM file, to trust an https "
                        "server (default: $LLMGW_CA_FILE, else the system's CAs)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")
    return common


def add_parsers(ctl) -> None:
    """The account and key commands, under an existing ``llmgw ctl`` parser."""
    common = _common_options()
    # Under a group that takes the options too (``nodes --json list``): a command's own
    # defaults would overwrite what the group parsed, so it has none.
    common_in_group = _common_options(argparse.SUPPRESS)
    groups = []

    def command(parent, name, func, help_text):
        options = common_in_group if parent in groups else common
        p = parent.add_parser(name, parents=[options], help=help_text, description=help_text)
        p.set_defaults(func=lambda a: _run(func, a))
        return p

    p = command(ctl, "login", login, "log in as a user; the session is saved (0600)")
    p.add_argument("username")
    p.add_argument("--password-stdin", action="store_true")
    command(ctl, "logout", logout, "end the saved session")

    keys = ctl.add_parser("keys", help="API keys").add_subparsers(
        dest="keys_command", metavar="COMMAND", required=True)
    p = command(keys, "create", keys_create, "make an API key; it is printed once")
    p.add_argument("name")
    p.add_argument("--model", action="append", help="a model the key may use (repeat); "
                   "default: every model")
    p.add_argument("--expires-days", type=float)
    p.add_argument("--owner", help="admins: the account the key belongs to")
    _limit_arguments(p, "admins: ")
    command(keys, "list", keys_list, "list API keys (yours; an admin sees all)")
    p = command(keys, "revoke", keys_revoke, "revoke a key; it stops working at once")
    p.add_argument("prefix", help="the key's listed prefix, llmgw_ and 12 characters")
    p = command(keys, "limits", keys_limits, "show a key's limits and what is used of them, "
                "or (admins) set them: the limits given change, the others stay")
    p.add_argument("prefix", help="the key's listed prefix, llmgw_ and 12 characters")
    _limit_arguments(p, "", lift=True)
    p = command(keys, "usage", keys_usage, "a key's usage per model and UTC day, and its "
                "limits now")
    p.add_argument("prefix", help="the key's listed prefix, llmgw_ and 12 characters")
    p.add_argument("--since", type=_date, help="first day, YYYY-MM-DD (default: 29 days "
                   "before --until)")
    p.add_argument("--until", type=_date, help="last day, YYYY-MM-DD (default: today, UTC)")

    users = ctl.add_parser("users", help="accounts (admins)").add_subparsers(
        dest="users_command", metavar="COMMAND", required=True)
    command(users, "list", users_list, "list accounts")
    p = command(users, "add", users_add, "add an account")
    p.add_argument("username")
    p.add_argument("--role", choices=["user", "admin"], default="user")
    p.add_argument("--password-stdin", action="store_true")
    p = command(users, "set", users_set, "change an account's role, password or state")
    p.add_argument("username")
    p.add_argument("--role", choices=["user", "admin"])
    p.add_argument("--disable", action="store_true")
    p.add_argument("--enable", action="store_true")
    p.add_argument("--password", action="store_true", help="ask for a new password")
    p.add_argument("--password-stdin", action="store_true")

    def group(name, listing, help_text):
        """A group of commands whose bare name lists, as its ``list`` does."""
        p = command(ctl, name, listing, f"{help_text}; alone: list")
        groups.append(p.add_subparsers(dest=f"{name}_command", metavar="COMMAND"))
        return groups[-1]

    command(ctl, "status", status, "models, their replicas and where they run")
    nodes = group("nodes", nodes_list, "nodes (admins)")
    command(nodes, "list", nodes_list, "each node: state, address, GPUs, engines, warnings")
    p = command(nodes, "drain", nodes_drain, "move a node's replicas away, for maintenance")
    p.add_argument("node")
    p = command(nodes, "undrain", nodes_undrain, "let a drained node take replicas again")
    p.add_argument("node")
    p = command(nodes, "add", nodes_add, "make a one-time join token for a new node and "
                "print the command to run on it")
    p.add_argument("node", help="the node's id (its hostname)")
    p.add_argument("--ttl", type=float, default=3600.0, metavar="SECONDS",
                   help="how long the token is good for (default 3600)")
    p = command(nodes, "revoke", nodes_revoke, "revoke a node's certificates: its stream is "
                "closed and it cannot connect again until it joins again")
    p.add_argument("node")

    models = group("models", models_list, "models: list, add, remove, scale")
    command(models, "list", models_list, "every model: where it is declared, replicas wanted "
            "and ready, where they run")
    p = command(models, "add", models_add, "add a model (admins); it is kept in the store "
                "and survives restarts")
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
    p = command(models, "remove", models_remove, "remove a model added over the API "
                "(admins); its replicas stop. server.yaml's models are removed there")
    p.add_argument("name")
    p = command(models, "scale", models_scale, "set how many replicas a model keeps "
                "(admins); for a server.yaml model, an override kept until --reset")
    p.add_argument("name")
    p.add_argument("replicas", nargs="?", type=_count)
    p.add_argument("--reset", action="store_true",
                   help="back to server.yaml's replicas")

    invites = ctl.add_parser("invites", help="signup invites (admins)").add_subparsers(
        dest="invites_command", metavar="COMMAND", required=True)
    p = command(invites, "create", invites_create, "make a single-use signup invite")
    p.add_argument("--hours", type=float, default=72.0)
    p = command(ctl, "signup", signup, "show or set who may sign up: open, invite, closed")
    p.add_argument("mode", nargs="?", choices=["open", "invite", "closed"])


def _limit_arguments(parser: argparse.ArgumentParser, who: str, lift: bool = False) -> None:
    words = {"rpm": "requests per minute", "tpm": "tokens per minute",
             "tokens_per_day": "tokens per UTC day", "tokens_per_month": "tokens per UTC month"}
    for name in LIMIT_OPTIONS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=_limit_value,
                            default=_UNSET, metavar="N" + ("|none" if lift else ""),
                            help=f"{who}at most N {words[name]}"
                            + ("; none lifts it" if lift else " (default: no limit)"))


def _date(text: str) -> str:
    try:
        return date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date like 2025-03-01") from None


def _run(func, args) -> int:
    try:
        func(args)
    except CtlError as err:
        print(f"llmgw ctl: {err}", file=sys.stderr)
        return err.code
    return 0
