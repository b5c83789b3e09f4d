"""``llmgw ctl``: the operator's commands over the admin API.

Credentials, first found wins: ``--token``, ``$LLMGW_TOKEN``, then the session saved by
``llmgw ctl login``. The server: ``--server``, ``$LLMGW_SERVER``, the saved session's,
then http://127.0.0.1:8080. Exit codes: 0 done, 1 refused by the server (the message says
why), 2 bad usage, 3 the server could not be reached.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import urllib.error
import urllib.request
from datetime import date
from pathlib import Path

from rich.console import Console
from rich.table import Table

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
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = err.reason
        raise CtlError(f"{method} {path}: {err.code} {message}", EXIT_REFUSED) from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise CtlError(f"cannot reach {_server(args)}: {reason}; is the server running, "
                       "and is --server right?", EXIT_UNREACHABLE) from None


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
    for column in columns:
        table.add_column(column)
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
    print(f"logged in to {_server(args)} as {reply['username']} ({reply['role']}) "
          f"until {reply['expires_at']}")


def logout(args):
    saved = _saved().get("token")
    if saved:
        # The saved session, whatever --token or $LLMGW_TOKEN say: it is the one to end.
        args.token = saved
        call(args, "POST", "/api/auth/logout", {})
    session_file().unlink(missing_ok=True)
    print("logged out")


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
        engines = ", ".join(f"{e['name']} {e['state']}" + (f" ({e['detail']})" if e['detail']
                            and e['state'] not in ("installed", "configured") else "")
                            for e in n["engines"])
        disk = ", ".join(f"{d['path']} {d['free_mib'] / 1024:.0f} GiB free"
                         + (" (shared)" if d["shared"] else "")
                         for d in n.get("weights_dirs", []))
        rows.append({"node": n["id"], "state": n["state"], "address": n["address"],
                     "fabric": n["fabric"], "gpus": len(n["gpus"]), "engines": engines,
                     "weights": disk, "replicas": ", ".join(n["replicas"]),
                     "warnings": "; ".join(n["warnings"])})
    _print(args, rows, ["node", "state", "address", "fabric", "gpus", "engines", "weights",
                        "replicas", "warnings"], "nodes")


def nodes_drain(args):
    reply = call(args, "POST", f"/api/nodes/{args.node}/drain", {})
    _done(args, reply, f"{args.node} is draining: its replicas move, each stopping once its "
                       "replacement serves")


def nodes_undrain(args):
    reply = call(args, "POST", f"/api/nodes/{args.node}/undrain", {})
    _done(args, reply, f"{args.node} takes replicas again")


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
    for column in ("model", "ready", "wanted", "priority", "weights in", "why not all"):
        models.add_column(column)
    for m in reply["models"]:
        models.add_row(m["name"], str(m["replicas_ready"]), str(m["replicas_wanted"]),
                       str(m["priority"]), _weights_words(m.get("weights", [])),
                       m["unplaced"] or "")
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


def add_parsers(ctl) -> None:
    """The account and key commands, under an existing ``llmgw ctl`` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--server", help="the server's URL (default: $LLMGW_SERVER, the "
                        f"saved session's, or {DEFAULT_SERVER})")
    common.add_argument("--token", help="the admin token or a session token "
                        "(default: $LLMGW_TOKEN, or the saved session)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")

    def command(parent, name, func, help_text):
        p = parent.add_parser(name, parents=[common], help=help_text, description=help_text)
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

    command(ctl, "status", status, "models, their replicas and where they run")
    nodes = ctl.add_parser("nodes", help="nodes (admins)").add_subparsers(
        dest="nodes_command", metavar="COMMAND", required=True)
    command(nodes, "list", nodes_list, "each node: state, address, GPUs, engines, warnings")
    p = command(nodes, "drain", nodes_drain, "move a node's replicas away, for maintenance")
    p.add_argument("node")
    p = command(nodes, "undrain", nodes_undrain, "let a drained node take replicas again")
    p.add_argument("node")

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
