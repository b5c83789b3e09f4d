"""What the gateway's once-a-second usage flush costs as more keys are busy.

The flush writes what every busy key used of every model in the last second. It did so
with one ``Store.record_usage`` per key and model; it now makes one ``Store.record_usages``
call for them all. This times both, side by side in one process, on a fresh store per
backend: SQLite in a temporary directory, and PostgreSQL when one answers at
``--pg-admin`` (a database is made for the run and dropped after). For each number of busy
keys (each with two models) it prints the median wall time and the event loop thread's CPU
of a flush, each way, and their ratio. Nothing is asserted. Run it with
``.venv/bin/python -m bench.usage_flush`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import make_url

from llmgw.store import ApiKeyRecord, Store, UsageEntry, open_store, sqlite_url

MODELS = ("qwen", "llama")
console = Console()


async def _keys(store: Store, n: int) -> list[int]:
    now = datetime.now(UTC)
    return [(await store.add_api_key(ApiKeyRecord(
        prefix=f"llmgw_{secrets.token_hex(6)}", secret_hash="h", name=f"bench{i}",
        created_at=now))).id for i in range(n)]


def _entries(keys: list[int]) -> list[UsageEntry]:
    return [UsageEntry(key_id=k, model=m, requests=40, prompt_tokens=4000,
                       completion_tokens=900) for k in keys for m in MODELS]


async def _one_by_one(store: Store, entries: list[UsageEntry], now: datetime) -> None:
    for e in entries:
        await store.record_usage(e.key_id, e.model, e.prompt_tokens, e.completion_tokens,
                                 now, requests=e.requests)


async def _batched(store: Store, entries: list[UsageEntry], now: datetime) -> None:
    await store.record_usages(entries, now)


async def _time(flush, store: Store, entries: list[UsageEntry], repeats: int
                ) -> tuple[float, float]:
    """Median (wall ms, loop-thread CPU ms) of ``repeats`` flushes."""
    walls, cpus = [], []
    for _ in range(repeats):
        now = datetime.now(UTC)
        wall, cpu = time.perf_counter(), time.thread_time()
        await flush(store, entries, now)
        walls.append((time.perf_counter() - wall) * 1e3)
        cpus.append((time.thread_time() - cpu) * 1e3)
    return statistics.median(walls), statistics.median(cpus)


async def _measure(name: str, url: str, sizes: list[int], repeats: int, table: Table) -> None:
    store = await open_store(url)
    try:
        keys = await _keys(store, max(sizes))
        await _batched(store, _entries(keys[:1]), datetime.now(UTC))  # warm: compiled
        await _one_by_one(store, _entries(keys[:1]), datetime.now(UTC))
        for n in sizes:
            entries = _entries(keys[:n])
            # In turn, so drift in the machine's load hits both alike.
            old = await _time(_one_by_one, store, entries, repeats)
            new = await _time(_batched, store, entries, repeats)
            table.add_row(name, str(n), str(len(entries)), f"{old[0]:.1f}", f"{old[1]:.1f}",
                          f"{new[0]:.1f}", f"{new[1]:.1f}", f"{new[1] / old[1]:.3f}")
    finally:
        await store.close()


async def _pg_database(admin: str) -> str | None:
    try:
        conn = await asyncpg.connect(admin, timeout=3)
    except (OSError, asyncpg.PostgresError) as err:
        console.print(f"note: no PostgreSQL at {admin} ({err}); SQLite only")
        return None
    name = f"llmgw_bench_{secrets.token_hex(4)}"
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return make_url(admin).set(drivername="postgresql+asyncpg",
                               database=name).render_as_string(hide_password=False)


async def _drop(admin: str, url: str) -> None:
    conn = await asyncpg.connect(admin, timeout=3)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')
    finally:
        await conn.close()


async def run(args: argparse.Namespace) -> None:
    table = Table(title="usage flush: one record_usage per key and model against one "
                        "record_usages call (median of each)")
    for column in ("store", "busy keys", "key+model pairs", "one by one ms",
                   "one by one CPU ms", "batched ms", "batched CPU ms", "CPU batched / one"):
        table.add_column(column, justify="left" if column == "store" else "right")
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        await _measure("sqlite", sqlite_url(Path(tmp) / "llmgw.db"), args.sizes,
                       args.repeats, table)
    url = None if args.no_pg else await _pg_database(args.pg_admin)
    if url is not None:
        try:
            await _measure("postgresql", url, args.sizes, args.repeats, table)
        finally:
            await _drop(args.pg_admin, url)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.usage_flush",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,10,100,500",
                        help="numbers of busy keys, comma-separated (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="flushes timed each way per size (default %(default)s)")
    parser.add_argument("--pg-admin", default="postgresql://postgres@127.0.0.1:5432/postgres",
                        help="PostgreSQL to make the run's database on (default %(default)s)")
    parser.add_argument("--no-pg", action="store_true", help="SQLite only")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
