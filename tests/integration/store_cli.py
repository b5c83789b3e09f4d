"""`llmgw store` run as an operator runs it, on a server.yaml and a SQLite store with a few
rows: shared by the store command tests."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from llmgw.store import ApiKeyRecord, open_store, sqlite_url

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 3, 4, 5, 6, 7, 891011, tzinfo=UTC)
CONFIG = """\
# the server's configuration; this comment must survive the move
listen:
  port: {port}   # the API

state_dir: {state}
auth:
  require_api_key: true
"""


def llmgw_store(*args: str | os.PathLike, stdin: str = "",
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "store", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        input=stdin,
        env={**(env or os.environ), "COLUMNS": "120"},
    )


async def make_server(root: Path, port: int = 8080) -> Path:
    """A server.yaml (0640, default SQLite store) in `root` and its store with a few rows;
    the config's path."""
    state = root / "state"
    config = root / "server.yaml"
    config.write_text(CONFIG.format(state=state, port=port))
    config.chmod(0o640)
    store = await open_store(sqlite_url(state / "llmgw.db"))
    try:
        await store.put_model("m", {"name": "m", "profiles": [{"engine": "sim"}], "x": 0.1})
        await store.put_setting("s", {"nested": [1, None]})
        for i in range(3):
            await store.add_api_key(
                ApiKeyRecord(
                    prefix=f"k{i}",
                    secret_hash=f"h{i}",
                    name=f"key {i}",
                    created_at=T0,
                    allowed_models=["m"] if i else None,
                )
            )
    finally:
        await store.close()
    return config


async def check_rows(url: str, models: bool = True) -> None:
    """The rows `make_server` wrote are in the store at `url`, exactly; `models` False where
    a server ran on the store since, and dropped the model server.yaml does not declare."""
    store = await open_store(url)
    try:
        keys = await store.list_api_keys()
        assert [k.prefix for k in keys] == ["k0", "k1", "k2"]
        assert keys[0].created_at == T0
        if models:
            assert (await store.get_model("m")).spec["x"] == 0.1
        assert await store.get_setting("s") == {"nested": [1, None]}
    finally:
        await store.close()
