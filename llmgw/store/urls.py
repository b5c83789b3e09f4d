"""Store URLs: which backend, the forms each tool wants, and never a password shown."""

from __future__ import annotations

import os
import re
from pathlib import Path

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from llmgw.config import ServerConfig
from llmgw.store.records import StoreError
from llmgw.store.store import SUPPORTED_SCHEMES, sqlite_url

# Query options SQLAlchemy's asyncpg dialect takes that libpq (pg_dump) would refuse.
_ASYNCPG_ONLY = frozenset(
    {
        "timeout",
        "command_timeout",
        "prepared_statement_cache_size",
        "statement_cache_size",
        "max_cached_statement_lifetime",
        "max_cacheable_statement_size",
        "async_fallback",
    }
)
_SSL_TO_SSLMODE = {"true": "require", "false": "disable"}
_PASSWORD_IN_URL = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s]*@", re.I)

def mask(url: str) -> str:
    """`url` with its password, if any, shown as ***."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return mask_text(url)


def mask_text(message: str, *urls: URL) -> str:
    """`message` with every password in a URL, and the passwords of `urls`, as ***."""
    message = _PASSWORD_IN_URL.sub(r"\g<head>***@", message)
    for url in urls:
        if url.password:
            message = message.replace(str(url.password), "***")
    return message


def backend(url: str) -> str:
    """ "sqlite" or "postgresql"; StoreError for a URL the store would not open."""
    return parse(url).get_backend_name()


def asyncpg_url(url: str) -> str:
    """A PostgreSQL URL for the store: `postgresql://` and `postgres://` get `+asyncpg`."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+asyncpg://" + url[len(plain) :]
    return url


def parse(url: str, want: str | None = None) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreError(f"the store URL {mask(url)!r} could not be parsed") from None
    if parsed.drivername not in SUPPORTED_SCHEMES:
        raise StoreError(
            f"store URL scheme {parsed.drivername!r} is not supported; use one of "
            + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        )
    if want is not None and parsed.get_backend_name() != want:
        raise StoreError(f"{shown(parsed)} is not a {want} URL")
    return parsed


def shown(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def sqlite_path(url: URL) -> Path:
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        raise StoreError(f"{shown(url)} is not a SQLite file on disk; nothing to copy")
    return Path(database)


def libpq(url: URL) -> tuple[str, dict[str, str]]:
    """The libpq URL for pg_dump/pg_restore, and their environment with PGPASSWORD: a
    password on a command line is visible to every user of the machine."""
    query = {k: v for k, v in url.query.items() if k not in _ASYNCPG_ONLY}
    if "ssl" in query:
        ssl = query.pop("ssl")
        query.setdefault("sslmode", _SSL_TO_SSLMODE.get(str(ssl).lower(), ssl))
    plain = URL.create(
        "postgresql",
        username=url.username,
        host=url.host,
        port=url.port,
        database=url.database,
        query=query,
    )
    env = dict(os.environ)
    if url.password is not None:
        env["PGPASSWORD"] = str(url.password)
    return plain.render_as_string(hide_password=False), env


def words(exc: BaseException, *urls: URL) -> str:
    """The driver's own message (never SQLAlchemy's, which lists the row's values)."""
    inner = getattr(exc, "orig", None) or exc
    return mask_text(str(inner).strip() or type(inner).__name__, *urls)


def store_url(config: ServerConfig) -> str:
    """The store server.yaml names, or the SQLite file in its state directory."""
    return config.store.url or sqlite_url(Path(config.state_dir) / "llmgw.db")
