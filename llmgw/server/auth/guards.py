"""Who may call an ``/api`` handler, checked by Litestar before the handler runs.

``signed_in`` lets in an account's session or the admin token; ``admin_only`` an admin of
either kind. Both put the caller in the request's scope (``request.user``), where the
``principal`` dependency hands it to the handler, so no handler resolves it again.
``json_only`` refuses a login or signup a form on another site could have sent (see
``sessions``).
"""

from __future__ import annotations

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import Provide
from litestar.handlers import BaseRouteHandler
from litestar.openapi.spec import SecurityScheme
from litestar.types import Guard

from llmgw.server.auth.keys import bearer, key_id
from llmgw.server.auth.sessions import SESSION_PREFIX, Principal, require_json, resolve
from llmgw.server.errors import ApiError

# How the OpenAPI document names what ``signed_in`` and ``admin_only`` take; a guarded
# handler lists ``SECURITY`` as its ``security``.
SECURITY_SCHEMES = {"admin": SecurityScheme(
    type="http", scheme="bearer",
    description="the admin token, or an account's session token (`llmgw ctl login`); the "
                "page sends the session as the `llmgw_session` cookie instead")}
SECURITY = [{"admin": []}]

LOGIN_REQUIRED = ("log in first (POST /api/auth/login), or send the admin token as "
                  "`Authorization: Bearer …`")


def _not_let_in(connection: ASGIConnection) -> str:
    """Why a request without a caller was refused: a bearer token it sent and what that
    token is not, or that it sent none."""
    token = bearer(connection.headers.get("authorization"))
    if not token:
        return LOGIN_REQUIRED
    if token.startswith(SESSION_PREFIX):
        given = ("the session token given has ended (logged out, expired, or its account "
                 "disabled)")
    elif key_id(token) is not None:
        given = ("the token given is an API key, which is for /v1 only, not the admin "
                 "token nor a session")
    else:
        given = "the token given is not the admin token nor a live session"
    return (f"{given}; log in again (POST /api/auth/login, `llmgw ctl login USER`), or "
            "send the admin token (the server's secrets/admin-token, or the file "
            "auth.admin_token_file names)")


async def _caller(connection: ASGIConnection) -> Principal:
    state = connection.app.state
    principal = await resolve(connection, state.admin_token, state.store)
    if principal is None:
        # One code whatever the reason: a script tells these apart by it, not the words.
        raise ApiError(401, _not_let_in(connection), code="login_required")
    connection.scope["user"] = principal
    return principal


async def signed_in(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """An account's session or the admin token; 401 without either."""
    await _caller(connection)


async def admin_only(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """An admin's session or the admin token; 401 without credentials, 403 for a user."""
    if not (await _caller(connection)).is_admin:
        raise ApiError(403, "this needs an admin", code="admin_required")


def json_only(what: str) -> Guard:
    """Refuse (415) ``what`` (``"a login"``) unless it says ``Content-Type:
    application/json``."""

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        require_json(connection, what)

    return guard


def _principal(request: Request) -> Principal:
    return request.user


# The caller as ``signed_in`` or ``admin_only`` found them: ``principal: Principal``.
PRINCIPAL = Provide(_principal, sync_to_thread=False)
