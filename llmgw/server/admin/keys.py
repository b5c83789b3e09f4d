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
from litestar import delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody, Parameter, SkipValidation

from llmgw.core.catalog import Catalog
from llmgw.core.usage import LIMIT_NAMES, LIMIT_PERIOD, MAX_LIMIT, Limits, seconds_left, used
from llmgw.server.admin.common import SIGNED_IN, Input, StrictBody
from llmgw.server.auth import KeyCache
from llmgw.server.auth.keys import create_api_key
from llmgw.server.auth.sessions import Principal
from llmgw.server.controller import Controller
from llmgw.server.errors import ApiError, refusals
from llmgw.store import ApiKeyRecord, Store, UsageRecord

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
    # Models of the catalog (GET /v1/models); none: every model.
    models: list[str] | None = None
    expires_in_days: Annotated[float, msgspec.Meta(gt=0, le=3650)] | None = None
    owner: str | None = None  # an admin making a key for someone else
    limits: LimitsIn | None = None  # admins only


class KeyChange(Input):
    limits: LimitsIn


# --- what the handlers answer ----------------------------------------------------------------


class KeyLimits(msgspec.Struct):
    """A key's limits; null: none."""

    rpm: int | None
    tpm: int | None
    tokens_per_day: int | None
    tokens_per_month: int | None


class Key(msgspec.Struct):
    prefix: str
    name: str
    models: list[str] | None
    owner: str | None
    created_at: str
    expires_at: str | None
    revoked_at: str | None
    limits: KeyLimits


class NewKeyMade(Key):
    """A key as made: the key itself is shown this once (only its hash is kept)."""

    key: str


class KeyRevoked(msgspec.Struct):
    revoked: str


class LimitUse(msgspec.Struct):
    limit: str
    value: int | None
    used: int
    resets_in_s: int


class ModelUse(msgspec.Struct):
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class DayUse(ModelUse):
    day: str


class KeyUsage(msgspec.Struct):
    prefix: str
    name: str
    since: str
    until: str
    limits: list[LimitUse]
    models: list[ModelUse]
    days: list[DayUse]


def key_view(key: ApiKeyRecord, owners: dict[int, str]) -> Key:
    """A key as the API and the page show it (never its secret)."""
    return Key(
        prefix=key.prefix, name=key.name, models=key.allowed_models,
        owner=owners.get(key.account_id) if key.account_id is not None else None,
        created_at=key.created_at.isoformat(),
        expires_at=key.expires_at.isoformat() if key.expires_at else None,
        revoked_at=key.revoked_at.isoformat() if key.revoked_at else None,
        limits=KeyLimits(**key.limits.as_dict()),
    )


def _admin_for_limits(principal: Principal) -> None:
    if not principal.is_admin:
        raise ApiError(403, "only an admin may set a key's limits", param="limits",
                       code="admin_required")


async def visible_key(store: Store, principal: Principal, prefix: str) -> ApiKeyRecord:
    """The key with this prefix if ``principal`` may see it: their own, or any for an
    admin; otherwise 404."""
    key = await store.find_api_key(prefix)
    # Someone else's key is "not found", not "forbidden": its existence is not theirs to know.
    if key is None or (not principal.is_admin and key.account_id != principal.account_id):
        raise ApiError(404, f"you have no key {prefix!r}", code="key_not_found")
    return key


async def visible_keys(store: Store, principal: Principal) -> list[ApiKeyRecord]:
    """The keys ``principal`` sees: their own, or every key for an admin; by id."""
    if principal.is_admin:
        return await store.list_api_keys()
    return await store.list_api_keys(account_id=principal.account_id)


async def owners(store: Store) -> dict[int, str]:
    """Each account's username, by id."""
    return {a.id: a.username for a in await store.list_accounts()}


