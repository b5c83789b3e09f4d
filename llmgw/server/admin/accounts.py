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
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from llmgw.config import ServerConfig
from llmgw.core.names import NameRuleError, check_username
from llmgw.core.throttle import LoginThrottle
from llmgw.server.admin.common import (
    ADMIN,
    SERVICES,
    SIGNED_IN,
    Input,
    OptionalBody,
    StrictBody,
    client_address,
)
from llmgw.server.auth import KeyCache
from llmgw.server.auth.guards import json_only
from llmgw.server.auth.passwords import PasswordHasher
from llmgw.server.auth.sessions import (
    COOKIE,
    Principal,
    close_session,
    open_session,
    session_token,
)
from llmgw.server.errors import ApiError, refusals
from llmgw.store import AccountRecord, InviteRecord, InviteUnusable, Store, UsernameTaken

SignupMode = Literal["open", "invite", "closed"]
Role = Literal["admin", "user"]
# Bounded: an argon2 input of megabytes would be work for nothing.
Password = Annotated[str, msgspec.Meta(min_length=10, max_length=1024)]
# What ``_username`` takes, for the OpenAPI document: the name is trimmed and lowercased,
# then held to core.names' rule.
Username = Annotated[str, msgspec.Meta(extra_json_schema={"extra": {
    "pattern": r"^\s*[A-Za-z0-9][A-Za-z0-9._-]{1,63}\s*$"}})]


class Credentials(Input):
    username: str
    password: Annotated[str, msgspec.Meta(max_length=1024)]


class Signup(Input):
    username: Username
    password: Password
    invite: str | None = None


class NewUser(Input):
    username: Username
    password: Password
    role: Role = "user"


class UserChange(Input, frozen=True):
    role: Role | None = None
    disabled: bool | None = None
    password: Password | None = None


class PasswordChange(Input):
    current_password: Annotated[str, msgspec.Meta(max_length=1024)]
    new_password: Password


class NewInvite(Input, frozen=True):
    expires_in_hours: Annotated[float, msgspec.Meta(gt=0, le=24 * 90)] = 72.0


# An empty body: an invite with the default lifetime.
DEFAULT_INVITE = NewInvite()
# An empty body: nothing changes.
NO_CHANGE = UserChange()


class Settings(Input):
    signup: SignupMode


# --- what the handlers answer ----------------------------------------------------------------


class Account(msgspec.Struct):
    username: str
    role: Role
    created_at: str
    disabled: bool


class AccountSession(Account):
    """A login for ``llmgw ctl``: the session token, shown once."""

    token: str
    expires_at: str


class Me(msgspec.Struct):
    username: str
    role: Role


class LoggedOut(msgspec.Struct):
    logged_out: bool


class PasswordChanged(msgspec.Struct):
    changed: bool
    # A bearer session's new token, shown once; a cookie session gets a new cookie.
    token: str | msgspec.UnsetType = msgspec.UNSET
    expires_at: str | msgspec.UnsetType = msgspec.UNSET


class Invite(msgspec.Struct):
    invite: str
    expires_at: str


def _account(a: AccountRecord) -> Account:
    return Account(a.username, a.role, a.created_at.isoformat(), a.disabled_at is not None)


def _username(raw: str) -> str:
    try:
        return check_username(raw.strip().lower())
    except NameRuleError as err:
        raise ApiError(400, str(err), param="username", code="invalid_value") from None


def _throttled(request: Request, throttle: LoginThrottle) -> None:
    verdict = throttle.attempt(client_address(request), time.monotonic())
    if not verdict.allowed:
        raise ApiError(429, verdict.reason, code="throttled",
                       headers={"retry-after": str(max(1, round(verdict.retry_after_s)))})


