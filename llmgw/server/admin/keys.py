"""API keys over the admin API: each account sees and revokes only its own; an admin
(or the admin token) sees all of them, and may make keys for another account."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

import msgspec
from litestar import Request, delete, get, post

from llmgw.server.admin.common import Input, body, require
from llmgw.server.auth.keys import create_api_key
from llmgw.server.errors import ApiError
from llmgw.store import ApiKeyRecord


class NewKey(Input):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    models: list[str] | None = None
    expires_in_days: Annotated[float, msgspec.Meta(gt=0, le=3650)] | None = None
    owner: str | None = None  # an admin making a key for someone else


def _key_json(key: ApiKeyRecord, owners: dict[int, str]) -> dict:
    return {
        "prefix": key.prefix, "name": key.name, "models": key.allowed_models,
        "owner": owners.get(key.account_id) if key.account_id is not None else None,
        "created_at": key.created_at.isoformat(),
        "expires_at": key.expires_at.isoformat() if key.expires_at else None,
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
    }


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
    # The only time the key is ever shown: only its hash is kept.
    return {"key": key, **_key_json(record, await _owners(request))}


@delete("/api/keys/{prefix:str}", status_code=200)
async def revoke_key(request: Request, prefix: str) -> dict:
    principal = await require(request)
    store = request.app.state.store
    key = await store.find_api_key(prefix)
    # Someone else's key is "not found", not "forbidden": its existence is not theirs to know.
    if key is None or (not principal.is_admin and key.account_id != principal.account_id):
        raise ApiError(404, f"you have no key {prefix!r}", code="key_not_found")
    await store.revoke_api_key(prefix, datetime.now(UTC))
    return {"revoked": prefix}


ROUTES = [list_keys, create_key, revoke_key]
