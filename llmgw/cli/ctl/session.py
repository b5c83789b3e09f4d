"""``llmgw ctl login`` and ``logout``: a session token saved for ctl alone (mode 0600)."""

from __future__ import annotations

import argparse
import json
import os

from llmgw.cli.ctl.client import call, password, saved_session, server_url, session_file
from llmgw.cli.ctl.commands import Commands
from llmgw.cli.ctl.output import done


def login(args: argparse.Namespace) -> None:
    reply = call(args, "POST", "/api/auth/token",
                 {"username": args.username, "password": password(args)}, auth=False)
    path = session_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file may have been looser
    with os.fdopen(fd, "w") as f:
        json.dump({"server": server_url(args), "token": reply["token"]}, f)
    # Never the token itself: it is in the session file, for ctl alone.
    shown = {"server": server_url(args), "username": reply["username"], "role": reply["role"],
             "expires_at": reply["expires_at"], "session_file": str(path)}
    done(args, shown, f"logged in to {server_url(args)} as {reply['username']} "
                      f"({reply['role']}) until {reply['expires_at']}")


def logout(args: argparse.Namespace) -> None:
    saved = saved_session().get("token")
    if saved:
        # The saved session, whatever --token or $LLMGW_TOKEN say: it is the one to end.
        args.token = saved
        call(args, "POST", "/api/auth/logout", {})
    session_file().unlink(missing_ok=True)
    done(args, {"logged_out": True, "session_ended": bool(saved)}, "logged out")


def add_parsers(commands: Commands) -> None:
    p = commands.add("login", login, "log in as a user; the session is saved (0600)")
    p.add_argument("username")
    p.add_argument("--password-stdin", action="store_true")
    commands.add("logout", logout, "end the saved session")