async def make_key(store: Store, catalog: Catalog, principal: Principal,
                   data: NewKey) -> NewKeyMade:
    """Make a key for ``principal`` (or, for an admin, ``data.owner``); its secret is in
    the answer, this once."""
    account_id = principal.account_id
    limits = Limits()
    if data.limits is not None:
        _admin_for_limits(principal)
        limits = Limits(**data.limits.given())
    if data.owner is not None:
        if not principal.is_admin:
            raise ApiError(403, "only an admin may make a key for another account",
                           param="owner", code="admin_required")
        owner = await store.find_account(data.owner.lower())
        if owner is None:
            raise ApiError(404, f"no user named {data.owner!r}", param="owner",
                           code="user_not_found")
        account_id = owner.id
    unknown = [m for m in data.models or [] if catalog.resolve(m) is None]  # or an alias
    if unknown:
        raise ApiError(400, f"no such model: {', '.join(unknown)}; see GET /v1/models",
                       param="models", code="model_not_found")
    expires = (datetime.now(UTC) + timedelta(days=data.expires_in_days)
               if data.expires_in_days else None)
    key, record = await create_api_key(store, data.name, data.models,
                                       account_id=account_id, expires_at=expires)
    if limits.any:
        # Should this fail, the key was never shown, so nobody can use it unlimited.
        record = await store.update_api_key_limits(record.prefix, **limits.as_dict())
    made = key_view(record, await owners(store))
    return NewKeyMade(**msgspec.structs.asdict(made), key=key)


async def revoke(store: Store, api_keys: KeyCache, principal: Principal,
                 prefix: str) -> ApiKeyRecord:
    """Revoke a key ``principal`` sees; this server refuses it from the next request on.
    Returns the key as it was before."""
    key = await visible_key(store, principal, prefix)
    await store.revoke_api_key(prefix, datetime.now(UTC))
    api_keys.forget(prefix)
    return key


async def set_limits(store: Store, api_keys: KeyCache, principal: Principal, prefix: str,
                     limits: dict[str, int | None]) -> ApiKeyRecord:
    """Set the limits named (None lifts one; those not named are kept): admins only."""
    await visible_key(store, principal, prefix)
    _admin_for_limits(principal)
    record = await store.update_api_key_limits(prefix, **limits)
    api_keys.forget(prefix)
    return record


@get("/api/keys", **SIGNED_IN, responses=refusals(401))
async def list_keys(principal: NamedDependency[Principal],
                    store: NamedDependency[Store]) -> list[Key]:
    names = await owners(store)
    return [key_view(k, names) for k in await visible_keys(store, principal)]


@post("/api/keys", status_code=201, **SIGNED_IN, dto=StrictBody,
      responses=refusals(400, 401, 403, 404, 415))
async def create_key(data: JSONBody[NewKey], principal: NamedDependency[Principal],
                     store: NamedDependency[Store],
                     controller: NamedDependency[SkipValidation[Controller]]) -> NewKeyMade:
    # (The controller is not checked against its type: a test stands in an object with a
    # catalog for it.)
    return await make_key(store, controller.catalog, principal, data)


@delete("/api/keys/{prefix:str}", status_code=200, **SIGNED_IN,
        responses=refusals(401, 404, 415))
async def revoke_key(prefix: FromPath[str], principal: NamedDependency[Principal],
                     store: NamedDependency[Store],
                     api_keys: NamedDependency[KeyCache]) -> KeyRevoked:
    await revoke(store, api_keys, principal, prefix)
    return KeyRevoked(prefix)


@patch("/api/keys/{prefix:str}", **SIGNED_IN, dto=StrictBody,
       responses=refusals(400, 401, 403, 404, 415))
async def change_key(prefix: FromPath[str], data: JSONBody[KeyChange],
                     principal: NamedDependency[Principal], store: NamedDependency[Store],
                     api_keys: NamedDependency[KeyCache]) -> Key:
    """Change a key's limits: ``{"limits": {"rpm": 60, "tpm": null}}`` sets rpm, lifts tpm
    and keeps the others. This server applies it from the key's next request on,
    others sharing the store within ``auth.key_cache_s``."""
    record = await set_limits(store, api_keys, principal, prefix, data.limits.given())
    return key_view(record, await owners(store))


