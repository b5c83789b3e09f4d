"""Sessions for the web page and for ``llmgw ctl`` logged in as a user.

A session token is random and only its SHA-256 is stored. The page gets it as an
HttpOnly, SameSite=Strict cookie, which scripts cannot read and other sites cannot send;
the CLI gets it once, as a bearer token.

SameSite is not the only guard: a request that changes something and is carried by the
cookie must say ``Content-Type: application/json``, body or not. A form on another site
can send only urlencoded, multipart or text/plain bodies, and a script on another site
that sets the JSON type must first ask (a CORS preflight), which this server never grants.
The check is made where the cookie is read (``session_token``), so no handler can miss it.
A bearer token (the admin token, or a session in ``Authorization``) is never sent by a
browser on its own, and needs no such check. Login and signup, which set the cookie, need
JSON too: a form on another site must not log a browser in as someone else.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from litestar.connection import ASGIConnection

from llmgw.server.auth.admin_token import admin_token_ok
from llmgw.server.auth.keys import bearer
from llmgw.server.errors import ApiError
from llmgw.store import SessionRecord, Store

SESSION_PREFIX = "llmgws_"
COOKIE = "llmgw_session"
# Methods that change nothing on /api; every other one needs JSON when the cookie carries it.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def open_session(store: Store, account_id: int, ttl_s: float) -> tuple[str, datetime]:
    token = SESSION_PREFIX + secrets.token_urlsafe(32)
    now = datetime.now(UTC)
    expires = now + timedelta(seconds=ttl_s)
    await store.add_session(SessionRecord(token_hash=_hash(token), account_id=account_id,
                                          created_at=now, expires_at=expires))
    return token, expires


async def close_session(store: Store, token: str) -> None:
    await store.delete_session(_hash(token))


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking: an account, or the holder of the admin token."""

    account_id: int | None
    username: str
    role: str
    session_token: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


ADMIN_TOKEN_HOLDER = Principal(None, "(admin token)", "admin")


def _is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


def require_json(connection: ASGIConnection, what: str, otherwise: str = "") -> None:
    """Refuse (415) a request a form on another site could have sent: one without
    ``Content-Type: application/json``. ``what`` names the request in the message,
    ``otherwise`` adds another way to send it."""
    if not _is_json(connection.headers.get("content-type")):
        raise ApiError(415, f"{what} must be sent with `Content-Type: application/json`, "
                       f"even without a body (a form on another site cannot send that){otherwise}",
                       code="json_required")


def session_token(connection: ASGIConnection) -> str | None:
    """The session a request carries: a bearer ``llmgws_`` token, else the cookie. A
    cookie on a request that may change something is taken only with a JSON content type
    (see the module's docstring); without one the request is refused with 415."""
    token = bearer(connection.headers.get("authorization"))
    if token and token.startswith(SESSION_PREFIX):
        return token
    cookie = connection.cookies.get(COOKIE)
    method = connection.scope.get("method", "GET").upper()
    if cookie and method not in SAFE_METHODS:
        require_json(connection, f"a {method} with the session cookie",
                     "; or send the session as `Authorization: Bearer llmgws_…`")
    return cookie


async def resolve(connection: ASGIConnection, admin_token: str, store: Store
                  ) -> Principal | None:
    """The principal behind a request, or None for an anonymous one."""
    token = bearer(connection.headers.get("authorization"))
    if token and admin_token_ok(admin_token, token):
        return ADMIN_TOKEN_HOLDER
    session = session_token(connection)
    if not session:
        return None
    return await session_principal(store, session)


async def session_principal(store: Store, session: str) -> Principal | None:
    """The account a session token stands for, while the session and the account last."""
    record = await store.find_session(_hash(session))
    if record is None or record.expires_at <= datetime.now(UTC):
        return None
    account = await store.get_account(record.account_id)
    if account is None or account.disabled_at is not None:
        return None
    return Principal(account.id, account.username, account.role, session)
