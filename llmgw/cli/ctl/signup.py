"""``llmgw ctl invites`` and ``signup``: who may make an account, for admins."""

from __future__ import annotations

import argparse

from llmgw.cli.ctl.client import call
from llmgw.cli.ctl.commands import Commands
from llmgw.cli.ctl.output import done


def invites_create(args: argparse.Namespace) -> None:
    reply = call(args, "POST", "/api/invites", {"expires_in_hours": args.hours})
    done(args, reply, reply["invite"])


def signup(args: argparse.Namespace) -> None:
    if args.mode:
        reply = call(args, "PUT", "/api/settings", {"signup": args.mode})
    else:
        reply = call(args, "GET", "/api/settings")
    done(args, reply, f"signup: {reply['signup']}")


def add_parsers(commands: Commands) -> None:
    invites = commands.group("invites", "signup invites (admins)")
    p = commands.add("create", invites_create, "make a single-use signup invite",
                     under=invites)
    p.add_argument("--hours", type=float, default=72.0)
    p = commands.add("signup", signup, "show or set who may sign up: open, invite, closed")
    p.add_argument("mode", nargs="?", choices=["open", "invite", "closed"])
