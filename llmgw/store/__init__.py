"""The store: SQLAlchemy 2 async over SQLite (aiosqlite) or PostgreSQL (asyncpg).

`open_store(url)` connects, migrates to head and returns a `Store`; everything it hands
out is a plain frozen record from `llmgw.store.records`.
"""

from llmgw.store.records import (
    ACCOUNT_ROLES,
    AccountRecord,
    ApiKeyRecord,
    InviteRecord,
    InviteUnusable,
    NodeRecord,
    SessionRecord,
    StoredModel,
    StoreError,
    StoreSchemaMissing,
    StoreUnavailable,
    UsageEntry,
    UsageRecord,
    UsernameTaken,
)
from llmgw.store.store import SUPPORTED_SCHEMES, Store, open_store, sqlite_url

__all__ = [
    "ACCOUNT_ROLES",
    "SUPPORTED_SCHEMES",
    "AccountRecord",
    "ApiKeyRecord",
    "InviteRecord",
    "InviteUnusable",
    "NodeRecord",
    "SessionRecord",
    "Store",
    "StoreError",
    "StoreSchemaMissing",
    "StoreUnavailable",
    "StoredModel",
    "UsageEntry",
    "UsageRecord",
    "UsernameTaken",
    "open_store",
    "sqlite_url",
]
