"""What the store hands out: plain frozen Structs, never live ORM rows, and StoreError.

Callers (the server, the controller) get values they can keep, compare and pass across
tasks without a session attached; the table classes stay private to the store.

Secrets never reach the store: accounts, sessions, invites and API keys carry hashes the
caller made, and the store has no way to tell a hash from a plaintext, so it is the
caller's job never to pass one.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

import msgspec

from llmgw.core.usage import Limits

ACCOUNT_ROLES = ("admin", "user")


class StoreError(Exception):
    """The store refused or failed; the message says what was wrong and what to do."""


class StoreUnavailable(StoreError):
    """The store did not answer (unreachable, refusing connections, gone): nothing was
    read or written. The server answers what needs the store 503 until it answers again."""


class StoreSchemaMissing(StoreUnavailable):
    """The store answers but holds no llmgw tables: it was emptied or made again."""


class UsernameTaken(StoreError):
    """`add_account`: an account with this username exists already."""


class InviteUnusable(StoreError):
    """`add_account(..., invite_code_hash=...)`: the invite is unknown, used or expired."""


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
    `account_id` is the owning account; None for a key made with the admin token (e.g. by
    `llmgw up`). `limits` are enforced by `Store.admit`; none by default.
    """

    id: int | None = None
    prefix: str
    secret_hash: str
    name: str
    allowed_models: list[str] | None = None
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    account_id: int | None = None
    limits: Limits = msgspec.field(default_factory=Limits)


class UsageEntry(msgspec.Struct, frozen=True, kw_only=True):
    """Answers of one key and model to add to the usage record (`Store.record_usages`):
    how many, and the tokens they reported."""

    key_id: int
    model: str
    prompt_tokens: int
    completion_tokens: int
    requests: int = 1


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What one key used of one model on one UTC day, for reporting.

    `requests` counts the answers recorded with `Store.record_usage`, whether or not the
    engine reported tokens.
    """

    key_id: int
    model: str
    day: date
    requests: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class AccountRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A person who signs in. `role` is one of ACCOUNT_ROLES.

    `username` is lowercase (the store refuses others, so the unique constraint on it is
    case-insensitive uniqueness). Accounts are disabled (`disabled_at`), not deleted.
    """

    id: int | None = None
    username: str
    password_hash: str
    role: str
    created_at: datetime
    disabled_at: datetime | None = None


class SessionRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A signed-in browser session, found by the hash of its token."""

    token_hash: str
    account_id: int
    created_at: datetime
    expires_at: datetime


class InviteRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A one-time signup code, found by its hash; `used_by` is set once it is used."""

    code_hash: str
    created_at: datetime
    expires_at: datetime
    created_by: int | None = None
    used_by: int | None = None
    used_at: datetime | None = None
