"""``llmgw ctl keys``: API keys, their limits and their usage (docs/gateway.md)."""

from __future__ import annotations

import argparse
import sys
from datetime import date

from llmgw.cli.ctl.client import call
from llmgw.cli.ctl.commands import Commands
from llmgw.cli.ctl.output import done, print_json, show, table
from llmgw.core.usage import duration_words

LIMIT_OPTIONS = ("rpm", "tpm", "tokens_per_day", "tokens_per_month")
_LIMIT_SHORT = {"rpm": "rpm", "tpm": "tpm", "tokens_per_day": "tokens/day",
                "tokens_per_month": "tokens/month"}
_LIMIT_WORDS = {"rpm": "requests per minute", "tpm": "tokens per minute",
                "tokens_per_day": "tokens per UTC day", "tokens_per_month": "tokens per UTC month"}
_NO_LIMIT = ("none", "off", "unlimited")
_UNSET = object()  # a limit option not given
_USAGE_COLUMNS = ["requests", "prompt_tokens", "completion_tokens", "total_tokens"]
_PREFIX_HELP = "the key's listed prefix, llmgw_ and 12 characters"


def keys_create(args: argparse.Namespace) -> None:
    payload = {"name": args.name, "models": args.model or None,
               "expires_in_days": args.expires_days, "owner": args.owner,
               "limits": {k: v for k, v in _given_limits(args).items() if v is not None}
               or None}
    reply = call(args, "POST", "/api/keys", {k: v for k, v in payload.items() if v is not None})
    if args.json:
        print_json(reply)
        return
    print(reply["key"])
    print(f"(shown once: only its hash is kept; listed as {reply['prefix']})", file=sys.stderr)


def keys_list(args: argparse.Namespace) -> None:
    keys = call(args, "GET", "/api/keys")
    show(args, keys, ["prefix", "name", "owner", "models", "limits", "expires_at",
                      "revoked_at"], "API keys",
         rows=[{**k, "limits": _limits_words(k.get("limits"))} for k in keys])


def keys_limits(args: argparse.Namespace) -> None:
    """Set the limits given; with none given, show them and what is used of them now."""
    change = _given_limits(args)
    if change:
        reply = call(args, "PATCH", f"/api/keys/{args.prefix}", {"limits": change})
        done(args, reply, f"{args.prefix}: {_limits_words(reply['limits']) or 'no limits'} "
                          "(from its next request on)")
        return
    reply = call(args, "GET", f"/api/keys/{args.prefix}/usage")
    if args.json:
        print_json(reply["limits"])
        return
    _limits_table(reply)


def keys_usage(args: argparse.Namespace) -> None:
    query = [f"{name}={value}" for name, value in (("since", args.since), ("until", args.until))
             if value]
    path = f"/api/keys/{args.prefix}/usage" + ("?" + "&".join(query) if query else "")
    reply = call(args, "GET", path)
    if args.json:
        print_json(reply)
        return
    _limits_table(reply)
    period = f"{reply['since']} to {reply['until']}"
    if not reply["days"]:
        print(f"no usage recorded from {period}")
        return
    table([_thousands(r) for r in reply["models"]], ["model", *_USAGE_COLUMNS],
          f"usage per model, {period}")
    table([_thousands(r) for r in reply["days"]], ["day", "model", *_USAGE_COLUMNS],
          "usage per day (UTC)")


def keys_revoke(args: argparse.Namespace) -> None:
    reply = call(args, "DELETE", f"/api/keys/{args.prefix}")
    done(args, reply, f"revoked {args.prefix}: it stops working at once")


def _limits_table(reply: dict) -> None:
    rows = [{"limit": row["limit"],
             "value": "none" if row["value"] is None else f"{row['value']:,}",
             "used now": f"{row['used']:,}",
             "window ends in": duration_words(row["resets_in_s"])} for row in reply["limits"]]
    table(rows, ["limit", "value", "used now", "window ends in"],
          f"limits of {reply['prefix']} (UTC windows)")


def _limits_words(limits: dict | None) -> str:
    """``60 rpm, 100,000 tokens/day``; empty for a key without limits."""
    return ", ".join(f"{v:,} {_LIMIT_SHORT[k]}" for k, v in (limits or {}).items()
                     if v is not None and k in _LIMIT_SHORT)


def _thousands(row: dict) -> dict:
    return {**row, **{c: f"{row[c]:,}" for c in _USAGE_COLUMNS}}


def _given_limits(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in LIMIT_OPTIONS
            if getattr(args, name, _UNSET) is not _UNSET}


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


def _date(text: str) -> str:
    try:
        return date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date like 2025-03-01") from None


def _limit_arguments(parser: argparse.ArgumentParser, who: str, lift: bool = False) -> None:
    for name in LIMIT_OPTIONS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=_limit_value,
                            default=_UNSET, metavar="N" + ("|none" if lift else ""),
                            help=f"{who}at most N {_LIMIT_WORDS[name]}"
                            + ("; none lifts it" if lift else " (default: no limit)"))


def add_parsers(commands: Commands) -> None:
    keys = commands.group("keys", "API keys")
    p = commands.add("create", keys_create, "make an API key; it is printed once", under=keys)
    p.add_argument("name")
    p.add_argument("--model", action="append", help="a model the key may use (repeat); "
                   "default: every model")
    p.add_argument("--expires-days", type=float)
    p.add_argument("--owner", help="admins: the account the key belongs to")
    _limit_arguments(p, "admins: ")
    commands.add("list", keys_list, "list API keys (yours; an admin sees all)", under=keys)
    p = commands.add("revoke", keys_revoke, "revoke a key; it stops working at once",
                     under=keys)
    p.add_argument("prefix", help=_PREFIX_HELP)
    p = commands.add("limits", keys_limits, "show a key's limits and what is used of them, "
                     "or (admins) set them: the limits given change, the others stay",
                     under=keys)
    p.add_argument("prefix", help=_PREFIX_HELP)
    _limit_arguments(p, "", lift=True)
    p = commands.add("usage", keys_usage, "a key's usage per model and UTC day, and its "
                     "limits now", under=keys)
    p.add_argument("prefix", help=_PREFIX_HELP)
    p.add_argument("--since", type=_date, help="first day, YYYY-MM-DD (default: 29 days "
                   "before --until)")
    p.add_argument("--until", type=_date, help="last day, YYYY-MM-DD (default: today, UTC)")
