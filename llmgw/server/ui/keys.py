"""The keys pages: a user's own API keys (an admin sees every key, with its owner): make
one, its secret shown once on the page that answers the form; revoke one; change its
limits (admins, as over the API); and what the keys used, per day and model.

Every change goes through the admin API's own functions (``llmgw.server.admin.keys``),
so the page and ``/api/keys`` refuse and allow the same things in the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import msgspec
from litestar import Request, get, post
from litestar.params import FromPath
from litestar.response import Template

from llmgw.core.catalog import Name
from llmgw.core.usage import LIMIT_NAMES, MAX_LIMIT, duration_words
from llmgw.server.admin.keys import (
    LimitsIn,
    NewKey,
    make_key,
    owners,
    revoke,
    set_limits,
    usage_report,
    visible_key,
)
from llmgw.server.errors import ApiError
from llmgw.server.ui.page import PREFIX, GoTo, Page, open_page, posted
from llmgw.server.ui.usage import (
    SERIES_NAME_MAX,
    TOP_MODELS_TABLE,
    cut,
    day_chart,
    per_model,
    visible_usage,
)
from llmgw.store import ApiKeyRecord, UsageRecord

MAX_KEYS_SHOWN = 50  # rows of the list; the rest through `llmgw ctl keys list`
LIST_MODELS = 2  # models named in a row of the list (cut short); the key's page has all
CHECKBOXES_UP_TO = 40  # models offered as checkboxes; past that, a text field
USAGE_DAYS = 30
MAX_EXPIRY_DAYS = 3650  # as the API takes
LIMIT_LABELS = {"rpm": "Requests per minute", "tpm": "Tokens per minute",
                "tokens_per_day": "Tokens per day (UTC)",
                "tokens_per_month": "Tokens per month (UTC)"}
_LIMIT_UNITS = {"rpm": "requests/min", "tpm": "tokens/min", "tokens_per_day": "tokens/day",
                "tokens_per_month": "tokens/month"}
ADMIN_TOKEN_OWNER = "(admin token)"  # a key made with the admin token has no account


@dataclass(frozen=True, slots=True)
class KeyRow:
    """A key as the pages show it; never its secret."""

    prefix: str
    name: str
    owner: str
    created: str
    expires: str  # empty: never
    models: str
    limits: str
    state: str  # active, expired or revoked
    revoked: str  # when, if it is


def when(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def limits_words(limits: dict[str, int | None]) -> str:
    return ", ".join(f"{value:,} {_LIMIT_UNITS[name]}" for name, value in limits.items()
                     if value is not None) or "none"


def models_words(models: list[str] | None, most: int | None = None) -> str:
    """The models a key may use; past ``most`` of them, how many more (names cut short)."""
    if not models:
        return "every model"
    if most is None or len(models) <= most:
        return ", ".join(models)
    named = ", ".join(cut(m, SERIES_NAME_MAX) for m in models[:most])
    return f"{named} and {len(models) - most} more"


def key_state(key: ApiKeyRecord, now: datetime) -> str:
    if key.revoked_at is not None:
        return "revoked"
    if key.expires_at is not None and key.expires_at <= now:
        return "expired"
    return "active"


def key_row(key: ApiKeyRecord, names: dict[int, str], now: datetime,
            models_most: int | None = None) -> KeyRow:
    owner = (ADMIN_TOKEN_OWNER if key.account_id is None
             else names.get(key.account_id, f"account #{key.account_id}"))
    return KeyRow(
        prefix=key.prefix, name=key.name, owner=owner, created=when(key.created_at),
        expires=when(key.expires_at) if key.expires_at else "",
        models=models_words(key.allowed_models, models_most),
        limits=limits_words(key.limits.as_dict()),
        state=key_state(key, now), revoked=when(key.revoked_at) if key.revoked_at else "")


def _period(today: date) -> tuple[date, date]:
    return today - timedelta(days=USAGE_DAYS - 1), today


def _catalog_names(request: Request) -> list[Name]:
    """Every name a key's model list may hold: each model's, then its aliases."""
    return request.app.state.controller.catalog.served_names()


# --- the list, and the form that makes a key ---------------------------------------------


EMPTY_FORM: dict[str, Any] = {"name": "", "models": [], "models_text": "", "expires": "",
                              "owner": "", **dict.fromkeys(LIMIT_NAMES, "")}


async def _keys_page(request: Request, page: Page, *, status_code: int = 200,
                     problem: str = "", problems: dict[str, str] | None = None,
                     values: dict[str, Any] | None = None) -> Template:
    assert page.viewer is not None
    store = request.app.state.store
    now = datetime.now(UTC)
    first, last = _period(now.date())
    keys, records = await visible_usage(store, page.viewer, first, last)
    names = await owners(store)
    # Keys in use first, newest first among them.
    keys.sort(key=lambda k: (key_state(k, now) != "active", -(k.id or 0)))
    models = _catalog_names(request)
    return page.render(
        "keys.html", status_code=status_code, title="Keys",
        keys=[key_row(k, names, now, LIST_MODELS) for k in keys[:MAX_KEYS_SHOWN]],
        keys_total=len(keys), keys_shown=min(len(keys), MAX_KEYS_SHOWN),
        chart=day_chart(records, first, last, "tokens per day, by model"),
        models_used=per_model(records)[:TOP_MODELS_TABLE], usage_days=USAGE_DAYS,
        catalog=models, checkboxes=len(models) <= CHECKBOXES_UP_TO,
        limit_labels=LIMIT_LABELS, problem=problem, problems=problems or {},
        values={**EMPTY_FORM, **(values or {})})


@get(f"{PREFIX}/keys", include_in_schema=False)
async def keys_page(request: Request) -> Template:
    return await _keys_page(request, await open_page(request))


def _whole(raw: str) -> int | None:
    """A whole number as a person writes one (``1,000,000``, ``1 000 000``); None for
    nothing; ValueError for anything else."""
    text = raw.strip().replace(",", "").replace("_", "").replace(" ", "")
    if not text:
        return None
    if not (text.isascii() and text.isdigit()):  # int() refuses "²", which isdigit() takes
        raise ValueError(text)
    return int(text)


def read_limits(fields: dict[str, str]) -> tuple[dict[str, int | None], dict[str, str]]:
    """The four limits of a form (empty: no limit), and a problem per field that is not a
    limit."""
    limits: dict[str, int | None] = {}
    problems = {}
    for name in LIMIT_NAMES:
        raw = fields.get(name, "")
        try:
            value = _whole(raw)
        except ValueError:
            value = 0
        if value is not None and not 1 <= value <= MAX_LIMIT:
            problems[name] = (f"{LIMIT_LABELS[name]} must be a whole number from 1 to "
                              f"{MAX_LIMIT:,}, not {raw.strip()!r}; leave it empty for no "
                              "limit (to stop a key altogether, revoke it)")
            continue
        limits[name] = value
    return limits, problems


def _read_new_key(fields: dict[str, str], ticked: list[str], checkboxes: bool,
                  is_admin: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """The make-a-key form's values as typed, and a problem per field."""
    problems = {}
    values: dict[str, Any] = {name: fields.get(name, "").strip() for name in EMPTY_FORM}
    if checkboxes:
        values["models"] = ticked
    else:
        values["models_text"] = fields.get("models_text", "").strip()
        values["models"] = [m.strip() for m in values["models_text"].split(",") if m.strip()]
    if not values["name"]:
        problems["name"] = ("give the key a name, such as the program or machine that will "
                            "use it, so you know which key to revoke later")
    elif len(values["name"]) > 128:
        problems["name"] = f"a key's name is at most 128 characters, not {len(values['name'])}"
    if values["expires"]:
        try:
            days = float(values["expires"])
        except ValueError:
            days = 0
        if not 0 < days <= MAX_EXPIRY_DAYS:
            problems["expires"] = ("expiry is a number of days, more than 0 and at most "
                                   f"{MAX_EXPIRY_DAYS}, not {values['expires']!r}; leave it "
                                   "empty for a key that does not expire")
    limits, limit_problems = read_limits(fields)
    problems.update(limit_problems)
    if not is_admin and (values["owner"] or any(v is not None for v in limits.values())):
        problems["limits"] = ("only an admin sets a key's limits or makes a key for someone "
                              "else; make the key without them and ask an admin")
    return values, problems