def session_cookie(response: Response, request: Request, token: str, expires: datetime
                    ) -> Response:
    max_age = max(0, int((expires - datetime.now(UTC)).total_seconds()))
    response.set_cookie(COOKIE, token, max_age=max_age, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https", path="/")
    return response


async def check_login(request: Request, creds: Credentials, store: Store, hasher: PasswordHasher,
                 throttle: LoginThrottle, config: ServerConfig
                 ) -> tuple[AccountRecord, str, datetime]:
    _throttled(request, throttle)
    account = await store.find_account(creds.username.strip().lower())
    usable = account is not None and account.disabled_at is None
    checked = await hasher.check(account.password_hash if usable else None, creds.password)
    if not checked.ok:
        raise ApiError(401, "wrong username or password", code="invalid_credentials")
    # A success does not clear the address's count: someone with an account of their own
    # could otherwise reset it between guesses at another one.
    if checked.rehash:
        await store.update_account(account.id, password_hash=checked.rehash)
    token, expires = await open_session(store, account.id, config.auth.session_ttl_s)
    return account, token, expires


_LOGIN = {"guards": [json_only("a login")], "dependencies": SERVICES, "dto": StrictBody,
          "responses": refusals(400, 401, 415, 429)}


@post("/api/auth/login", status_code=200, **_LOGIN)
async def login(request: Request, data: JSONBody[Credentials], store: NamedDependency[Store],
                hasher: NamedDependency[PasswordHasher], throttle: NamedDependency[LoginThrottle],
                config: NamedDependency[ServerConfig]) -> Response[Account]:
    """For the page: the session comes back as an HttpOnly cookie, never in the body."""
    account, token, expires = await check_login(request, data, store, hasher, throttle, config)
    return session_cookie(Response(_account(account)), request, token, expires)


@post("/api/auth/token", status_code=200, **_LOGIN)
async def login_token(request: Request, data: JSONBody[Credentials], store: NamedDependency[Store],
                      hasher: NamedDependency[PasswordHasher],
                      throttle: NamedDependency[LoginThrottle],
                      config: NamedDependency[ServerConfig]) -> AccountSession:
    """For `llmgw ctl login`: the session token, once, to send as a bearer token."""
    account, token, expires = await check_login(request, data, store, hasher, throttle, config)
    return AccountSession(**msgspec.structs.asdict(_account(account)), token=token,
                          expires_at=expires.isoformat())


@post("/api/auth/logout", status_code=200, dependencies=SERVICES, responses=refusals(415))
async def logout(request: Request, store: NamedDependency[Store]) -> Response[LoggedOut]:
    token = session_token(request)
    if token:
        await close_session(store, token)
    response = Response(LoggedOut(logged_out=True))
    response.delete_cookie(COOKIE, path="/")
    return response


@post("/api/auth/signup", status_code=201, guards=[json_only("a signup")],
      dependencies=SERVICES, dto=StrictBody, responses=refusals(400, 403, 409, 415, 429))
async def signup(request: Request, data: JSONBody[Signup], store: NamedDependency[Store],
                 hasher: NamedDependency[PasswordHasher], throttle: NamedDependency[LoginThrottle],
                 config: NamedDependency[ServerConfig]) -> Response[Account]:
    mode = await store.get_setting("signup", "closed")
    if mode == "closed":
        raise ApiError(403, "signup is closed; ask an admin for an account",
                       code="signup_closed")
    if mode == "invite" and not data.invite:
        raise ApiError(403, "signup needs an invite code from an admin", param="invite",
                       code="invite_required")
    username = _username(data.username)
    _throttled(request, throttle)
    # With invites, whether a name is taken is told only to someone holding a good invite.
    if mode == "open" and await store.find_account(username) is not None:
        raise ApiError(409, f"the username {username!r} is taken", param="username",
                       code="username_taken")
    password_hash = await hasher.hash(data.password)
    invite = _code_hash(data.invite) if mode == "invite" else None
    try:
        # One transaction: the account exists only if the invite was good, and vice versa.
        account = await store.add_account(AccountRecord(
            username=username, password_hash=password_hash, role="user",
            created_at=datetime.now(UTC)), invite_code_hash=invite)
    except InviteUnusable:
        raise ApiError(403, "that invite code is not valid, already used, or expired",
                       param="invite", code="invalid_invite") from None
    except UsernameTaken:
        raise ApiError(409, f"the username {username!r} is taken", param="username",
                       code="username_taken") from None
    token, expires = await open_session(store, account.id, config.auth.session_ttl_s)
    return session_cookie(Response(_account(account), status_code=201), request, token,
                           expires)


@get("/api/me", **SIGNED_IN, responses=refusals(401))
async def me(principal: NamedDependency[Principal]) -> Me:
    return Me(principal.username, principal.role)


@put("/api/me/password", status_code=200, **SIGNED_IN, dto=StrictBody,
     responses=refusals(400, 401, 415, 429))
async def change_password(request: Request, data: JSONBody[PasswordChange],
                          principal: NamedDependency[Principal], store: NamedDependency[Store],
                          hasher: NamedDependency[PasswordHasher],
                          throttle: NamedDependency[LoginThrottle],
                          config: NamedDependency[ServerConfig]) -> Response[PasswordChanged]:
    if principal.account_id is None:
        raise ApiError(400, "the admin token has no password to change", code="not_an_account")
    _throttled(request, throttle)
    account = await store.get_account(principal.account_id)
    if not (await hasher.check(account.password_hash, data.current_password)).ok:
        raise ApiError(401, "the current password is wrong", param="current_password",
                       code="invalid_credentials")
    await store.update_account(account.id, password_hash=await hasher.hash(data.new_password))
    # Every other session ends: a changed password is often a stolen one.
    await store.delete_sessions_of(account.id)
    token, expires = await open_session(store, account.id, config.auth.session_ttl_s)
    if request.cookies.get(COOKIE):
        return session_cookie(Response(PasswordChanged(changed=True)), request, token,
                               expires)
    # A bearer session (llmgw ctl) gets its new token in the body, once.
    return Response(PasswordChanged(changed=True, token=token,
                                    expires_at=expires.isoformat()))


# --- the admin's side ------------------------------------------------------------------------

@get("/api/users", **ADMIN, responses=refusals(401, 403))
async def list_users(store: NamedDependency[Store]) -> list[Account]:
    return [_account(a) for a in await store.list_accounts()]


@post("/api/users", status_code=201, **ADMIN, dto=StrictBody,
      responses=refusals(400, 401, 403, 409, 415))
async def create_user(data: JSONBody[NewUser], store: NamedDependency[Store],
                      hasher: NamedDependency[PasswordHasher]) -> Account:
    username = _username(data.username)
    if await store.find_account(username) is not None:
        raise ApiError(409, f"the username {username!r} is taken", param="username",
                       code="username_taken")
    account = await store.add_account(AccountRecord(
        username=username, password_hash=await hasher.hash(data.password),
        role=data.role, created_at=datetime.now(UTC)))
    return _account(account)


@patch("/api/users/{username:str}", **ADMIN, dto=StrictBody, operation_class=OptionalBody,
       responses=refusals(400, 401, 403, 404, 415))
async def change_user(username: FromPath[str], principal: NamedDependency[Principal],
                      store: NamedDependency[Store], hasher: NamedDependency[PasswordHasher],
                      api_keys: NamedDependency[KeyCache],
                      data: JSONBody[UserChange] = NO_CHANGE) -> Account:
    account = await store.find_account(username.lower())
    if account is None:
        raise ApiError(404, f"no user named {username!r}", code="user_not_found")
    if principal.account_id == account.id and (data.role == "user" or data.disabled):
        raise ApiError(400, "you cannot demote or disable yourself; ask another admin",
                       code="self_lockout")
    password_hash = await hasher.hash(data.password) if data.password else None
    account = await store.update_account(
        account.id, role=data.role, password_hash=password_hash,
        disabled_at=datetime.now(UTC) if data.disabled else None,
        enable=data.disabled is False)
    if data.disabled is not None:
        api_keys.forget()  # the account's keys stop (or start) working at once
    if data.disabled or data.password or data.role:
        await store.delete_sessions_of(account.id)
    return _account(account)


def _code_hash(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


@post("/api/invites", status_code=201, **ADMIN, dto=StrictBody, operation_class=OptionalBody,
      responses=refusals(400, 401, 403, 415))
async def create_invite(principal: NamedDependency[Principal], store: NamedDependency[Store],
                        data: JSONBody[NewInvite] = DEFAULT_INVITE) -> Invite:
    code = "llmgwi_" + secrets.token_urlsafe(18)
    now = datetime.now(UTC)
    expires = now + timedelta(hours=data.expires_in_hours)
    await store.add_invite(InviteRecord(code_hash=_code_hash(code), created_at=now,
                                        expires_at=expires, created_by=principal.account_id))
    return Invite(code, expires.isoformat())


@get("/api/settings", **ADMIN, responses=refusals(401, 403))
async def get_settings(store: NamedDependency[Store]) -> Settings:
    return Settings(signup=await store.get_setting("signup", "closed"))


@put("/api/settings", **ADMIN, dto=StrictBody, responses=refusals(400, 401, 403, 415))
async def put_settings(data: JSONBody[Settings], store: NamedDependency[Store]) -> Settings:
    await store.put_setting("signup", data.signup)
    return data


ROUTES = [login, login_token, logout, signup, me, change_password, list_users, create_user,
          change_user, create_invite, get_settings, put_settings]
