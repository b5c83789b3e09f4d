"""The Keys and Usage pages stay small whatever the store holds, and their CSV cannot
carry a spreadsheet formula: the views and templates rendered over a busy cluster's
numbers, without a server."""

from __future__ import annotations

import csv
import io
from datetime import UTC, date, datetime, timedelta

from llmgw.core.catalog import Model, Name
from llmgw.core.usage import Limits
from llmgw.server.auth.sessions import Principal
from llmgw.server.ui import template_config
from llmgw.server.ui.keys import (
    EMPTY_FORM,
    LIMIT_LABELS,
    LIST_MODELS,
    MAX_KEYS_SHOWN,
    key_row,
    read_limits,
)
from llmgw.server.ui.usage import (
    BARS_MAX,
    CSV_COLUMNS,
    CSV_ROWS_PER_CHUNK,
    MAX_DAYS,
    OTHER_MODELS,
    SERIES_NAME_MAX,
    TOP_KEYS_TABLE,
    TOP_MODELS,
    TOP_MODELS_TABLE,
    bar_days,
    day_chart,
    per_model,
    usage_csv_chunks,
    usage_view,
)
from llmgw.store import ApiKeyRecord, UsageRecord

PAGE_MAX = 100_000
LAST = date(2026, 3, 31)
ADMIN = Principal(1, "root", "admin", "session")
# As long as model names may be (128 characters), and more than a table shows.
MODELS = [f"{i:02d}-{'m' * 125}" for i in range(TOP_MODELS_TABLE + 5)]


def keys(count: int) -> list[ApiKeyRecord]:
    made = datetime(2026, 1, 1, tzinfo=UTC)
    return [ApiKeyRecord(id=i, prefix=f"llmgw_{i:012d}", secret_hash="0" * 64,
                         name=f"a key with a long name, number {i}", created_at=made,
                         account_id=2, allowed_models=MODELS[:3],
                         limits=Limits(rpm=600, tpm=100_000, tokens_per_day=10**9,
                                       tokens_per_month=10**11))
            for i in range(1, count + 1)]


def busy(days: int, key_ids: range) -> list[UsageRecord]:
    """Every model used every day by the first keys, and each key once."""
    first = LAST - timedelta(days=days - 1)
    records = [UsageRecord(key_id=k, model=m, day=first + timedelta(days=d), requests=12_345,
                           prompt_tokens=9_876_543, completion_tokens=1_234_567)
               for d in range(days) for m in MODELS for k in key_ids[:3]]
    records += [UsageRecord(key_id=k, model=MODELS[0], day=LAST, requests=1, prompt_tokens=1,
                            completion_tokens=1) for k in key_ids[3:]]
    return records


def render(template: str, **context) -> str:
    env = template_config().instance.engine
    return env.get_template(template).render(
        viewer=ADMIN, csrf="x" * 64, csrf_field="csrf", flash="", path="/ui/usage", **context)


def test_the_usage_page_stays_small_over_the_longest_and_the_busiest_period() -> None:
    many = keys(400)
    for days, per in ((MAX_DAYS, 14), (BARS_MAX * 7, 7), (BARS_MAX, 1)):
        first = LAST - timedelta(days=days - 1)
        view = usage_view(many, {2: "alice"}, busy(days, range(1, 401)), first, LAST)
        page = render("usage.html", title="Usage", problem="", since=first.isoformat(),
                      until=LAST.isoformat(), presets=[(7, "?days=7")], today="2026-03-31",
                      max_days=MAX_DAYS, days=days, view=view)
        assert len(page.encode()) < PAGE_MAX * 0.8, (days, len(page.encode()))
        assert view.chart.bar_days == per and len(view.chart.rows) <= BARS_MAX
        assert len(view.keys) == TOP_KEYS_TABLE and view.keys_left_out == 400 - TOP_KEYS_TABLE
        assert f"And {400 - TOP_KEYS_TABLE} more keys" in page
        assert f"And {len(MODELS) - TOP_MODELS_TABLE} more models" in page
        # The chart names the biggest models (cut short) and adds up the rest; the tables
        # name them whole.
        assert len(view.chart.series) == TOP_MODELS + 1
        assert view.chart.series[-1] == OTHER_MODELS
        assert view.chart.series[0] == MODELS[0][:SERIES_NAME_MAX - 1] + "…"
        assert view.models[0].label == MODELS[0] and MODELS[0] in page