@post(f"{PREFIX}/keys", include_in_schema=False)
async def make_key_post(request: Request) -> Template:
    page, fields = await posted(request)
    assert page.viewer is not None
    checkboxes = len(_catalog_names(request)) <= CHECKBOXES_UP_TO
    ticked = [m for m in (await request.form()).getall("models", []) if isinstance(m, str)]
    values, problems = _read_new_key(fields, ticked, checkboxes, page.is_admin)
    if problems:
        return await _keys_page(request, page, status_code=400, problems=problems,
                                values=values)
    limits, _ = read_limits(fields)
    given = {name: value for name, value in limits.items() if value is not None}
    new = NewKey(name=values["name"], models=values["models"] or None,
                 expires_in_days=float(values["expires"]) if values["expires"] else None,
                 owner=values["owner"] or None,
                 limits=LimitsIn(**given) if given else None)
    state = request.app.state
    try:
        made = await make_key(state.store, state.controller.catalog, page.viewer, new)
    except ApiError as err:
        where = {"models": "models", "owner": "owner", "limits": "limits"}.get(err.param or "")
        # A field's problem is the form's (400); anything else keeps the API's status.
        return await _keys_page(request, page, status_code=400 if where else err.status,
                                problems={where: err.message} if where else {},
                                problem="" if where else err.message, values=values)
    # The secret is on this answer and nowhere else: not in a redirect, not in a cookie;
    # the page is sent with cache-control: no-store.
    return page.render(
        "key_made.html", status_code=200, title=f"Key {made.name} made", made=made,
        models=models_words(made.models),
        limits=limits_words(msgspec.structs.asdict(made.limits)),
        expires=when(datetime.fromisoformat(made.expires_at)) if made.expires_at else "",
        base_url=str(request.base_url).rstrip("/"))


