"""``llmgw ctl users``: accounts, for admins (docs/security.md)."""

from __future__ import annotations

import argparse

from llmgw.cli.ctl.client import EXIT_USAGE, CtlError, call, password
from llmgw.cli.ctl.commands import Commands
from llmgw.cli.ctl.output import done, show


def users_list(args: argparse.Namespace) -> None:
    show(args, call(args, "GET", "/api/users"),
         ["username", "role", "disabled", "created_at"], "users")


def users_add(args: argparse.Namespace) -> None:
    reply = call(args, "POST", "/api/users", {"username": args.username, "role": args.role,
                                              "password": password(args)})
    done(args, reply, f"added {reply['username']} ({reply['role']})")


def users_set(args: argparse.Namespace) -> None:
    change: dict = {}
    if args.role:
        change["role"] = args.role
    if args.disable or args.enable:
        change["disabled"] = bool(args.disable)
    if args.password_stdin or args.password:
        change["password"] = password(args, "new password: ")
    if not change:
        raise CtlError("nothing to change: give --role, --disable, --enable or --password",
                       EXIT_USAGE)
    reply = call(args, "PATCH", f"/api/users/{args.username}", change)
    state = ", disabled" if reply["disabled"] else ""
    done(args, reply, f"{reply['username']}: {reply['role']}{state}")


def add_parsers(commands: Commands) -> None:
    users = commands.group("users", "accounts (admins)")
    commands.add("list", users_list, "list accounts", under=users)
    p = commands.add("add", users_add, "add an account", under=users)
    p.add_argument("username")
    p.add_argument("--role", choices=["user", "admin"], default="user")
    p.add_argument("--password-stdin", action="store_true")
    p = commands.add("set", users_set, "change an account's role, password or state",
                     under=users)
    p.add_argument("username")
    p.add_argument("--role", choices=["user", "admin"])
    p.add_argument("--disable", action="store_true")
    p.add_argument("--enable", action="store_true")
    p.add_argument("--password", action="store_true", help="ask for a new password")
    p.add_argument("--password-stdin", action="store_true")
