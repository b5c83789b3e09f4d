"""Token usage and per-key limits, decided without I/O.

Two halves:

- Reading what an engine says it used: `usage_from_body` for an answer read whole,
  `StreamUsage` for a stream relayed chunk by chunk. The stream reader keeps the stream's
  tail (from `MAX_LINE_BYTES` and a little more to twice that, and what came since it was
  last cut: `SETTLE_BYTES` and a read), so a long stream costs a bounded amount of
  memory, and reads the usage from its last lines once it is over; a line longer than
  `MAX_LINE_BYTES` is skipped (an answer's final usage chunk is a few hundred bytes).
- Judging a key's limits: the store counts requests and tokens in fixed UTC windows (a
  minute, a day, a month) and hands the counts here; `judge` says whether the request
  may go on, and if not, which limit refused it and for how long (`Refusal`). Tokens are
  known only once an answer is done, so a token limit refuses the *next* request after
  the one that used the budget up.

Counts are per window start, so every server sharing the store sees the same numbers;
the windows are fixed, not sliding: a key can use its whole per-minute budget at the end
of one minute and again at the start of the next.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import msgspec

# --- limits ----------------------------------------------------------------------------

MAX_LIMIT = 10**15
PERIODS = ("minute", "day", "month")
LIMIT_NAMES = ("rpm", "tpm", "tokens_per_day", "tokens_per_month")
UNKNOWN_MODEL = "unknown"


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits; None is unlimited. Windows are fixed and in UTC."""

    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (prompt + completion) per minute
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            check_limit(f.name, getattr(self, f.name))

    @property
    def any(self) -> bool:
        # Spelt out: the gateway asks once per request.
        return (self.rpm is not None or self.tpm is not None
                or self.tokens_per_day is not None or self.tokens_per_month is not None)

    def as_dict(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in LIMIT_NAMES}


def check_limit(name: str, value: Any) -> None:
    """Raise ValueError, in words for the operator, unless `value` can be limit `name`."""
    if name not in LIMIT_NAMES:
        raise ValueError(f"{name!r} is not a limit; the limits are {', '.join(LIMIT_NAMES)}")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise ValueError(
            f"{name} must be a whole number from 1 to {MAX_LIMIT:,}, or none for no limit "
            f"(not {value!r}); to stop a key altogether, revoke it"
        )


