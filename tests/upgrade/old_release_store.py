"""The previous release's store and API keys at work, run as a script under that release's
code (tests/upgrade/release.py), so it uses only what that release has.

    old_release_store.py make-key SQLITE_FILE   opens (and migrates) the store, prints a new API key
    old_release_store.py rolling URL            the rolling upgrade, as a dialogue on stdin/stdout:

The rolling upgrade: it opens the store (migrating it to its own newest revision), writes,
and prints ``{"key": ...}``; then it waits for a line ``migrated NEW_KEY`` while a newer
server migrates the store under it, and reads and writes again on the same open store:
the rows the newer server wrote, the key it made, and its own; it prints what it saw.
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime

from llmgw.server.auth import check_api_key, create_api_key
from llmgw.store import open_store, sqlite_url


async def make_key(path: str) -> None:
    store = await open_store(sqlite_url(path))
    try:
        key, _ = await create_api_key(store, "tests")
    finally:
        await store.close()
    print(key)


async def rolling(url: str) -> None:
    store = await open_store(url)
    try:
        await store.put_model("old-before", {"replicas": 1})
        await store.put_setting("written-by", "old")
        key, _ = await create_api_key(store, "old")
        print(json.dumps({"key": key}), flush=True)

        word, new_key = (await asyncio.to_thread(sys.stdin.readline)).split()
        assert word == "migrated"
        now = datetime.now(UTC)
        new_checked = await check_api_key(store, new_key, now)
        own_checked = await check_api_key(store, key, now)
        await store.put_model("old-after", {"replicas": 2})
        seen = {
            "models": sorted(m.name for m in await store.list_models()),
            "nodes": [n.id for n in await store.list_nodes()],
            "setting": await store.get_setting("written-by"),
            "new_key": getattr(new_checked, "name", new_checked),
            "own_key": getattr(own_checked, "name", own_checked),
            "epoch": await store.next_epoch(),
        }
    finally:
        await store.close()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    mode, where = sys.argv[1:]
    asyncio.run({"make-key": make_key, "rolling": rolling}[mode](where))
