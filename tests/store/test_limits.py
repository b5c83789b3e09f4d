"""Per-key limits and usage in the store, on SQLite and on PostgreSQL.

Time is always passed in: a window rolls over when the test says so, never because the
test ran across a minute boundary.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import msgspec
import pytest
from sqlalchemy import event, func, select

from llmgw.core.usage import Counts, Limits, Refusal
from llmgw.store import (
    ApiKeyRecord,
    Store,
    StoreError,
    UsageEntry,
    UsageRecord,
    open_store,
)
from llmgw.store.tables import UsageWindowRow

ROOT = Path(__file__).resolve().parents[2]
# 12.25 s before the end of a minute, a day (UTC) and a month, at once.
T = datetime(2025, 3, 31, 23, 59, 47, 750000, tzinfo=UTC)
NEXT_MINUTE = datetime(2025, 4, 1, 0, 0, 0, tzinfo=UTC)


async def add_key(store: Store, prefix: str = "llmgw_k1", **limits: int | None) -> ApiKeyRecord:
    return await store.add_api_key(ApiKeyRecord(
        prefix=prefix, secret_hash="h", name=prefix, created_at=T, limits=Limits(**limits)))


@contextmanager
def statements(store: Store) -> Iterator[list[str]]:
    """The SQL statements run meanwhile, BEGIN left out (it is not sent on PostgreSQL)."""
    seen: list[str] = []

    def listen(_conn, _cursor, statement, _params, _context, _many) -> None:
        if not statement.startswith("BEGIN"):
            seen.append(statement)

    event.listen(store.engine.sync_engine, "before_cursor_execute", listen)
    try:
        yield seen
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", listen)


# --- limits on keys ----------------------------------------------------------------------


async def test_limits_are_stored_with_the_key_and_changed_one_by_one(store: Store) -> None:
    plain = await add_key(store, "llmgw_plain")
    assert plain.limits == Limits()
    key = await add_key(store, rpm=60, tokens_per_month=5_000_000)
    assert (await store.find_api_key("llmgw_k1")).limits == Limits(
        rpm=60, tokens_per_month=5_000_000)

    changed = await store.update_api_key_limits("llmgw_k1", tpm=10_000, rpm=None)
    assert changed.id == key.id
    assert changed.limits == Limits(tpm=10_000, tokens_per_month=5_000_000)
    assert (await store.find_api_key("llmgw_k1")).limits == changed.limits
    assert (await store.update_api_key_limits("llmgw_k1")).limits == changed.limits
    listed = {k.prefix: k.limits for k in await store.list_api_keys()}
    assert listed == {"llmgw_plain": Limits(), "llmgw_k1": changed.limits}


async def test_bad_limit_changes_are_refused_in_words(store: Store) -> None:
    await add_key(store, rpm=5)
    with pytest.raises(StoreError, match="rpm must be a whole number from 1 to"):
        await store.update_api_key_limits("llmgw_k1", rpm=0)
    with pytest.raises(StoreError, match="'rph' is not a limit; the limits are rpm, tpm"):
        await store.update_api_key_limits("llmgw_k1", rph=5)
    with pytest.raises(StoreError, match="no API key 'llmgw_nope' in the store"):
        await store.update_api_key_limits("llmgw_nope", rpm=5)
    assert (await store.find_api_key("llmgw_k1")).limits == Limits(rpm=5)


# --- admit -------------------------------------------------------------------------------


async def test_rpm_is_exact_at_the_boundary_and_rolls_over(store: Store) -> None:
    key = await add_key(store, rpm=3)
    assert [await store.admit(key.id, key.limits, T) for _ in range(3)] == [None] * 3
    refused = await store.admit(key.id, key.limits, T)
    assert refused == Refusal("rpm", 3, 4, 13)  # 12.25 s left, rounded up
    assert refused.message == (
        "this key's limit of 3 requests per minute is used up; try again in 13 s")
    assert await store.admit(key.id, key.limits, T + timedelta(seconds=12)) is not None
    # The next minute starts afresh, refused requests and all.
    assert [await store.admit(key.id, key.limits, NEXT_MINUTE) for _ in range(3)] == [None] * 3
    assert (await store.admit(key.id, key.limits, NEXT_MINUTE)).retry_after_s == 60


async def test_keys_count_apart(store: Store) -> None:
    one = await add_key(store, "llmgw_one", rpm=1)
    two = await add_key(store, "llmgw_two", rpm=1)
    assert await store.admit(one.id, one.limits, T) is None
    assert await store.admit(two.id, two.limits, T) is None
    assert (await store.admit(one.id, one.limits, T)).limit == "rpm"


async def test_tpm_refuses_the_request_after_the_one_that_used_it_up(store: Store) -> None:
    key = await add_key(store, rpm=100, tpm=100)
    assert await store.admit(key.id, key.limits, T) is None
    await store.record_usage(key.id, "qwen", 60, 39, T)  # 99: one token left
    assert await store.admit(key.id, key.limits, T) is None  # let through...
    await store.record_usage(key.id, "qwen", 60, 50, T)  # ...and it used 110
    refused = await store.admit(key.id, key.limits, T)
    assert refused == Refusal("tpm", 100, 209, 13)
    assert refused.message.startswith("this key's limit of 100 tokens per minute is used up")
    assert await store.admit(key.id, key.limits, NEXT_MINUTE) is None


async def test_tpm_alone_counts_no_requests(store: Store) -> None:
    key = await add_key(store, tpm=10)
    with statements(store) as seen:
        assert await store.admit(key.id, key.limits, T) is None
    assert seen[0].lstrip().upper().startswith("SELECT")  # a read: nothing to count
    await store.record_usage(key.id, "qwen", 10, 0, T)
    assert (await store.admit(key.id, key.limits, T)).limit == "tpm"
    assert await store.usage_counts(key.id, T) == Counts(tokens_this_minute=10,
                                                         tokens_today=10,
                                                         tokens_this_month=10)


async def test_day_and_month_quotas_and_their_retry_after(store: Store) -> None:
    key = await add_key(store, tokens_per_day=1000, tokens_per_month=1500)
    morning = datetime(2025, 3, 31, 6, 0, 0, tzinfo=UTC)
    await store.record_usage(key.id, "qwen", 900, 99, morning)
    assert await store.admit(key.id, key.limits, T) is None  # 999 of 1000 today
    await store.record_usage(key.id, "llama", 1, 0, T)  # another model, same budget
    day = await store.admit(key.id, key.limits, T)
    assert (day.limit, day.used, day.retry_after_s) == ("tokens_per_day", 1000, 13)
    # April 1st: a new day and a new month.
    assert await store.admit(key.id, key.limits, NEXT_MINUTE) is None
    april = datetime(2025, 4, 2, 12, tzinfo=UTC)
    await store.record_usage(key.id, "qwen", 1500, 0, april)
    month = await store.admit(key.id, key.limits, april + timedelta(days=1))
    assert month.limit == "tokens_per_month"
    assert month.retry_after_s == (datetime(2025, 5, 1, tzinfo=UTC)
                                   - (april + timedelta(days=1))).total_seconds()
    assert month.message.endswith("try again in 27 d 12 h")
    assert await store.admit(key.id, key.limits, datetime(2025, 5, 1, tzinfo=UTC)) is None


async def test_a_limit_set_mid_day_counts_the_tokens_used_before(store: Store) -> None:
    key = await add_key(store)
    await store.record_usage(key.id, "qwen", 700, 300, T - timedelta(hours=3))
    limited = await store.update_api_key_limits(key.prefix, tokens_per_day=1000)
    assert (await store.admit(key.id, limited.limits, T)).limit == "tokens_per_day"


async def test_a_key_without_limits_costs_no_statement(store: Store) -> None:
    key = await add_key(store)
    with statements(store) as seen:
        assert await store.admit(key.id, key.limits, T) is None
    assert seen == []


async def test_one_statement_per_admit_and_two_per_record(store: Store) -> None:
    key = await add_key(store, rpm=10, tpm=10**6, tokens_per_day=10**6,
                        tokens_per_month=10**6)
    with statements(store) as seen:
        assert await store.admit(key.id, key.limits, T) is None
    assert len(seen) == 1 and seen[0].startswith("INSERT INTO usage_windows")
    with statements(store) as seen:
        await store.record_usage(key.id, "qwen", 5, 5, T)
    # The windows last: admit takes their rows, so they stay locked the shortest time.
    assert [s.split("(")[0].strip() for s in seen] == [
        "INSERT INTO usage_days", "INSERT INTO usage_windows"]


async def test_admit_for_an_unknown_key_fails(store: Store) -> None:
    with pytest.raises(StoreError, match="failed"):
        await store.admit(999, Limits(rpm=5), T)


async def test_naive_times_are_refused(store: Store) -> None:
    key = await add_key(store, rpm=5)
    with pytest.raises(StoreError, match="naive datetime"):
        await store.admit(key.id, key.limits, T.replace(tzinfo=None))
    with pytest.raises(StoreError, match="naive datetime"):
        await store.record_usage(key.id, "qwen", 1, 1, T.replace(tzinfo=None))


@pytest.mark.parametrize(("prompt", "completion"), [(-1, 0), (0, -5), (1.5, 0), (True, 0)])
async def test_bad_token_counts_are_refused(store: Store, prompt, completion) -> None:
    key = await add_key(store)
    with pytest.raises(StoreError, match="must be a whole number from 0 up"):
        await store.record_usage(key.id, "qwen", prompt, completion, T)
    assert await store.list_usage() == []


# --- usage -------------------------------------------------------------------------------


async def test_usage_is_recorded_per_key_model_and_day(store: Store) -> None:
    one = await add_key(store, "llmgw_one")
    two = await add_key(store, "llmgw_two")
    await store.record_usage(one.id, "qwen", 10, 5, T)
    await store.record_usage(one.id, "qwen", 1, 2, T - timedelta(hours=1))
    await store.record_usage(one.id, "llama", 7, 0, T)
    await store.record_usage(one.id, "qwen", 0, 0, T)  # an answer without usage
    await store.record_usage(one.id, "qwen", 3, 3, NEXT_MINUTE)  # April 1st
    await store.record_usage(two.id, "qwen", 100, 100, T)

    march_31, april_1 = date(2025, 3, 31), date(2025, 4, 1)
    assert await store.list_usage(one.id) == [
        UsageRecord(key_id=one.id, model="llama", day=march_31, requests=1, prompt_tokens=7,
                    completion_tokens=0),
        UsageRecord(key_id=one.id, model="qwen", day=march_31, requests=3, prompt_tokens=11,
                    completion_tokens=7),
        UsageRecord(key_id=one.id, model="qwen", day=april_1, requests=1, prompt_tokens=3,
                    completion_tokens=3),
    ]
    assert [u.day for u in await store.list_usage(one.id, since=april_1)] == [april_1]
    assert [u.model for u in await store.list_usage(one.id, until=march_31)] == [
        "llama", "qwen"]
    assert [(u.key_id, u.total_tokens) for u in await store.list_usage(
        since=march_31, until=march_31)] == [(one.id, 7), (one.id, 18), (two.id, 200)]
    assert await store.usage_counts(one.id, T) == Counts(
        tokens_this_minute=22, tokens_today=25, tokens_this_month=25)


async def test_usage_is_summed_by_the_store_over_what_a_report_leaves_out(store: Store
                                                                          ) -> None:
    one = await add_key(store, "llmgw_one")
    two = await add_key(store, "llmgw_two")
    await store.record_usage(one.id, "qwen", 10, 5, T)
    await store.record_usage(one.id, "llama", 7, 0, T)
    await store.record_usage(one.id, "qwen", 3, 3, NEXT_MINUTE)  # April 1st
    await store.record_usage(two.id, "qwen", 100, 100, T)
    march_31, april_1 = date(2025, 3, 31), date(2025, 4, 1)
    both = {"since": march_31, "until": april_1}

    def sums(records: list[UsageRecord]) -> list[tuple]:
        return [(r.day, r.key_id, r.model, r.requests, r.total_tokens) for r in records]

    assert sums(await store.sum_usage(("day", "model"), **both)) == [
        (march_31, 0, "llama", 1, 7), (march_31, 0, "qwen", 2, 215),
        (april_1, 0, "qwen", 1, 6)]
    assert sums(await store.sum_usage(("key_id",), **both)) == [
        (march_31, one.id, "", 3, 28), (march_31, two.id, "", 1, 200)]
    assert sums(await store.sum_usage(("model",), **both, key_ids=[one.id])) == [
        (march_31, 0, "llama", 1, 7), (march_31, 0, "qwen", 2, 21)]
    # Every field kept: the rows as they are stored, as list_usage reads them.
    assert await store.sum_usage(("day", "key_id", "model"), **both) == await store.list_usage(
        since=march_31, until=april_1)
    assert await store.sum_usage(("day",), since=april_1, until=april_1, key_ids=[]) == []


async def test_many_keys_and_models_are_recorded_by_two_statements(store: Store) -> None:
    """As the gateway flushes a second's usage: every key and model at once, entries of the
    same pair added up, each key's windows counting all its models; two statements in all,
    each run once for all its rows (executemany)."""
    keys = [await add_key(store, f"llmgw_b{i:03d}") for i in range(5)]
    entries = [UsageEntry(key_id=k.id, model=m, requests=2, prompt_tokens=10 * i,
                          completion_tokens=i) for i, k in enumerate(keys)
               for m in ("qwen", "llama")]
    entries.append(UsageEntry(key_id=keys[1].id, model="qwen", prompt_tokens=1,
                              completion_tokens=1))  # the same pair again: added up
    with statements(store) as seen:
        await store.record_usages(entries, T)
    assert len(seen) == 2
    usage = {(u.key_id, u.model): u for u in await store.list_usage()}
    assert len(usage) == 10
    assert usage[keys[1].id, "qwen"] == UsageRecord(
        key_id=keys[1].id, model="qwen", day=T.date(), requests=3, prompt_tokens=11,
        completion_tokens=2)
    assert usage[keys[4].id, "llama"].total_tokens == 44
    assert await store.usage_counts(keys[0].id, T) == Counts()  # no tokens, no windows
    assert await store.usage_counts(keys[1].id, T) == Counts(
        tokens_this_minute=24, tokens_today=24, tokens_this_month=24)

    with statements(store) as seen:  # again: added to what is there
        await store.record_usages(entries[:2], T)
    assert len(seen) == 1  # keys[0] used no tokens: no windows to write
    assert [u.requests for u in await store.list_usage(keys[0].id)] == [4, 4]


async def test_a_bad_entry_among_many_records_none(store: Store) -> None:
    key = await add_key(store)
    good = UsageEntry(key_id=key.id, model="qwen", prompt_tokens=1, completion_tokens=1)
    bad = UsageEntry(key_id=key.id, model="llama", prompt_tokens=-3, completion_tokens=0)
    with pytest.raises(StoreError, match=r"prompt_tokens must be a whole number from 0 up, "
                                         r"not -3 \(key \d+, model 'llama'\)"):
        await store.record_usages([good, bad], T)
    assert await store.list_usage() == []


async def test_prune_removes_only_ended_windows(store: Store) -> None:
    key = await add_key(store, rpm=100)
    long_ago = datetime(2025, 1, 15, 10, 0, tzinfo=UTC)
    await store.record_usage(key.id, "qwen", 1, 1, long_ago)  # 3 windows, all ended by T
    await store.record_usage(key.id, "qwen", 1, 1, T - timedelta(minutes=5))  # a minute
    assert await store.admit(key.id, key.limits, T) is None
    await store.record_usage(key.id, "qwen", 1, 1, T)  # T's minute, day and month

    assert await store.prune_usage_windows(T) == 4
    assert await store.prune_usage_windows(T) == 0
    async with store.engine.connect() as conn:
        left = (await conn.execute(
            select(UsageWindowRow.period, func.count()).group_by(UsageWindowRow.period)
        )).all()
    assert sorted(left) == [("day", 1), ("minute", 1), ("month", 1)]
    assert await store.usage_counts(key.id, T) == Counts(
        requests_this_minute=1, tokens_this_minute=2, tokens_today=4, tokens_this_month=4)
    assert len(await store.list_usage(key.id)) == 2  # the report is never pruned
    # A month later, everything of March has ended.
    assert await store.prune_usage_windows(T + timedelta(days=31)) == 3


# --- shared by several servers -----------------------------------------------------------


@pytest.fixture
async def second_store(store: Store) -> AsyncIterator[Store]:
    """Another Store on the same database, with its own engine and connections: what a
    second server process sees."""
    other = await open_store(store.url)
    try:
        yield other
    finally:
        await other.close()


async def test_two_stores_never_admit_more_than_the_limit(
    store: Store, second_store: Store
) -> None:
    key = await add_key(store, rpm=37)
    stores = [store, second_store] * 60

    verdicts = await asyncio.gather(*(s.admit(key.id, key.limits, T) for s in stores))

    assert verdicts.count(None) == 37
    refused = [v for v in verdicts if v is not None]
    assert {(r.limit, r.retry_after_s) for r in refused} == {("rpm", 13)}
    assert sorted(r.used for r in refused) == list(range(38, 121))  # each count seen once
    assert (await second_store.usage_counts(key.id, T)).requests_this_minute == 120


async def test_two_stores_add_up_tokens_exactly(store: Store, second_store: Store) -> None:
    key = await add_key(store, tpm=1000)
    await asyncio.gather(*(s.record_usage(key.id, m, 3, 4, T)
                           for s in (store, second_store) * 25 for m in ("qwen", "llama")))
    assert await store.usage_counts(key.id, T) == Counts(
        tokens_this_minute=700, tokens_today=700, tokens_this_month=700)
    assert [(u.model, u.requests, u.total_tokens) for u in await second_store.list_usage()] == [
        ("llama", 50, 350), ("qwen", 50, 350)]
    assert (await second_store.admit(key.id, key.limits, T)) is None
    await store.record_usage(key.id, "qwen", 300, 0, T)
    assert (await second_store.admit(key.id, key.limits, T)).limit == "tpm"


_ADMITTER = """
import asyncio, json, sys
from datetime import datetime
from llmgw.core.usage import Limits
from llmgw.store import open_store

async def main(url, key_id, rpm, when, n):
    store = await open_store(url)
    try:
        now = datetime.fromisoformat(when)
        verdicts = await asyncio.gather(
            *(store.admit(key_id, Limits(rpm=rpm), now) for _ in range(n)))
    finally:
        await store.close()
    print(json.dumps(sum(v is None for v in verdicts)))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])))
"""


async def test_two_server_processes_share_the_limit(store: Store) -> None:
    """Two OS processes, each with its own store connection pool, as two servers are."""
    key = await add_key(store, rpm=45)

    async def run() -> int:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _ADMITTER, store.url, str(key.id), "45", T.isoformat(), "60",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
        assert proc.returncode == 0, err.decode()
        return json.loads(out)

    admitted = await asyncio.gather(run(), run())

    assert sum(admitted) == 45
    assert (await store.usage_counts(key.id, T)).requests_this_minute == 120


async def test_records_of_keys_are_plain_values(store: Store) -> None:
    key = await add_key(store, rpm=1)
    copy = msgspec.structs.replace(key, limits=Limits(rpm=2))
    assert key.limits == Limits(rpm=1) and copy.limits.rpm == 2
