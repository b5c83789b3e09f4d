"""The store: SQLAlchemy 2 async over SQLite (aiosqlite) or PostgreSQL (asyncpg).

`open_store(url)` connects, migrates to head and returns a `Store`; everything it hands
out is a plain frozen record from `llmgw.store.records`.
"""

from llmgw.store.records import ApiKeyRecord, NodeRecord, StoredModel
from llmgw.store.store import SUPPORTED_SCHEMES, Store, StoreError, open_store, sqlite_url

__all__ = [
    "SUPPORTED_SCHEMES",
    "ApiKeyRecord",
    "NodeRecord",
    "Store",
    "StoreError",
    "StoredModel",
    "open_store",
    "sqlite_url",
]
