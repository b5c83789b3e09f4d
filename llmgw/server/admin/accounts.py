"""Accounts: signup, login, sessions, and the admin's user management.

Every login and signup first passes the per-address throttle, then takes a hashing slot.
A wrong username and a wrong password get the same answer, after the same work.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

import msgspec
from litestar import Request, Response, get, patch, post, put
from litestar.params import FromPath

from llmgw.core.names import NameRuleError, check_username
from llmgw.server.admin.common import Input, body, client_address, require
from llmgw.server.auth.sessions import (
    COOKIE,
    close_session,
    open_session,
    require_json,
    session_token,
)
from llmgw.server.errors import ApiError
from llmgw.store import AccountRecord, InviteRecord, InviteUnusable, UsernameTaken

SIGNUP_MODES = ("open", "invite", "closed")
Role = Literal["admin", "user"]
# Bounded: an argon2 input of megabytes would be work for nothing.
Password = Annotated[str, msgspec.Meta(min_length=10, max_length=1024)]


class Credentials(Input):
    username: str
    password: Annotated[str, msgspec.Meta(max_length=1024)]


class Signup(Input):
    username: str
    password: Password
    invite: str | None = None


class NewUser(Input):
    username: str
    password: Password
    role: Role = "user"


class UserChange(Input):
    role: Role | None = None
    disabled: bool | None = None
    password: Password | None = None


class PasswordChange(Input):
    current_password: Annotated[str, msgspec.Meta(max_length=1024)]
    new_password: Password


class NewInvite(Input):
    expires_in_hours: Annotated[float, msgspec.Meta(gt=0, le=24 * 90)] = 72.0


class Settings(Input):
    signup: Literal["open", "invite", "closed"]


def _account_json(a: AccountRecord) -> dict:
    return {"username": a.username, "role": a.role, "created_at": a.created_at.isoformat(),
            "disabled": a.disabled_at is not None}


def _username(raw: str) -> str:
    try:
        return check_username(raw.strip().lower())
    except NameRuleError as err:
        raise ApiError(400, str(err), param="username", code="invalid_value") from None


def _throttled(request: Request) -> None:
    state = request.app.state
    verdict = state.throttle.attempt(client_address(request), time.monotonic())
    if not verdict.allowed:
        raise ApiError(429, verdict.reason, code="throttled",
                       headers={"retry-after": str(max(1, round(verdict.retry_after_s)))})


def _session_cookie(response: Response, request: Request, token: str, expires: datetime
                    ) -> Response:
    max_age = max(0, int((expires - datetime.now(UTC)).total_seconds()))
    response.set_cookie(COOKIE, token, max_age=max_age, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https", path="/")
    return response


async def _login(request: Request) -> tuple[AccountRecord, str, datetime]:
    state = request.app.state
    require_json(request, "a login")
    creds = await body(request, Credentials)
    _throttled(request)
    account = await state.store.find_account(creds.username.strip().lower())
    usable = account is not None and account.disabled_at is None
    checked = await state.hasher.check(account.password_hash if usable else None,
                                       creds.password)
    if not checked.ok:
        raise ApiError(401, "wrong username or password", code="invalid_credentials")
    # A success does not clear the address's count: someone with an account of their own
    # could otherwise reset it between guesses at another one.
    if checked.rehash:
        await state.store.update_account(account.id, password_hash=checked.rehash)
    token, expires = await open_session(state.store, account.id,
                                        state.config.auth.session_ttl_s)
    return account, token, expires


@post("/api/auth/login", status_code=200)
async def login(request: Request) -> Response:
    """For the page: the session comes back as an HttpOnly cookie, never in the body."""
    account, token, expires = await _login(request)
    return _session_cookie(Response(_account_json(account)), request, token, expires)


@post("/api/auth/token", status_code=200)
async def login_token(request: Request) -> dict:
    """For `llmgw ctl login`: the session token, once, to send as a bearer token."""
    account, token, expires = await _login(request)
    return {**_account_json(account), "token": token, "expires_at": expires.isoformat()}


@post("/api/auth/logout", status_code=200)
async def logout(request: Request) -> Response:
    token = session_token(request)
    if token:
        await close_session(request.app.state.store, token)
    response = Response({"logged_out": True})
    response.delete_cookie(COOKIE, path="/")
    return response


@post("/api/auth/signup", status_code=201)
async def signup(request: Request) -> Response:
    state = request.app.state
    require_json(request, "a signup")
    form = await body(request, Signup)
    mode = await state.store.get_setting("signup", "closed")
    if mode == "closed":
        raise ApiError(403, "signup is closed; ask an admin for an account",
                       code="signup_closed")
    if mode == "invite" and not form.invite:
        raise ApiError(403, "signup needs an invite code from an admin", param="invite",
                       code="invite_required")
    username = _username(form.username)
    _throttled(request)
    # With invites, whether a name is taken is told only to someone holding a good invite.
    if mode == "open" and await state.store.find_account(username) is not None:
        raise ApiError(409, f"the username {username!r} is taken", param="username",
                       code="username_taken")
    password_hash = await state.hasher.hash(form.password)
    invite = _code_hash(form.invite) if mode == "invite" else None
    try:
        # One transaction: the account exists only if the invite was good, and vice versa.
        account = await state.store.add_account(AccountRecord(
            username=username, password_hash=password_hash, role="user",
            created_at=datetime.now(UTC)), invite_code_hash=invite)
    except InviteUnusable:
        raise ApiError(403, "that invite code is not valid, already used, or expired",
                       param="invite", code="invalid_invite") from None
    except UsernameTaken:
        raise ApiError(409, f"the username {username!r} is taken", param="username",
                       code="username_taken") from None
    token, expires = await open_session(state.store, account.id, state.config.auth.session_ttl_s)
    return _session_cookie(Response(_account_json(account), status_code=201), request, token,
                           expires)


@get("/api/me")
async def me(request: Request) -> dict:
    principal = await require(request)
    return {"username": principal.username, "role": principal.role}


@put("/api/me/password", status_code=200)
async def change_password(request: Request) -> Response:
    principal = await require(request)
    if principal.account_id is None:
        raise ApiError(400, "the admin token has no password to change", code="not_an_account")
    state = request.app.state
    change = await body(request, PasswordChange)
    _throttled(request)
    account = await state.store.get_account(principal.account_id)
    if not (await state.hasher.check(account.password_hash, change.current_password)).ok:
        raise ApiError(401, "the current password is wrong", param="current_password",
                       code="invalid_credentials")
    await state.store.update_account(account.id,
                                     password_hash=await state.hasher.hash(change.new_password))
    # Every other session ends: a changed password is often a stolen one.
    await state.store.delete_sessions_of(account.id)
    token, expires = await open_session(state.store, account.id, state.config.auth.session_ttl_s)
    if request.cookies.get(COOKIE):
        return _session_cookie(Response({"changed": True}), request, token, expires)
    # A bearer session (llmgw ctl) gets its new token in the body, once.
    return Response({"changed": True, "token": token, "expires_at": expires.isoformat()})


# --- the admin's side ------------------------------------------------------------------------


@get("/api/users")
async def list_users(request: Request) -> list[dict]:
    await require(request, admin=True)
    return [_account_json(a) for a in await request.app.state.store.list_accounts()]


@post("/api/users", status_code=201)
async def create_user(request: Request) -> dict:
    await require(request, admin=True)
    state = request.app.state
    new = await body(request, NewUser)
    username = _username(new.username)
    if await state.store.find_account(username) is not None:
        raise ApiError(409, f"the username {username!r} is taken", param="username",
                       code="username_taken")
    account = await state.store.add_account(AccountRecord(
        username=username, password_hash=await state.hasher.hash(new.password),
        role=new.role, created_at=datetime.now(UTC)))
    return _account_json(account)


@patch("/api/users/{username:str}")
async def change_user(request: Request, username: FromPath[str]) -> dict:
    principal = await require(request, admin=True)
    state = request.app.state
    change = await body(request, UserChange)
    account = await state.store.find_account(username.lower())
    if account is None:
        raise ApiError(404, f"no user named {username!r}", code="user_not_found")
    if principal.account_id == account.id and (change.role == "user" or change.disabled):
        raise ApiError(400, "you cannot demote or disable yourself; ask another admin",
                       code="self_lockout")
    password_hash = await state.hasher.hash(change.password) if change.password else None
    account = await state.store.update_account(
        account.id, role=change.role, password_hash=password_hash,
        disabled_at=datetime.now(UTC) if change.disabled else None,
        enable=change.disabled is False)
    if change.disabled is not None:
        state.api_keys.forget()  # the account's keys stop (or start) working at once
    if change.disabled or change.password or change.role:
        await state.store.delete_sessions_of(account.id)
    return _account_json(account)


def _code_hash(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


@post("/api/invites", status_code=201)
async def create_invite(request: Request) -> dict:
    principal = await require(request, admin=True)
    new = await body(request, NewInvite)
    code = "llmgwi_" + secrets.token_urlsafe(18)
    now = datetime.now(UTC)
    expires = now + timedelta(hours=new.expires_in_hours)
    await request.app.state.store.add_invite(InviteRecord(
        code_hash=_code_hash(code), created_at=now, expires_at=expires,
        created_by=principal.account_id))
    return {"invite": code, "expires_at": expires.isoformat()}


@get("/api/settings")
async def get_settings(request: Request) -> dict:
    await require(request, admin=True)
    return {"signup": await request.app.state.store.get_setting("signup", "closed")}


@put("/api/settings")
async def put_settings(request: Request) -> dict:
    await require(request, admin=True)
    settings = await body(request, Settings)
    await request.app.state.store.put_setting("signup", settings.signup)
    return {"signup": settings.signup}


ROUTES = [login, login_token, logout, signup, me, change_password, list_users, create_user,
          change_user, create_invite, get_settings, put_settings]
