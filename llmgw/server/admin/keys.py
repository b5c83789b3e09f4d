"""API keys over the admin API: each account sees and revokes only its own; an admin
(or the admin token) sees all of them, and may make keys for another account.

Limits (requests and tokens per minute, tokens per UTC day and month) are set by admins
only, when a key is made or later with PATCH; anyone sees the limits and the usage of the
keys they see.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Annotated

import msgspec
from litestar import Request, delete, get, patch, post
from litestar.params import FromPath

from llmgw.core.usage import LIMIT_NAMES, LIMIT_PERIOD, MAX_LIMIT, Limits, seconds_left, used
from llmgw.server.admin.common import Input, body, require
from llmgw.server.auth.keys import create_api_key
from llmgw.server.auth.sessions import Principal
from llmgw.server.errors import ApiError
from llmgw.store import ApiKeyRecord, UsageRecord

Limit = Annotated[int, msgspec.Meta(ge=1, le=MAX_LIMIT)]
USAGE_DAYS_DEFAULT = 30


class LimitsIn(Input):
    """Each limit given is set (null lifts it); one left out is kept as it is."""

    rpm: Limit | msgspec.UnsetType | None = msgspec.UNSET
    tpm: Limit | msgspec.UnsetType | None = msgspec.UNSET
    tokens_per_day: Limit | msgspec.UnsetType | None = msgspec.UNSET
    tokens_per_month: Limit | msgspec.UnsetType | None = msgspec.UNSET

    def given(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in LIMIT_NAMES
                if getattr(self, name) is not msgspec.UNSET}


class NewKey(Input):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    models: list[str] | None = None
    expires_in_days: Annotated[float, msgspec.Meta(gt=0, le=3650)] | None = None
    owner: str | None = None  # an admin making a key for someone else
    limits: LimitsIn | None = None  # admins only


class KeyChange(Input):
    limits: LimitsIn


def _key_json(key: ApiKeyRecord, owners: dict[int, str]) -> dict:
    return {
        "prefix": key.prefix, "name": key.name, "models": key.allowed_models,
        "owner": owners.get(key.account_id) if key.account_id is not None else None,
        "created_at": key.created_at.isoformat(),
        "expires_at": key.expires_at.isoformat() if key.expires_at else None,
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
        "limits": key.limits.as_dict(),
    }


def _admin_for_limits(principal: Principal) -> None:
    if not principal.is_admin:
        raise ApiError(403, "only an admin may set a key's limits", param="limits",
                       code="admin_required")


async def _visible_key(request: Request, principal: Principal, prefix: str) -> ApiKeyRecord:
    key = await request.app.state.store.find_api_key(prefix)
    # Someone else's key is "not found", not "forbidden": its existence is not theirs to know.
    if key is None or (not principal.is_admin and key.account_id != principal.account_id):
        raise ApiError(404, f"you have no key {prefix!r}", code="key_not_found")
    return key


async def _owners(request: Request) -> dict[int, str]:
    return {a.id: a.username for a in await request.app.state.store.list_accounts()}


@get("/api/keys")
async def list_keys(request: Request) -> list[dict]:
    principal = await require(request)
    store = request.app.state.store
    keys = await (store.list_api_keys() if principal.is_admin
                  else store.list_api_keys(account_id=principal.account_id))
    owners = await _owners(request)
    return [_key_json(k, owners) for k in keys]


@post("/api/keys", status_code=201)
async def create_key(request: Request) -> dict:
    principal = await require(request)
    state = request.app.state
    new = await body(request, NewKey)
    account_id = principal.account_id
    limits = Limits()
    if new.limits is not None:
        _admin_for_limits(principal)
        limits = Limits(**new.limits.given())
    if new.owner is not None:
        if not principal.is_admin:
            raise ApiError(403, "only an admin may make a key for another account",
                           param="owner", code="admin_required")
        owner = await state.store.find_account(new.owner.lower())
        if owner is None:
            raise ApiError(404, f"no user named {new.owner!r}", param="owner",
                           code="user_not_found")
        account_id = owner.id
    unknown = [m for m in new.models or [] if state.controller.catalog.get(m) is None]
    if unknown:
        raise ApiError(400, f"no such model: {', '.join(unknown)}; see GET /v1/models",
                       param="models", code="model_not_found")
    expires = (datetime.now(UTC) + timedelta(days=new.expires_in_days)
               if new.expires_in_days else None)
    key, record = await create_api_key(state.store, new.name, new.models,
                                       account_id=account_id, expires_at=expires)
    if limits.any:
        # Should this fail, the key was never shown, so nobody can use it unlimited.
        record = await state.store.update_api_key_limits(record.prefix, **limits.as_dict())
    # The only time the key is ever shown: only its hash is kept.
    return {"key": key, **_key_json(record, await _owners(request))}


@delete("/api/keys/{prefix:str}", status_code=200)
async def revoke_key(request: Request, prefix: FromPath[str]) -> dict:
    principal = await require(request)
    await _visible_key(request, principal, prefix)
    await request.app.state.store.revoke_api_key(prefix, datetime.now(UTC))
    request.app.state.api_keys.forget(prefix)
    return {"revoked": prefix}


@patch("/api/keys/{prefix:str}")
async def change_key(request: Request, prefix: FromPath[str]) -> dict:
    """Change a key's limits: ``{"limits": {"rpm": 60, "tpm": null}}`` sets rpm, lifts tpm
    and keeps the others. This server applies it from the key's next request on,
    others sharing the store within ``auth.key_cache_s``."""
    principal = await require(request)
    change = await body(request, KeyChange)
    await _visible_key(request, principal, prefix)
    _admin_for_limits(principal)
    record = await request.app.state.store.update_api_key_limits(prefix,
                                                                 **change.limits.given())
    request.app.state.api_keys.forget(prefix)
    return _key_json(record, await _owners(request))


@get("/api/keys/{prefix:str}/usage")
async def key_usage(request: Request, prefix: FromPath[str]) -> dict:
    """What the key used, per model and UTC day from ``since`` to ``until`` (dates, both
    included; by default the last 30 days), and where it stands against each limit now."""
    principal = await require(request)
    key = await _visible_key(request, principal, prefix)
    now = datetime.now(UTC)
    until = _date_param(request, "until") or now.date()
    since = _date_param(request, "since") or until - timedelta(days=USAGE_DAYS_DEFAULT - 1)
    if since > until:
        raise ApiError(400, f"since ({since}) is after until ({until})", param="since",
                       code="invalid_value")
    store = request.app.state.store
    records = await store.list_usage(key.id, since=since, until=until)
    counts = await store.usage_counts(key.id, now)
    return {
        "prefix": key.prefix, "name": key.name,
        "since": since.isoformat(), "until": until.isoformat(),
        "limits": [
            {"limit": name, "value": getattr(key.limits, name), "used": used(name, counts),
             "resets_in_s": seconds_left(LIMIT_PERIOD[name], now)}
            for name in LIMIT_NAMES
        ],
        "models": _per_model(records),
        "days": [{"day": r.day.isoformat(), "model": r.model, **_totals([r])}
                 for r in records],
    }


def _date_param(request: Request, name: str) -> date | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return date.fromisoformat(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be a date like 2025-03-01, not {raw!r}", param=name,
                       code="invalid_value") from None


def _totals(records: list[UsageRecord]) -> dict:
    prompt = sum(r.prompt_tokens for r in records)
    completion = sum(r.completion_tokens for r in records)
    return {"requests": sum(r.requests for r in records), "prompt_tokens": prompt,
            "completion_tokens": completion, "total_tokens": prompt + completion}


def _per_model(records: list[UsageRecord]) -> list[dict]:
    models: dict[str, list[UsageRecord]] = {}
    for r in records:
        models.setdefault(r.model, []).append(r)
    return [{"model": m, **_totals(rs)} for m, rs in sorted(models.items())]


ROUTES = [list_keys, create_key, revoke_key, change_key, key_usage]
