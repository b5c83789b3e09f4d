"""The usage page: tokens per model and per key over a chosen period (UTC days), as
charts, as tables, and as a CSV download of every row.

Users see their own keys' usage, admins every key's. The numbers are the store's usage
record (one row per key, model and UTC day, which each server flushes once a second),
summed by the database (``Store.sum_usage``): a 90-day page of 300 keys reads a few
thousand sums, not tens of thousands of rows. A period is at most ``MAX_DAYS`` long; the
page stays small whatever it holds: longer periods are drawn a week a bar, the chart
names the biggest models and adds the rest up as "other models", and the per-key table
shows the biggest keys (the CSV has them all).
"""

from __future__ import annotations

import asyncio
import csv
import io
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

from litestar import Request, Response, get
from litestar.response import Stream, Template
from markupsafe import Markup

from llmgw.server.admin.keys import owners as owner_names
from llmgw.server.admin.keys import usage_period, visible_keys
from llmgw.server.auth.sessions import Principal
from llmgw.server.errors import ApiError
from llmgw.server.ui.charts import COLOURS, Column, stacked_bars
from llmgw.server.ui.page import PREFIX, open_page
from llmgw.store import ApiKeyRecord, Store, UsageRecord

MAX_DAYS = 366  # the longest period asked for at once
PRESETS = (7, 30, 90)
DEFAULT_DAYS = 30
# A chart has at most BARS_MAX bars: a bar a day, a week or two weeks, whichever fits.
BARS_MAX = 31
BAR_DAYS = {1: "day", 7: "week", 14: "two weeks"}
TOP_MODELS = COLOURS - 1  # named in the chart; the rest share the last colour
SERIES_NAME_MAX = 40  # characters of a model's name in a chart; the tables say it whole
TOP_MODELS_TABLE = 20
TOP_KEYS_CHART = 15
TOP_KEYS_TABLE = 30
OTHER_MODELS = "other models"


@dataclass(slots=True)
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, record: UsageRecord) -> None:
        self.requests += record.requests
        self.prompt_tokens += record.prompt_tokens
        self.completion_tokens += record.completion_tokens


@dataclass(slots=True)
class Row:
    """One line of a table: what it is (a model, a key, a day) and its numbers."""

    label: str
    totals: Totals = field(default_factory=Totals)
    prefix: str = ""  # a key's
    owner: str = ""  # a key's owner, as admins see it


@dataclass(slots=True)
class DayChart:
    """Tokens per day (or week), stacked by model: the SVG, its legend and its numbers."""

    svg: Markup
    series: list[str]
    rows: list[Row]  # one per bar, oldest first
    bar_days: int  # a key of BAR_DAYS

    @property
    def per(self) -> str:
        """What a bar is: "day", "week" or "two weeks"."""
        return BAR_DAYS[self.bar_days]


def key_label(key: ApiKeyRecord | None, key_id: int) -> str:
    return f"{key.name} ({key.prefix})" if key is not None else f"key #{key_id}"