# --- one key -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LimitRow:
    label: str
    name: str
    value: int | None
    used: int
    resets_in: str


async def _key_page(request: Request, page: Page, key: ApiKeyRecord, *,
                    status_code: int = 200, problems: dict[str, str] | None = None,
                    values: dict[str, str] | None = None) -> Template:
    store = request.app.state.store
    now = datetime.now(UTC)
    first, last = _period(now.date())
    report = await usage_report(store, key, first, last, now)
    assert key.id is not None
    records = [UsageRecord(key_id=key.id, model=d.model, day=date.fromisoformat(d.day),
                           requests=d.requests, prompt_tokens=d.prompt_tokens,
                           completion_tokens=d.completion_tokens) for d in report.days]
    current = {name: "" if v is None else str(v) for name, v in key.limits.as_dict().items()}
    return page.render(
        "key.html", status_code=status_code, title=f"Key {key.name}",
        key=key_row(key, await owners(store), now),
        limits=[LimitRow(LIMIT_LABELS[u.limit], u.limit, u.value, u.used,
                         duration_words(u.resets_in_s)) for u in report.limits],
        chart=day_chart(records, first, last, "tokens per day, by model"),
        models_used=per_model(records), usage_days=USAGE_DAYS,
        problems=problems or {}, values={**current, **(values or {})})


@get(f"{PREFIX}/keys/{{prefix:str}}", include_in_schema=False)
async def key_page(request: Request, prefix: FromPath[str]) -> Template:
    page = await open_page(request)
    assert page.viewer is not None
    key = await visible_key(request.app.state.store, page.viewer, prefix)
    return await _key_page(request, page, key)


@post(f"{PREFIX}/keys/{{prefix:str}}/revoke", include_in_schema=False)
async def revoke_post(request: Request, prefix: FromPath[str]) -> None:
    page, fields = await posted(request)
    assert page.viewer is not None
    state = request.app.state
    if fields.get("confirm") != "yes":
        # Seen only if the browser let the required box through unticked.
        await visible_key(state.store, page.viewer, prefix)
        raise ApiError(400, "the key was not revoked: tick the box that says you mean it, "
                       "then press “Revoke this key” again", code="not_confirmed")
    key = await revoke(state.store, state.api_keys, page.viewer, prefix)
    if key.revoked_at is not None:
        raise GoTo(f"{PREFIX}/keys/{prefix}",
                   f"Key {key.name} ({key.prefix}) was already revoked, on "
                   f"{when(key.revoked_at)}.")
    raise GoTo(f"{PREFIX}/keys",
               f"Key {key.name} ({key.prefix}) is revoked: this server refuses it from now "
               f"on, other servers of the cluster within {state.config.auth.key_cache_s:g} s.")


@post(f"{PREFIX}/keys/{{prefix:str}}/limits", include_in_schema=False)
async def limits_post(request: Request, prefix: FromPath[str]) -> Template:
    # Limits are an admin's to set, over the API as here.
    page, fields = await posted(request, admin=True)
    assert page.viewer is not None
    state = request.app.state
    key = await visible_key(state.store, page.viewer, prefix)
    limits, problems = read_limits(fields)
    if problems:
        return await _key_page(request, page, key, status_code=400, problems=problems,
                               values={n: fields.get(n, "") for n in LIMIT_NAMES})
    # Every limit is on the form: an empty one lifts that limit.
    record = await set_limits(state.store, state.api_keys, page.viewer, prefix, limits)
    raise GoTo(f"{PREFIX}/keys/{prefix}",
               f"Limits of key {record.name} set: {limits_words(record.limits.as_dict())}.")


ROUTES: list = [keys_page, make_key_post, key_page, revoke_post, limits_post]
