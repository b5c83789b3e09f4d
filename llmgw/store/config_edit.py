"""Pointing server.yaml at another store, editing it as text so its comments survive."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from pathlib import Path

from llmgw.config import ConfigError, ServerConfig, load
from llmgw.store.files import fsync_dir, replace_like, stamp, unique, write_like
from llmgw.store.records import StoreError
from llmgw.store.urls import mask, mask_text

log = logging.getLogger(__name__)


def point_config_at(config_path: Path, new_url: str) -> Path:
    """Set `store.url` in server.yaml to `new_url`, editing the text so every comment and
    the layout survive; returns the untouched copy kept as
    `server.yaml.before-postgres-<UTC time>`. If the result does not load with
    `store.url == new_url`, the old file is put back and StoreError raised."""
    path = Path(config_path)
    if path.is_symlink():
        raise StoreError(f"{path} is a symbolic link; set store.url where the file is made")
    try:
        old = path.read_bytes()
        st = path.stat()
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        new = with_store_url(old.decode("utf-8"), new_url).encode("utf-8")
    except UnicodeDecodeError:
        raise StoreError(f"{path} is not UTF-8 text; set store.url by hand") from None
    kept = unique(path.with_name(f"{path.name}.before-postgres-{stamp()}"))
    write_like(kept, old, st)
    replace_like(path, new, st)
    try:
        url = load(path, ServerConfig).store.url
        problem = None if url == new_url else f"store.url reads {mask(url)!r}"
    except ConfigError as exc:
        problem = mask_text(str(exc))
    if problem is not None:
        replace_like(path, old, st)
        kept.unlink(missing_ok=True)
        raise StoreError(
            f"editing {path} did not set store.url to {mask(new_url)} "
            f"({problem}); the file is back as it was: set store.url by hand"
        )
    log.info("%s: store.url is now %s; the old file is kept as %s", path, mask(new_url), kept)
    return kept


def check_editable(config_path: Path, password: bool) -> None:
    """Refuse, before anything is stopped, a server.yaml `point_config_at` could not edit,
    or one every user can read that would get a database password (`password`)."""
    path = Path(config_path)
    if path.is_symlink():
        raise StoreError(f"{path} is a symbolic link; set store.url where the file is made")
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}") from exc
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise StoreError(f"cannot write in {path.parent}, where {path.name} is replaced and "
                         "its old copy kept: run this as root or as the directory's owner")
    if password and mode & stat.S_IRWXO:
        raise StoreError(
            f"{path} is readable by every user (mode {mode:o}) and would hold the database "
            f"password: run `chmod o-rwx {path}` (the server's group may keep reading it), "
            "then run this again"
        )


def put_config_back(config_path: Path, kept: Path) -> None:
    """Undo `point_config_at`: the kept copy goes back in place as server.yaml."""
    path = Path(config_path)
    try:
        os.replace(kept, path)
        fsync_dir(path.parent)
    except OSError as exc:
        raise StoreError(
            f"cannot put {kept} back as {path}: {exc.strerror}; copy it there by hand"
        ) from exc
    log.info("%s is back as it was before the move", path)


_STORE_KEY = re.compile(r"store\s*:(?P<rest>.*)")
_URL_KEY = re.compile(r"url\s*:")


def with_store_url(config_text: str, url: str) -> str:
    """`config_text` (server.yaml) with `store.url` set to `url`; every other line as is.

    Replaces the `url:` line of a top-level block `store:` (with any continuation lines
    of its value), or adds one under `store:`, or appends a `store:` block at the end.
    The value is written as a JSON string, which is a valid YAML double-quoted scalar.
    """
    lines = config_text.splitlines(keepends=True)
    newline = "\r\n" if "\r\n" in config_text else "\n"
    entry = f"url: {json.dumps(url)}"
    start = next((i for i, line in enumerate(lines) if _STORE_KEY.fullmatch(_body(line))), None)
    if start is None:
        gap = newline if config_text and not config_text.endswith(("\n", "\r")) else ""
        return f"{config_text}{gap}store:{newline}  {entry}{newline}"
    end_of = _ending(lines[start]) or newline
    rest = _STORE_KEY.fullmatch(_body(lines[start])).group("rest").strip()
    if rest and not rest.startswith("#"):
        if rest.replace(" ", "") not in ("{}", "null", "~"):
            raise StoreError("server.yaml writes `store:` on one line; set store.url by hand")
        lines[start] = f"store:{end_of}  {entry}{end_of}"
        return "".join(lines)

    child_indent, url_at, stop = None, None, len(lines)
    for i in range(start + 1, len(lines)):
        body = _body(lines[i])
        stripped = body.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(body) - len(stripped)
        if indent == 0:
            stop = i
            break
        if child_indent is None:
            child_indent = indent
        if indent == child_indent and url_at is None and _URL_KEY.match(stripped):
            url_at = i
    indent = " " * (child_indent or 2)
    if url_at is None:
        lines[start] = _body(lines[start]) + end_of
        lines.insert(start + 1, f"{indent}{entry}{end_of}")
        return "".join(lines)
    last = url_at  # a value written over several lines: its deeper-indented continuation
    for i in range(url_at + 1, stop):
        body = _body(lines[i])
        stripped = body.lstrip(" ")
        if not stripped:
            continue
        if len(body) - len(stripped) <= len(indent):
            break
        last = i
    lines[url_at : last + 1] = [f"{indent}{entry}{_ending(lines[last])}"]
    return "".join(lines)


def _body(line: str) -> str:
    return line.rstrip("\r\n")


def _ending(line: str) -> str:
    return line[len(_body(line)) :]