def bar_days(first: date, last: date) -> int:
    """The days a bar of a chart from ``first`` to ``last`` stands for: the fewest that
    keep to BARS_MAX bars."""
    days = (last - first).days + 1
    return next((n for n in BAR_DAYS if -(-days // n) <= BARS_MAX), max(BAR_DAYS))


def _buckets(first: date, last: date, step: int) -> list[tuple[date, date]]:
    """The spans of ``step`` days from ``first`` a chart draws a bar for; the last may be
    shorter."""
    found, start = [], first
    while start <= last:
        end = min(start + timedelta(days=step - 1), last)
        found.append((start, end))
        start = end + timedelta(days=1)
    return found


def _ranked(totals: Mapping[str, Totals]) -> list[str]:
    """Names by tokens, most first (then by requests, then by name)."""
    return sorted(totals, key=lambda n: (-totals[n].tokens, -totals[n].requests, n))


def per_model(records: Iterable[UsageRecord]) -> list[Row]:
    models: dict[str, Totals] = {}
    for r in records:
        models.setdefault(r.model, Totals()).add(r)
    return [Row(name, models[name]) for name in _ranked(models)]


def day_chart(records: list[UsageRecord], first: date, last: date, what: str) -> DayChart:
    """Tokens from ``first`` to ``last``, a bar a day (a week, two weeks: see
    ``bar_days``), one series per model: the TOP_MODELS biggest named, the others added
    up."""
    models = per_model(records)
    named = [m.label for m in models[:TOP_MODELS]]
    series = [cut(name, SERIES_NAME_MAX) for name in named]
    if len(models) > TOP_MODELS:
        series.append(OTHER_MODELS)
    where = {name: i for i, name in enumerate(named)}
    step = bar_days(first, last)
    buckets = _buckets(first, last, step)
    index = {}
    for i, (start, end) in enumerate(buckets):
        for n in range((end - start).days + 1):
            index[start + timedelta(days=n)] = i
    values = [[0] * len(series) for _ in buckets]
    rows = [Row(_bucket_words(start, end)) for start, end in buckets]
    for r in records:
        i = index.get(r.day)
        if i is None:
            continue
        values[i][where.get(r.model, len(series) - 1)] += r.total_tokens
        rows[i].totals.add(r)
    every = max(1, -(-len(buckets) // 8))  # about eight labels on the axis
    columns = [Column(start.strftime("%m-%d") if i % every == 0 else "", values[i],
                      title=rows[i].label)
               for i, (start, _) in enumerate(buckets)]
    return DayChart(stacked_bars(columns, series, what), series, rows, step)


def _bucket_words(start: date, end: date) -> str:
    return start.isoformat() if start == end else f"{start} to {end}"


def per_key(records: Iterable[UsageRecord], keys: Mapping[int, ApiKeyRecord],
            names: Mapping[int, str]) -> list[Row]:
    totals: dict[int, Totals] = {}
    for r in records:
        totals.setdefault(r.key_id, Totals()).add(r)
    ranked = sorted(totals, key=lambda k: (-totals[k].tokens, -totals[k].requests, k))
    rows = []
    for key_id in ranked:
        key = keys.get(key_id)
        rows.append(Row(key.name if key else f"key #{key_id}", totals[key_id],
                        prefix=key.prefix if key else "", owner=_owner(key, names)))
    return rows


def _owner(key: ApiKeyRecord | None, names: Mapping[int, str]) -> str:
    if key is None or key.account_id is None:
        return ""  # made with the admin token (llmgw up, ctl with the token)
    return names.get(key.account_id, f"account #{key.account_id}")


@dataclass(slots=True)
class UsageView:
    """What the usage page shows of a period."""

    total: Totals
    chart: DayChart
    models: list[Row]
    keys: list[Row]  # the TOP_KEYS_TABLE that used the most
    keys_used: int  # keys with usage in the period
    keys_seen: int  # keys the viewer sees, used or not
    key_chart: Markup
    keys_charted: int
    models_left_out: int = 0
    bars_max: int = BARS_MAX

    @property
    def keys_left_out(self) -> int:
        return self.keys_used - len(self.keys)


def usage_view(keys: list[ApiKeyRecord], names: Mapping[int, str],
               records: list[UsageRecord], first: date, last: date,
               by_key: list[UsageRecord] | None = None) -> UsageView:
    """What the usage page shows of ``records`` (of ``keys``, by day and model at least),
    from ``first`` to ``last``; ``by_key``: the same summed per key, where ``records``
    do not say the key."""
    by_id = {k.id: k for k in keys if k.id is not None}
    total = Totals()
    for r in records:
        total.add(r)
    keys_rows = per_key(records if by_key is None else by_key, by_id, names)
    models = per_model(records)
    top = keys_rows[:TOP_KEYS_CHART]
    key_chart = stacked_bars(
        [Column(cut(row.label, max(3, int(640 / max(1, len(top)) / 6.5))),
                (row.totals.tokens,),
                title=f"{row.label} ({row.prefix})" if row.prefix else row.label)
         for row in top], ["tokens"], "tokens per key, most first")
    return UsageView(
        total=total, chart=day_chart(records, first, last, "tokens per day, by model"),
        models=models[:TOP_MODELS_TABLE], models_left_out=max(0, len(models) - TOP_MODELS_TABLE),
        keys=keys_rows[:TOP_KEYS_TABLE],
        keys_used=len(keys_rows), keys_seen=len(keys), key_chart=key_chart,
        keys_charted=len(top))


def cut(text: str, room: int) -> str:
    """``text`` cut to ``room`` characters (a bar's label: about 6.5 px a character)."""
    return text if len(text) <= room else text[:room - 1] + "…"


async def visible_usage(store: Store, principal: Principal, first: date, last: date,
                        by: tuple[str, ...] = ("day", "model")
                        ) -> tuple[list[ApiKeyRecord], list[UsageRecord]]:
    """The keys ``principal`` sees (their own; an admin every key) and those keys' usage
    from ``first`` to ``last``, summed by the store over what ``by`` leaves out."""
    keys = await visible_keys(store, principal)
    return keys, await store.sum_usage(by, since=first, until=last,
                                       key_ids=_ids(principal, keys))


def _ids(principal: Principal, keys: list[ApiKeyRecord]) -> list[int] | None:
    """The keys whose usage ``principal`` sees; None for every key (an admin)."""
    return None if principal.is_admin else [k.id for k in keys if k.id is not None]


def _today() -> date:
    return datetime.now(UTC).date()


def period_of(request: Request) -> tuple[date, date]:
    """The period the query asks for: ``since``/``until`` (UTC dates, both included), or
    ``days`` up to today, or the last DEFAULT_DAYS days."""
    query = request.query_params
    today = _today()
    since, until = query.get("since") or None, query.get("until") or None
    days = query.get("days") or None
    if days is not None and since is None and until is None:
        if not (days.isascii() and days.isdigit()) or not 1 <= int(days) <= MAX_DAYS:
            raise ApiError(400, f"days must be a whole number from 1 to {MAX_DAYS}, not "
                           f"{days!r}", param="days", code="invalid_value")
        return today - timedelta(days=int(days) - 1), today
    return usage_period(since, until, today, days=DEFAULT_DAYS, max_days=MAX_DAYS)


@get(f"{PREFIX}/usage", include_in_schema=False)
async def usage_page(request: Request) -> Template:
    page = await open_page(request)
    assert page.viewer is not None
    today = _today()
    presets = [(n, f"?days={n}") for n in PRESETS]
    try:
        first, last = period_of(request)
    except ApiError as err:
        query = request.query_params
        return page.render("usage.html", status_code=400, title="Usage", problem=err.message,
                           since=query.get("since", ""), until=query.get("until", ""),
                           presets=presets, view=None, today=today.isoformat(),
                           max_days=MAX_DAYS, days=0)
    store = request.app.state.store
    keys, records = await visible_usage(store, page.viewer, first, last)
    by_key = await store.sum_usage(("key_id",), since=first, until=last,
                                   key_ids=_ids(page.viewer, keys))
    names = await owner_names(store) if page.is_admin else {}
    return page.render(
        "usage.html", title="Usage", problem="", since=first.isoformat(),
        until=last.isoformat(), presets=presets, today=today.isoformat(), max_days=MAX_DAYS,
        days=(last - first).days + 1,
        view=usage_view(keys, names, records, first, last, by_key))


CSV_COLUMNS = ("day", "key", "owner", "model", "requests", "prompt_tokens",
               "completion_tokens")
# Rows formatted between two turns of the event loop (about 7 ms of CPU).
CSV_ROWS_PER_CHUNK = 1000


def _cell(text: str) -> str:
    """Text a spreadsheet would read as a formula (a key named ``=HYPERLINK(…)``) is
    written with a leading apostrophe, which spreadsheets show as text."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def usage_csv_chunks(keys: list[ApiKeyRecord], names: Mapping[int, str],
                     records: Iterable[UsageRecord]) -> Iterator[str]:
    """The CSV, the header first, in pieces of CSV_ROWS_PER_CHUNK rows."""
    by_id = {k.id: k for k in keys if k.id is not None}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for i, r in enumerate(records, 1):
        key = by_id.get(r.key_id)
        writer.writerow((r.day.isoformat(), _cell(key_label(key, r.key_id)),
                         _cell(_owner(key, names)), _cell(r.model), r.requests,
                         r.prompt_tokens, r.completion_tokens))
        if i % CSV_ROWS_PER_CHUNK == 0:
            yield out.getvalue()
            out.seek(0)
            out.truncate()
    yield out.getvalue()


async def _sent_in_turns(chunks: Iterator[str]) -> AsyncIterator[bytes]:
    """Each piece, then the event loop to other requests: a year of a large cluster's
    usage is tens of thousands of rows (0.46 s of formatting for 67,500)."""
    for chunk in chunks:
        yield chunk.encode()
        await asyncio.sleep(0)


@get(f"{PREFIX}/usage.csv", include_in_schema=False)
async def usage_csv(request: Request) -> Response:
    page = await open_page(request)
    assert page.viewer is not None
    first, last = period_of(request)
    store = request.app.state.store
    keys, records = await visible_usage(store, page.viewer, first, last,
                                        by=("day", "key_id", "model"))
    names = await owner_names(store)
    return Stream(
        _sent_in_turns(usage_csv_chunks(keys, names, records)),
        media_type="text/csv; charset=utf-8",
        headers={"content-disposition":
                 f"attachment; filename=llmgw-usage-{first}-{last}.csv",
                 "cache-control": "no-store"})


ROUTES: list = [usage_page, usage_csv]
