"""What the store hands out: plain frozen Structs, never live ORM rows.

Callers (the server, the controller) get values they can keep, compare and pass across
tasks without a session attached; the table classes stay private to the store.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec


class StoredModel(msgspec.Struct, frozen=True, kw_only=True):
    """A declared model; `spec` is the caller's JSON-able document, stored as given."""

    name: str
    spec: dict[str, Any]
    created_at: datetime
    updated_at: datetime


class NodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A node as its agent last registered it, plus the state the server gave it.

    `state_changed_at` is when `state` last changed (set by `Store.set_node_state`); it is
    kept apart from `last_seen_at` because a node turns unreachable without being seen.
    """

    id: str
    address: str
    state: str
    inventory: dict[str, Any]
    registered_at: datetime
    last_seen_at: datetime
    state_changed_at: datetime | None = None


class ApiKeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """An API key. Only `secret_hash` is kept; the secret itself is never stored.

    `allowed_models` None means every model; `id` is None until the store assigns one.
    """

    id: int | None = None
    prefix: str
    secret_hash: str
    name: str
    allowed_models: list[str] | None = None
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
