"""Talking to the admin API: which server, whose credentials, and one request.

Every failure becomes a `CtlError` carrying its exit code, so a command only says what
went wrong and `llmgw ctl` exits with the code the package's docstring promises.
"""

from __future__ import annotations

import argparse
import getpass
import http.client
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_SERVER = "http://127.0.0.1:8080"
EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3


class CtlError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def session_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "llmgw" / "session.json"


def saved_session() -> dict:
    """What ``llmgw ctl login`` saved (server and token); empty when nothing was."""
    try:
        return json.loads(session_file().read_text())
    except (OSError, ValueError):
        return {}


def server_url(args: argparse.Namespace) -> str:
    return (args.server or os.environ.get("LLMGW_SERVER") or saved_session().get("server")
            or DEFAULT_SERVER).rstrip("/")


def _token(args: argparse.Namespace) -> str | None:
    return _token_and_source(args)[0]


def _token_and_source(args: argparse.Namespace) -> tuple[str | None, str]:
    """The token ctl sends, and where it took it from, in words."""
    if args.token:
        return args.token, "--token"
    if os.environ.get("LLMGW_TOKEN"):
        return os.environ["LLMGW_TOKEN"], "$LLMGW_TOKEN"
    return saved_session().get("token"), f"the session saved in {session_file()}"


def call(args: argparse.Namespace, method: str, path: str, payload: dict | None = None,
         auth: bool = True):
    """The API's JSON answer to one request; a refusal or no answer raises `CtlError`."""
    with _open(args, _request(args, method, path, payload, auth), timeout_s=30) as resp:
        try:
            body = resp.read()
        except OSError as err:
            raise _unreachable(args, err) from None
    return json.loads(body or b"null")


def stream(args: argparse.Namespace, path: str,
           timeout_s: float | None) -> http.client.HTTPResponse:
    """The open answer to ``GET path``, to read as it comes; a refusal or no answer raises
    `CtlError`. ``timeout_s`` bounds each wait for more (None: wait as long as it takes)."""
    return _open(args, _request(args, "GET", path), timeout_s)


def _request(args: argparse.Namespace, method: str, path: str, payload: dict | None = None,
             auth: bool = True) -> urllib.request.Request:
    headers = {"content-type": "application/json"}
    token = _token(args) if auth else None
    if auth and not token:
        raise CtlError("no credentials: pass --token (the admin token), set LLMGW_TOKEN, or "
                       "`llmgw ctl login USER` first", EXIT_USAGE)
    if token:
        headers["authorization"] = f"Bearer {token}"
    data = json.dumps(payload).encode() if payload is not None else None
    return urllib.request.Request(server_url(args) + path, data=data, headers=headers,
                                  method=method)


def _open(args: argparse.Namespace, request: urllib.request.Request,
          timeout_s: float | None) -> http.client.HTTPResponse:
    context = _tls_context(args) if request.type == "https" else None
    try:
        return urllib.request.urlopen(request, timeout=timeout_s, context=context)
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = err.reason
        if err.code == 401 and request.has_header("Authorization"):
            # Which token was refused: a stale $LLMGW_TOKEN hides a fresh login.
            message += f" (ctl sent the token from {_token_and_source(args)[1]})"
        raise CtlError(f"{request.get_method()} {request.selector}: {err.code} {message}",
                       EXIT_REFUSED) from None
    except (urllib.error.URLError, OSError) as err:
        raise _unreachable(args, err) from None


def _unreachable(args: argparse.Namespace, err: OSError) -> CtlError:
    reason = getattr(err, "reason", err)
    if isinstance(reason, ssl.SSLCertVerificationError):
        return CtlError(
            f"{server_url(args)} sent a certificate this machine does not trust "
            f"({reason.verify_message}): pass --ca-file with the cluster CA (the "
            "server's tls.ca_file, ca.pem from `llmgw server init`), or set "
            "LLMGW_CA_FILE", EXIT_UNREACHABLE)
    return CtlError(f"cannot reach {server_url(args)}: {reason}; is the server running, "
                    "and is --server right?", EXIT_UNREACHABLE)


def _tls_context(args: argparse.Namespace) -> ssl.SSLContext:
    """The cluster CA when given, else the system's."""
    ca_file = getattr(args, "ca_file", None) or os.environ.get("LLMGW_CA_FILE")
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as err:
        raise CtlError(f"cannot use {ca_file} as the CA: {getattr(err, 'strerror', None) or err}"
                       "; give the cluster CA's PEM file (the server's tls.ca_file)",
                       EXIT_USAGE) from None


def password(args: argparse.Namespace, prompt: str = "password: ") -> str:
    """From stdin with ``--password-stdin``, else asked for on the terminal."""
    if getattr(args, "password_stdin", False):
        return sys.stdin.readline().rstrip("\n")
    if not sys.stdin.isatty():
        raise CtlError("no terminal to ask for the password on: use --password-stdin",
                       EXIT_USAGE)
    return getpass.getpass(prompt)
