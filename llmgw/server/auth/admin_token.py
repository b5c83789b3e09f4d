"""The admin token: the cluster's root credential, kept in a file only its owner reads."""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path


class SecretsFileError(Exception):
    """A secrets file that is unsafe or unreadable; the message says how to fix it."""


def load_or_create_admin_token(state_dir: str | Path) -> tuple[str, bool]:
    """The admin token from ``<state_dir>/secrets/admin-token``, made at first start.

    Returns ``(token, created)``. Refuses a file that others can read: the token is root
    of the cluster's trust, so the server will not run with it exposed.
    """
    directory = Path(state_dir) / "secrets"
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / "admin-token"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        token = "llmgw_admin_" + secrets.token_urlsafe(32)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token, True
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretsFileError(
            f"{path} is readable by other users (mode {stat.S_IMODE(mode):o}); "
            f"run `chmod 600 {path}` and start again"
        )
    token = path.read_text().strip()
    if not token:
        raise SecretsFileError(f"{path} is empty; delete it to have a new token made")
    return token, False


def read_secret_file(path: str | os.PathLike, what: str) -> str:
    """A token kept in a file the operator gives (``what`` names it in errors): the file's
    only line. Refuses a file others can read, or an empty one."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        token = file.read_text().strip()
    except OSError as err:
        raise SecretsFileError(f"cannot read the {what} {file}: {err.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretsFileError(f"{file} is readable by other users (mode "
                               f"{stat.S_IMODE(mode):o}); run `chmod 600 {file}`")
    if not token:
        raise SecretsFileError(f"the {what} file {file} is empty")
    return token


def load_admin_token(state_dir: str | Path, token_file: str | None) -> tuple[str, bool]:
    """``(token, created)``: from ``auth.admin_token_file`` when set (every server of a
    cluster then takes the same token), else from the state directory."""
    if token_file:
        return read_secret_file(token_file, "admin token"), False
    return load_or_create_admin_token(state_dir)


def admin_token_ok(expected: str, presented: str | None) -> bool:
    return presented is not None and hmac.compare_digest(expected.encode(), presented.encode())