def test_a_bar_stands_for_the_fewest_days_that_fit() -> None:
    assert [bar_days(LAST - timedelta(days=n - 1), LAST)
            for n in (1, BARS_MAX, BARS_MAX + 1, BARS_MAX * 7, BARS_MAX * 7 + 1, MAX_DAYS)
            ] == [1, 1, 7, 7, 14, 14]


def test_the_chart_puts_each_day_in_its_bar_and_counts_every_token() -> None:
    records = busy(10, range(1, 4))
    chart = day_chart(records, LAST - timedelta(days=9), LAST, "tokens")
    assert chart.rows[0].label == (LAST - timedelta(days=9)).isoformat()
    assert sum(row.totals.tokens for row in chart.rows) == sum(r.total_tokens for r in records)
    weekly = day_chart(records, LAST - timedelta(days=99), LAST, "tokens")
    assert weekly.per == "week" and len(weekly.rows) == 15
    assert weekly.rows[-1].label == f"{LAST - timedelta(days=1)} to {LAST}"
    assert sum(r.totals.requests for r in weekly.rows) == sum(r.requests for r in records)
    assert per_model([]) == []


def test_the_keys_list_stays_small_with_many_keys() -> None:
    now = datetime(2026, 3, 31, tzinfo=UTC)
    rows = [key_row(k, {2: "alice"}, now, LIST_MODELS) for k in keys(MAX_KEYS_SHOWN)]
    first = LAST - timedelta(days=29)
    records = busy(30, range(1, 4))
    page = render("keys.html", title="Keys", keys=rows, keys_total=5000,
                  keys_shown=MAX_KEYS_SHOWN, chart=day_chart(records, first, LAST, "tokens"),
                  models_used=per_model(records), usage_days=30,
                  catalog=[Name(m, Model(m, ())) for m in MODELS],
                  checkboxes=True, limit_labels=LIMIT_LABELS, problem="", problems={},
                  values=EMPTY_FORM)
    assert len(page.encode()) < PAGE_MAX * 0.8, len(page.encode())
    assert f"Showing {MAX_KEYS_SHOWN} of 5000 keys" in page
    assert "600 requests/min, 100,000 tokens/min" in page


def test_the_csv_has_every_row_and_no_formula() -> None:
    tricky = ApiKeyRecord(id=1, prefix="llmgw_abc", secret_hash="0" * 64,
                          name='=HYPERLINK("http://evil")', created_at=datetime.now(UTC),
                          account_id=None)
    records = [UsageRecord(key_id=1, model="@sum", day=LAST, requests=2, prompt_tokens=3,
                           completion_tokens=4),
               UsageRecord(key_id=9, model="m", day=LAST, requests=1, prompt_tokens=0,
                           completion_tokens=0)]
    rows = list(csv.reader(io.StringIO("".join(usage_csv_chunks([tricky], {}, records)))))
    assert rows == [list(CSV_COLUMNS),
                    [LAST.isoformat(), "'=HYPERLINK(\"http://evil\") (llmgw_abc)", "", "'@sum",
                     "2", "3", "4"],
                    [LAST.isoformat(), "key #9", "", "m", "1", "0", "0"]]


def test_limits_are_read_as_people_write_them() -> None:
    limits, problems = read_limits({"rpm": " 60 ", "tpm": "", "tokens_per_day": "1,000,000",
                                    "tokens_per_month": "1 000 000 000"})
    assert problems == {}
    assert limits == {"rpm": 60, "tpm": None, "tokens_per_day": 1_000_000,
                      "tokens_per_month": 1_000_000_000}
    _, problems = read_limits({"rpm": "0", "tpm": "lots", "tokens_per_day": "-5",
                               "tokens_per_month": "²"})
    assert set(problems) == {"rpm", "tpm", "tokens_per_day", "tokens_per_month"}
    assert problems["tpm"].startswith("Tokens per minute must be a whole number from 1 to")
    assert "leave it empty for no limit" in problems["rpm"]


def test_a_long_csv_comes_in_pieces_that_join_to_every_row() -> None:
    records = [UsageRecord(key_id=9, model=f"m{i}", day=LAST, requests=i, prompt_tokens=0,
                           completion_tokens=0) for i in range(2 * CSV_ROWS_PER_CHUNK + 5)]
    chunks = list(usage_csv_chunks([], {}, records))
    assert len(chunks) == 3
    rows = list(csv.reader(io.StringIO("".join(chunks))))
    assert rows[0] == list(CSV_COLUMNS) and len(rows) == len(records) + 1
    assert [int(r[4]) for r in rows[1:]] == list(range(len(records)))
