"""Per-key limits and the usage record: the part of `Store` on the gateway's hot path.

`UsageMixin` is inherited by `Store`. Counting is shared by every server on the store:
each window (a key's minute, day or month, in UTC) is one row of `usage_windows`, bumped
by a single INSERT ... ON CONFLICT DO UPDATE ... RETURNING, which PostgreSQL serialises
on the row lock and SQLite on its one writer. Of N concurrent requests under a limit of
L per minute, exactly L see a count of at most L, whichever server they reached.

Statements per call:

- `admit`, on every request of a key with limits: one (on PostgreSQL in autocommit: no
  BEGIN or COMMIT round trip), or none for a key without limits. With an rpm limit it is
  the upsert of the minute row, whose RETURNING also reads the day and month tokens
  (scalar subqueries) when those are limited; without one it is a single SELECT of the
  windows needed.
- `record_usages`, once a second for every busy key: one transaction of two prepared
  statements, each run for all its rows at once (executemany), usage_days' upsert and
  the windows'. `record_usage` is one entry of it. Measured with bench/usage_flush.py:
  1,000 keys and models cost 13-14 ms of CPU, where a statement each, its rows in its
  SQL, cost 1.5-1.7 s.

The decision itself (`llmgw.core.usage.judge`) is pure; this module only counts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from datetime import date, datetime
from typing import Any

from sqlalchemy import and_, delete, func, literal, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import aliased
from sqlalchemy.sql.elements import ColumnElement

from llmgw.core.usage import PERIODS, Counts, Limits, Refusal, judge, utc, window_start
from llmgw.store.records import StoreError, UsageEntry, UsageRecord
from llmgw.store.tables import UsageDayRow, UsageWindowRow

_WINDOW_KEY = [UsageWindowRow.key_id, UsageWindowRow.period, UsageWindowRow.start]
_DAY_KEY = [UsageDayRow.key_id, UsageDayRow.day, UsageDayRow.model]
_MAX_TOKENS = 2**53


class UsageMixin:
    """Limits and usage; mixed into `Store`, which provides these."""

    backend: str
    _insert: Callable[..., Any]
    _tx: Callable[..., AbstractAsyncContextManager[AsyncSession]]
    _statement: Callable[[], AbstractAsyncContextManager[AsyncSession | AsyncConnection]]

    async def admit(self, key_id: int, limits: Limits, now: datetime) -> Refusal | None:
        """Count one request of the key and judge it against `limits`.

        Returns None to let it through, else the Refusal (which limit, and the seconds
        until its window ends). A refused request counts against rpm too: retrying while
        refused does not get more through, and the count starts afresh each minute.
        """
        wanted = _windows_read(limits)
        if limits.rpm is None and not wanted:
            return None
        now = _aware(now)
        starts = {period: window_start(period, now) for period in PERIODS}
        if limits.rpm is not None:
            # The minute row is the one written: its tokens come back as they are after
            # any wait for its lock, not as a subquery's snapshot saw them.
            reads = [UsageWindowRow.tokens.label("minute") if period == "minute"
                     else _tokens_in(key_id, period, starts[period]).label(period)
                     for period in wanted]
            row_values = {"key_id": key_id, "period": "minute", "start": starts["minute"],
                          "requests": 1, "tokens": 0}
            stmt = (
                self._insert(UsageWindowRow)
                .values(**row_values)
                .on_conflict_do_update(
                    index_elements=_WINDOW_KEY,
                    set_={"requests": UsageWindowRow.requests + 1},
                )
                .returning(UsageWindowRow.requests, *reads)
            )
        else:
            reads = [_tokens_in(key_id, period, starts[period]).label(period)
                     for period in wanted]
            stmt = select(literal(0).label("requests"), *reads)
        async with self._statement() as s:
            row = (await s.execute(stmt)).one()._mapping
        counts = Counts(
            requests_this_minute=row["requests"],
            tokens_this_minute=row.get("minute") or 0,
            tokens_today=row.get("day") or 0,
            tokens_this_month=row.get("month") or 0,
        )
        return judge(limits, counts, now)

    async def record_usage(self, key_id: int, model: str, prompt_tokens: int,
                           completion_tokens: int, now: datetime, requests: int = 1) -> None:
        """Add answers' tokens to the key's windows, and to its usage of `model` on `now`'s
        UTC day (``requests`` more requests there, tokens or not: the gateway batches)."""
        await self.record_usages([UsageEntry(
            key_id=key_id, model=model, prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, requests=requests)], now)

    async def record_usages(self, entries: Iterable[UsageEntry], now: datetime) -> None:
        """`record_usage` for many keys and models at once, all at `now`, in one
        transaction. Entries of the same key and model are added together. Raises
        StoreError, naming the entry, before writing anything if one is not valid."""
        days: dict[tuple[int, str], list[int]] = {}
        for entry in entries:
            for name in ("prompt_tokens", "completion_tokens", "requests"):
                n = getattr(entry, name)
                if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _MAX_TOKENS:
                    raise StoreError(f"{name} must be a whole number from 0 up, not {n!r} "
                                     f"(key {entry.key_id}, model {entry.model!r})")
            if not entry.model:
                raise StoreError(f"record_usage needs the model's name (key {entry.key_id})")
            counts = days.setdefault((entry.key_id, entry.model), [0, 0, 0])
            counts[0] += entry.requests
            counts[1] += entry.prompt_tokens
            counts[2] += entry.completion_tokens
        if not days:
            return
        now = _aware(now)
        day = window_start("day", now).date()
        # Sorted: every server locks the rows in one order, so two flushes cannot deadlock.
        rows = [{"key_id": key_id, "day": day, "model": model, "requests": requests,
                 "prompt_tokens": prompt, "completion_tokens": completion}
                for (key_id, model), (requests, prompt, completion) in sorted(days.items())]
        tokens: dict[int, int] = {}  # a key's windows count all its models
        for row in rows:
            if used := row["prompt_tokens"] + row["completion_tokens"]:
                tokens[row["key_id"]] = tokens.get(row["key_id"], 0) + used
        starts = [(period, window_start(period, now)) for period in PERIODS]
        windows = [{"key_id": key_id, "period": period, "start": start, "requests": 0,
                    "tokens": total}
                   for key_id, total in tokens.items()
                   for period, start in starts]  # always in this order: rows are locked in it
        days_upsert, windows_upsert = self._usage_upserts
        async with self._tx() as s:
            await s.execute(days_upsert, rows)
            if windows:
                # Last: `admit` takes these rows on every request of a key with limits, so
                # they are held locked for the shortest time.
                await s.execute(windows_upsert, windows)

    @functools.cached_property
    def _usage_upserts(self) -> tuple[Any, Any]:
        """The usage_days and usage_windows upserts, made once per store and run with a
        list of rows each (executemany): compiled once, not per call and row count.

        Of the tables, not of their ORM classes: an ORM-enabled insert run with a list of
        rows goes through the ORM's bulk-insert machinery first, a third of a one-key
        flush's Python calls (1,388 against 946, counted with cProfile on uvloop); the SQL
        is the same."""
        day = UsageDayRow.__table__.c
        days = self._insert(UsageDayRow.__table__)
        days = days.on_conflict_do_update(
            index_elements=_DAY_KEY,
            set_={
                "requests": day.requests + days.excluded.requests,
                "prompt_tokens": day.prompt_tokens + days.excluded.prompt_tokens,
                "completion_tokens": day.completion_tokens + days.excluded.completion_tokens,
            },
        )
        window = UsageWindowRow.__table__.c
        windows = self._insert(UsageWindowRow.__table__)
        windows = windows.on_conflict_do_update(
            index_elements=_WINDOW_KEY,
            set_={"tokens": window.tokens + windows.excluded.tokens},
        )
        return days, windows

    async def usage_counts(self, key_id: int, now: datetime) -> Counts:
        """What the key has used in the windows that hold `now` (nothing is counted)."""
        now = _aware(now)
        reads = [_tokens_in(key_id, period, window_start(period, now)).label(period)
                 for period in PERIODS]
        minute = aliased(UsageWindowRow)
        requests = (select(minute.requests)
                    .where(minute.key_id == key_id, minute.period == "minute",
                           minute.start == window_start("minute", now))
                    .scalar_subquery().label("requests"))
        async with self._tx() as s:
            row = (await s.execute(select(requests, *reads))).one()._mapping
        return Counts(
            requests_this_minute=row["requests"] or 0,
            tokens_this_minute=row["minute"] or 0,
            tokens_today=row["day"] or 0,
            tokens_this_month=row["month"] or 0,
        )

    async def list_usage(self, key_id: int | None = None, *, since: date | None = None,
                         until: date | None = None) -> list[UsageRecord]:
        """Usage per key, model and UTC day, from `since` to `until` (both included);
        by day, then key, then model."""
        # Plain columns, not ORM objects: a report reads tens of thousands of rows.
        stmt = select(UsageDayRow.key_id, UsageDayRow.model, UsageDayRow.day,
                      UsageDayRow.requests, UsageDayRow.prompt_tokens,
                      UsageDayRow.completion_tokens).order_by(
            UsageDayRow.day, UsageDayRow.key_id, UsageDayRow.model)
        if key_id is not None:
            stmt = stmt.where(UsageDayRow.key_id == key_id)
        if since is not None:
            stmt = stmt.where(UsageDayRow.day >= since)
        if until is not None:
            stmt = stmt.where(UsageDayRow.day <= until)
        async with self._tx() as s:
            return [UsageRecord(key_id=k, model=m, day=d, requests=r, prompt_tokens=p,
                                completion_tokens=c)
                    for k, m, d, r, p, c in (await s.execute(stmt)).all()]

    async def sum_usage(self, by: tuple[str, ...], *, since: date, until: date,
                        key_ids: Iterable[int] | None = None) -> list[UsageRecord]:
        """Usage from `since` to `until` (both included), summed in the database over
        what `by` ("day", "key_id", "model") leaves out; a field left out reads 0, "" or
        `since`. Of the keys `key_ids` only, if given. For reports over many days and
        keys: the sums are made by the database, not by building a row per day."""
        columns = {"day": UsageDayRow.day, "key_id": UsageDayRow.key_id,
                   "model": UsageDayRow.model}
        grouped = [columns[name] for name in by]
        stmt = (select(*grouped, func.sum(UsageDayRow.requests),
                       func.sum(UsageDayRow.prompt_tokens),
                       func.sum(UsageDayRow.completion_tokens))
                .where(UsageDayRow.day >= since, UsageDayRow.day <= until)
                .group_by(*grouped).order_by(*grouped))
        if key_ids is not None:
            stmt = stmt.where(UsageDayRow.key_id.in_(list(key_ids)))
        async with self._tx() as s:
            rows = (await s.execute(stmt)).all()
        empty = {"day": since, "key_id": 0, "model": ""}
        return [UsageRecord(**{**empty, **dict(zip(by, row[:len(by)], strict=True))},
                            requests=int(row[-3]), prompt_tokens=int(row[-2]),
                            completion_tokens=int(row[-1]))
                for row in rows]

    async def prune_usage_windows(self, now: datetime) -> int:
        """Delete the windows that ended before `now`; how many there were. For the
        server's housekeeping: the counts of ended windows are never read again."""
        now = _aware(now)
        ended = or_(*(
            and_(UsageWindowRow.period == period,
                 UsageWindowRow.start < window_start(period, now))
            for period in PERIODS
        ))
        async with self._tx() as s:
            return (await s.execute(delete(UsageWindowRow).where(ended))).rowcount


def _aware(now: datetime) -> datetime:
    try:
        return utc(now)
    except ValueError as exc:
        raise StoreError(str(exc)) from exc


def _windows_read(limits: Limits) -> list[str]:
    """The windows whose tokens `limits` need read."""
    needed = {"minute": limits.tpm, "day": limits.tokens_per_day,
              "month": limits.tokens_per_month}
    return [period for period, limit in needed.items() if limit is not None]


def _tokens_in(key_id: int, period: str, start: datetime) -> ColumnElement[int]:
    window = aliased(UsageWindowRow)
    return (
        select(window.tokens)
        .where(window.key_id == key_id, window.period == period, window.start == start)
        .scalar_subquery()
    )