@dataclass(frozen=True, slots=True)
class Counts:
    """What a key has used in the windows that hold a moment.

    `requests_this_minute` counts every request admitted or refused this minute (the one
    being judged included); tokens are those recorded by `record_usage`.
    """

    requests_this_minute: int = 0
    tokens_this_minute: int = 0
    tokens_today: int = 0
    tokens_this_month: int = 0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was refused: which limit, its value, and when it frees up."""

    limit: str  # one of LIMIT_NAMES
    value: int
    used: int
    retry_after_s: int  # whole seconds until the window ends, at least 1

    @property
    def message(self) -> str:
        what = _LIMIT_WORDS[self.limit]
        return (f"this key's limit of {self.value:,} {what} is used up; "
                f"try again in {duration_words(self.retry_after_s)}")

    @property
    def code(self) -> str:
        """``rate_limit_exceeded`` (per minute) or ``quota_exceeded`` (per day, month)."""
        return "rate_limit_exceeded" if self.limit in ("rpm", "tpm") else "quota_exceeded"


_LIMIT_WORDS = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "tokens_per_day": "tokens per day (UTC)",
    "tokens_per_month": "tokens per month (UTC)",
}
LIMIT_PERIOD = {"rpm": "minute", "tpm": "minute", "tokens_per_day": "day",
                "tokens_per_month": "month"}


def utc(now: datetime) -> datetime:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(f"naive datetime {now.isoformat()}: pass an aware UTC datetime")
    return now.astimezone(UTC)


def window_start(period: str, now: datetime) -> datetime:
    """The start of the `period` window ("minute", "day", "month") that holds `now`."""
    now = utc(now)
    if period == "minute":
        return now.replace(second=0, microsecond=0)
    if period == "day":
        return now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "month":
        return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    raise ValueError(f"no window {period!r}; the windows are {', '.join(PERIODS)}")


def window_end(period: str, now: datetime) -> datetime:
    """The end of the `period` window that holds `now` (the next one's start)."""
    start = window_start(period, now)
    if period == "minute":
        return start + timedelta(minutes=1)
    if period == "day":
        return start + timedelta(days=1)
    return (start + timedelta(days=32)).replace(day=1)


def seconds_left(period: str, now: datetime) -> int:
    """Whole seconds until the window ends, rounded up, at least 1."""
    return max(1, math.ceil((window_end(period, now) - utc(now)).total_seconds()))


def used(limit: str, counts: Counts) -> int:
    """What counts against `limit`."""
    return {
        "rpm": counts.requests_this_minute,
        "tpm": counts.tokens_this_minute,
        "tokens_per_day": counts.tokens_today,
        "tokens_per_month": counts.tokens_this_month,
    }[limit]


def judge(limits: Limits, counts: Counts, now: datetime) -> Refusal | None:
    """None if the request may go on, else the refusal that frees up last.

    `counts.requests_this_minute` includes this request: the rpm-th request of a minute
    passes, the next is refused. A token limit refuses once the tokens already used reach
    it: the request that crossed it was let through, tokens being known only afterwards.
    """
    refusals = []
    for name in LIMIT_NAMES:
        value = getattr(limits, name)
        if value is None:
            continue
        n = used(name, counts)
        over = n > value if name == "rpm" else n >= value
        if over:
            refusals.append(Refusal(name, value, n, seconds_left(LIMIT_PERIOD[name], now)))
    return max(refusals, key=lambda r: r.retry_after_s, default=None)


def duration_words(seconds: int) -> str:
    """12 s, 4 min 10 s, 5 h 3 min, 3 d 4 h: two units at most, the last rounded up, so
    that a client told to wait is never told too early."""
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        minutes, s = divmod(seconds, 60)
        return f"{minutes} min {s} s" if s else f"{minutes} min"
    if seconds < 86400:
        hours, m = divmod(math.ceil(seconds / 60), 60)
        return f"{hours} h {m} min" if m else f"{hours} h"
    days, h = divmod(math.ceil(seconds / 3600), 24)
    return f"{days} d {h} h" if h else f"{days} d"


def metric_model(name: str | None, catalog_names: Collection[str]) -> str:
    """The model label for a metric: a declared model's name, else "unknown", so that
    clients cannot grow a metric's label set with made-up names."""
    return name if name is not None and name in catalog_names else UNKNOWN_MODEL


# --- reading usage ---------------------------------------------------------------------

MAX_LINE_BYTES = 64 * 1024
_MAX_TOKENS = 2**53


class Usage(NamedTuple):
    """Tokens one answer used, as the engine reported them. (A tuple: made for every
    answer, and a frozen dataclass's ``__init__`` costs three times the bytecodes.)"""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class _Doc(msgspec.Struct):
    """The only parts of an answer (or a stream event) read: its usage, and the usage
    inside `response` as the Responses API's final event carries it."""

    usage: Any = None
    response: Any = None


class _NamedDoc(_Doc):
    """The same and the model that answered, for a request's span or log line."""

    model: Any = None


_decoder = msgspec.json.Decoder(_Doc)
_named_decoder = msgspec.json.Decoder(_NamedDoc)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_TOKENS:
        return None
    return value


def usage_of(usage: Any) -> Usage | None:
    """A `usage` object as engines write it, or None when it is missing or garbled.

    Chat and completions: prompt_tokens, completion_tokens (total_tokens is their sum).
    Embeddings: prompt_tokens and total_tokens only. Responses API: input_tokens and
    output_tokens.
    """
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion_given = usage.get("completion_tokens", usage.get("output_tokens"))
    if (type(prompt) is int and type(completion_given) is int  # not a bool, either
            and 0 <= prompt <= _MAX_TOKENS and 0 <= completion_given <= _MAX_TOKENS):
        return Usage(prompt, completion_given)  # as nearly every answer has it
    prompt = _count(prompt)
    completion = _count(completion_given)
    total = _count(usage.get("total_tokens"))
    if prompt is None:
        return None
    if completion is None:
        if completion_given is not None or total is None or total < prompt:
            return None
        completion = total - prompt
    return Usage(prompt, completion)


def _from_doc(raw: bytes | bytearray) -> Usage | None:
    try:
        doc = _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    found = usage_of(doc.usage)
    if found is None and isinstance(doc.response, dict):
        found = usage_of(doc.response.get("usage"))
    return found


def _from_named_doc(raw: bytes | bytearray) -> tuple[Usage | None, str | None]:
    """The usage in a JSON document, and the model it names (a string, else None)."""
    try:
        doc = _named_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    found = usage_of(doc.usage)
    model = doc.model
    if found is None and isinstance(doc.response, dict):
        found = usage_of(doc.response.get("usage"))
        model = doc.response.get("model")
    return found, model if type(model) is str else None


def usage_from_body(body: bytes) -> Usage | None:
    """The usage in an answer read whole (a JSON object), or None."""
    return _from_doc(body)


def answer_of(body: bytes) -> tuple[Usage | None, str | None]:
    """The usage in an answer read whole, and the model the answer names (each None when
    absent): one decode for both."""
    return _from_named_doc(body)


_USAGE = b'"usage"'
# An event's line, and after a line end (the stream's first has none before it; a CRLF's
# LF is the one counted).
_FIRST_EVENT = b"data:"
_EVENT_LF = b"\n" + _FIRST_EVENT
_EVENT_CR = b"\r" + _FIRST_EVENT
# What may follow the usage line and still be found: `data: [DONE]` and the like.
AFTER_USAGE_BYTES = 4096
# What a relay hands to `StreamUsage.pending` before it calls `settle`: with the buffer's
# limit, what a stream's usage reading holds at most (and one read more).
SETTLE_BYTES = 64 * 1024
# Lines looked at from the end of a stream for the usage, blank and `event:` lines included.
TAIL_LINES = 16


class StreamUsage:
    """Finds the usage an engine reported in a server-sent event stream, fed as relayed,
    split anywhere; and counts the stream's events.

    Engines report it in the stream's last lines: in the last event before `data: [DONE]`
    (OpenAI's ``stream_options.include_usage``; llama.cpp's server, vLLM and SGLang when
    asked), as running totals in every event (vLLM's continuous usage stats), or in the
    Responses API's closing event. So nothing is read while the stream runs: the stream's
    bytes go to one buffer, cut back to its last ``max_line + AFTER_USAGE_BYTES`` bytes
    once it is twice that, and `end` looks in the last `TAIL_LINES` lines of it, newest
    first: the first ``data:`` line that mentions ``"usage"`` and holds a usage wins. A
    line longer than `max_line` is skipped. (OpenAI's own streams, asked for usage, name
    ``"usage": null`` in every event: read per chunk, each was a JSON document decoded.)

    Two ways in: `feed`, which takes the chunks into the buffer once half of
    `SETTLE_BYTES` of them wait (so that a relay that feeds it every half of that, as
    `direct.Exchange` does, holds no more than `SETTLE_BYTES` and a read); or, for a
    relay that hands on every read of a stream, the list `pending`, extended with each
    read's chunks (a list's ``extend``: no Python call per read) and taken into the buffer
    by `settle`, which the relay calls once at least `SETTLE_BYTES` came since the last
    time. Either way the memory a stream holds stays bounded, and a short stream is copied
    once, at its end. `events`, `end` and `counted` settle first.
    """

    __slots__ = ("_bound", "_cut", "_events", "_fed", "_limit", "_max_line", "_tail",
                 "model", "pending")

    # What transport.writer.ChunkTap asks: how often the relay settles what it handed on.
    settle_bytes = SETTLE_BYTES

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._max_line = max_line
        self._bound = max_line + AFTER_USAGE_BYTES
        self._limit = 2 * self._bound
        self._tail: bytes | bytearray = b""
        self._cut = False  # the front of the stream was dropped from `tail`
        self._events = 0  # events in what was dropped
        self.pending: list[bytes] = []  # the stream's chunks not yet settled, in order
        self._fed = 0  # bytes `feed` put in `pending` since it was last settled
        # The model named in the event that held the usage, once `end` found one.
        self.model: str | None = None

    def feed(self, chunks: list[bytes]) -> None:
        """The stream's next chunks, in order (a list: what one read brought)."""
        self.pending += chunks
        self._fed += sum(map(len, chunks))
        if self._fed >= SETTLE_BYTES // 2:
            self.settle()

    def settle(self) -> None:
        """Take the chunks in `pending` into the buffer, in one copy. Into an empty buffer
        they go as they are: a stream under `SETTLE_BYTES` is copied once, at its end."""
        pending = self.pending
        if not pending:
            return
        data = b"".join(pending)  # one bytes: no copy of a lone bytes, none kept of a caller's
        pending.clear()
        self._fed = 0
        tail = self._tail
        if not tail:
            self._tail = tail = data
        else:
            if type(tail) is bytes:
                self._tail = tail = bytearray(tail)  # from now on grown in place
            tail += data
        if len(tail) > self._limit:
            self._trim()

    def _trim(self) -> None:
        # The front of the tail dropped, down to its last `_bound` bytes; the events in
        # it counted.
        tail = self._tail
        cut = len(tail) - self._bound
        if cut <= 0:
            return
        if type(tail) is bytes:
            self._tail = tail = bytearray(tail)
        # At the last line end before that, which is kept: an event's line end and
        # ``data:`` are then dropped or kept together. Not if that keeps too much (a long
        # line): no line ends between there and ``cut``, so no event begins there either.
        end = max(tail.rfind(b"\n", 0, cut + 1), tail.rfind(b"\r", 0, cut + 1))
        if end >= 0 and len(tail) - end <= self._limit:
            cut = end
            if cut == 0:
                return  # nothing before it to drop
        self._events += _events_in(tail, 0, cut)
        if not self._cut:
            self._cut = True
            self._events += tail.startswith(_FIRST_EVENT)
        del tail[:cut]

    def events(self) -> int:
        """The ``data:`` lines the stream has had (an event is one, as engines write them)."""
        self.settle()
        tail = self._tail
        return (self._events + _events_in(tail, 0, len(tail))
                + (not self._cut and tail.startswith(_FIRST_EVENT)))

    def end(self) -> Usage | None:
        """The stream is over (a last line without a newline counts); the usage the engine
        reported, or None."""
        # Found by its key, then judged by its line: this runs at the end of every stream,
        # most of which hold no usage at all. Lines end with LF, CRLF or a lone CR.
        self.settle()
        data = self._tail
        at = data.rfind(_USAGE)
        while at >= 0:
            end = _line_end(data, at)
            if max(data.count(b"\n", end), data.count(b"\r", end)) >= TAIL_LINES:
                return None  # not among the last lines
            start = _line_start(data, at)
            if start or not self._cut:  # the first line of a cut tail is not whole
                line = data[start:end]
                if len(line) <= self._max_line and line.startswith(_FIRST_EVENT):
                    found, model = _from_named_doc(line[5:])
                    if found is not None:
                        self.model = model
                        return found
            at = data.rfind(_USAGE, 0, start)
        return None

    def counted(self) -> Usage | None:
        """The stream is over: what it counts as. The usage the engine reported; failing
        that, one completion token for each event it sent (engines stream about a token
        an event, and two or three more events of framing) and no prompt tokens. So a
        stream of an engine that reports usage only when asked (llama.cpp, vLLM, SGLang),
        and one cut short before its usage came (the client left, the engine broke off),
        still count what they sent: a client cannot get round a token limit by leaving
        just before the end. None for a stream that sent no event."""
        return self.both()[0]

    def both(self) -> tuple[Usage | None, Usage | None]:
        """The stream is over: what it counts as (``counted``), and the usage the engine
        reported (``end``), found once for both."""
        found = self.end()
        if found is None:
            events = self.events()
            return (Usage(0, events) if events else None), None
        return found, found


def _events_in(data: bytes | bytearray, start: int, end: int) -> int:
    """The ``data:`` lines that begin after a line end in ``data[start:end]``. A lone CR
    ends a line too, but is looked for only where there is one: most streams have none,
    and each count is a scan of the whole tail (a few µs at every stream's end)."""
    events = data.count(_EVENT_LF, start, end)
    if data.find(b"\r", start, end) >= 0:
        events += data.count(_EVENT_CR, start, end)
    return events


def _line_end(data: bytes | bytearray, at: int) -> int:
    """Where the line holding ``data[at]`` ends: at its LF or CR, or the end of ``data``."""
    lf = data.find(b"\n", at)
    if lf < 0:
        lf = len(data)
    cr = data.find(b"\r", at, lf)  # only up to the LF: most streams have no CR at all
    return lf if cr < 0 else cr


def _line_start(data: bytes | bytearray, at: int) -> int:
    """Where the line holding ``data[at]`` begins."""
    lf = data.rfind(b"\n", 0, at) + 1
    return max(lf, data.rfind(b"\r", lf, at) + 1)