# Dates as written (2025-03-01); read by _date, which words a bad one.
DateParam = Parameter(schema_extra={"format": "date"},
                      description="a UTC day, like 2025-03-01")


@get("/api/keys/{prefix:str}/usage", **SIGNED_IN, responses=refusals(400, 401, 404))
async def key_usage(prefix: FromPath[str], principal: NamedDependency[Principal],
                    store: NamedDependency[Store], since: Annotated[str | None, DateParam] = None,
                    until: Annotated[str | None, DateParam] = None) -> KeyUsage:
    """What the key used, per model and UTC day from ``since`` to ``until`` (dates, both
    included; by default the last 30 days), and where it stands against each limit now."""
    key = await visible_key(store, principal, prefix)
    now = datetime.now(UTC)
    first, last = usage_period(since, until, now.date())
    return await usage_report(store, key, first, last, now)


async def usage_report(store: Store, key: ApiKeyRecord, first: date, last: date,
                       now: datetime) -> KeyUsage:
    """What ``key`` used per model and UTC day from ``first`` to ``last`` (both included),
    and where it stands against each of its limits at ``now``."""
    records = await store.list_usage(key.id, since=first, until=last)
    counts = await store.usage_counts(key.id, now)
    return KeyUsage(
        prefix=key.prefix, name=key.name, since=first.isoformat(), until=last.isoformat(),
        limits=[LimitUse(limit=name, value=getattr(key.limits, name),
                         used=used(name, counts),
                         resets_in_s=seconds_left(LIMIT_PERIOD[name], now))
                for name in LIMIT_NAMES],
        models=_per_model(records),
        days=[DayUse(day=r.day.isoformat(), **msgspec.structs.asdict(_totals(r.model, [r])))
              for r in records],
    )


def usage_period(since: str | None, until: str | None, today: date, *,
                 days: int = USAGE_DAYS_DEFAULT, max_days: int | None = None
                 ) -> tuple[date, date]:
    """The UTC days from ``since`` to ``until`` (dates as written, both included): by
    default the ``days`` up to ``today``. A period longer than ``max_days`` is refused."""
    last = parse_day(until, "until") or today
    first = parse_day(since, "since") or last - timedelta(days=days - 1)
    if first > last:
        raise ApiError(400, f"since ({first}) is after until ({last})", param="since",
                       code="invalid_value")
    if max_days is not None and (last - first).days + 1 > max_days:
        raise ApiError(400, f"from {first} to {last} is {(last - first).days + 1} days; "
                       f"ask for {max_days} days or fewer at a time", param="since",
                       code="invalid_value")
    return first, last


def parse_day(raw: str | None, name: str) -> date | None:
    """A date as written (2025-03-01), or None for nothing; a bad one is refused naming
    ``name``."""
    if raw is None or raw == "":
        return None
    try:
        return date.fromisoformat(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be a date like 2025-03-01, not {raw!r}", param=name,
                       code="invalid_value") from None


def _totals(model: str, records: list[UsageRecord]) -> ModelUse:
    prompt = sum(r.prompt_tokens for r in records)
    completion = sum(r.completion_tokens for r in records)
    return ModelUse(model=model, requests=sum(r.requests for r in records),
                    prompt_tokens=prompt, completion_tokens=completion,
                    total_tokens=prompt + completion)


def _per_model(records: list[UsageRecord]) -> list[ModelUse]:
    models: dict[str, list[UsageRecord]] = {}
    for r in records:
        models.setdefault(r.model, []).append(r)
    return [_totals(m, rs) for m, rs in sorted(models.items())]


ROUTES = [list_keys, create_key, revoke_key, change_key, key_usage]
