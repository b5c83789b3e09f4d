"""core.usage: reading usage from answers and streams, and judging a key's limits."""

from __future__ import annotations

import itertools
import json
import random
from datetime import UTC, datetime, timedelta, timezone

import pytest

from llmgw.core.usage import (
    AFTER_USAGE_BYTES,
    MAX_LINE_BYTES,
    SETTLE_BYTES,
    TAIL_LINES,
    Counts,
    Limits,
    Refusal,
    StreamUsage,
    Usage,
    duration_words,
    judge,
    metric_model,
    usage_from_body,
    window_end,
    window_start,
)

T = datetime(2025, 3, 31, 23, 59, 48, 250000, tzinfo=UTC)


# --- answers read whole ----------------------------------------------------------------


def test_chat_completion_body() -> None:
    body = json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42},
    }).encode()
    got = usage_from_body(body)
    assert got == Usage(12, 30)
    assert got.total_tokens == 42


def test_embeddings_body_has_no_completion_tokens() -> None:
    body = b'{"object":"list","data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}'
    assert usage_from_body(body) == Usage(8, 0)


def test_responses_api_body() -> None:
    body = b'{"object":"response","usage":{"input_tokens":5,"output_tokens":7,"total_tokens":12}}'
    assert usage_from_body(body) == Usage(5, 7)


@pytest.mark.parametrize("body", [
    b"",
    b"not json",
    b"[1, 2]",
    b'{"choices": []}',
    b'{"usage": null}',
    b'{"usage": "12"}',
    b'{"usage": {"prompt_tokens": -1, "completion_tokens": 3}}',
    b'{"usage": {"prompt_tokens": true, "completion_tokens": 3}}',
    b'{"usage": {"prompt_tokens": 1.5, "completion_tokens": 3}}',
    b'{"usage": {"prompt_tokens": 4, "completion_tokens": "3"}}',
    b'{"usage": {"prompt_tokens": 4, "completion_tokens": false}}',
    b'{"usage": {"prompt_tokens": 4, "completion_tokens": -3}}',
    b'{"usage": {"prompt_tokens": 9007199254740993, "completion_tokens": 3}}',
    b'{"usage": {"prompt_tokens": 4, "completion_tokens": 9007199254740993}}',
    b'{"usage": {"completion_tokens": 3}}',
    b'{"usage": {"prompt_tokens": 9, "total_tokens": 4}}',
    b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2',
])
def test_no_usage_or_garbage_gives_none(body: bytes) -> None:
    assert usage_from_body(body) is None


# --- streams ---------------------------------------------------------------------------


def sse(*events: object, done: bool = True, eol: bytes = b"\n") -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + eol + eol for e in events)
    return out + (b"data: [DONE]" + eol + eol if done else b"")


def delta(text: str, usage: object = "absent") -> dict:
    event = {"object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": text}}]}
    if usage != "absent":
        event["usage"] = usage
    return event


INCLUDE_USAGE = sse(  # OpenAI with stream_options.include_usage: null until the last chunk
    delta("Hel", None), delta("lo", None),
    {"object": "chat.completion.chunk", "choices": [],
     "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}},
)
LAST_CHUNK_USAGE = sse(  # llama.cpp and vLLM: the last content chunk carries it
    delta("Hel"), delta("lo"),
    {**delta(""), "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
     "timings": {"predicted_ms": 12.5}},
)


def feed_in(stream: bytes, cuts: list[int]) -> Usage | None:
    """``stream`` cut at ``cuts``, fed a piece at a time and (every third feed) two at once,
    as one read from an engine may bring; and the same reads handed to ``pending`` and
    settled every fourth, as a relay's sink does: both find the same."""
    reader, relayed = StreamUsage(), StreamUsage()
    edges = [0, *sorted(cuts), len(stream)]
    pieces = [stream[a:b] for a, b in itertools.pairwise(edges)]
    reads = 0
    while pieces:
        take = 2 if len(pieces) % 3 == 0 else 1
        reader.feed(pieces[:take])
        relayed.pending += pieces[:take]
        reads += 1
        if reads % 4 == 0:
            relayed.settle()
        del pieces[:take]
    found = reader.end()
    assert relayed.end() == found
    return found


@pytest.mark.parametrize(("stream", "expected"), [
    (INCLUDE_USAGE, Usage(9, 2)),
    (LAST_CHUNK_USAGE, Usage(4, 2)),
])
def test_stream_usage_whole_and_split_anywhere(stream: bytes, expected: Usage) -> None:
    assert feed_in(stream, []) == expected
    for cut in range(len(stream)):  # every place one cut can fall, mid-line included
        assert feed_in(stream, [cut]) == expected, cut
    assert feed_in(stream, list(range(len(stream)))) == expected  # a byte at a time
    rng = random.Random(7)
    for _ in range(200):
        cuts = rng.sample(range(len(stream)), rng.randint(1, 12))
        assert feed_in(stream, cuts) == expected


def test_stream_with_crlf_and_no_space_after_data() -> None:
    stream = sse(delta("a"), {"choices": [], "usage": {"prompt_tokens": 3,
                                                        "completion_tokens": 1}}, eol=b"\r\n")
    assert feed_in(stream, [len(stream) // 2]) == Usage(3, 1)
    bare = b'data:{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":5}}\n\n'
    assert feed_in(bare, [3]) == Usage(2, 5)


def test_stream_last_line_without_newline_counts_at_end() -> None:
    stream = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
    reader = StreamUsage()
    reader.feed([stream])
    assert reader.end() == Usage(1, 1)


def test_the_last_usage_wins() -> None:
    # vLLM's continuous_usage_stats: running totals in every chunk.
    stream = sse(*(delta("x", {"prompt_tokens": 4, "completion_tokens": n,
                               "total_tokens": 4 + n}) for n in range(1, 6)))
    assert feed_in(stream, [17, 90]) == Usage(4, 5)


def test_responses_api_stream() -> None:
    stream = (b"event: response.output_text.delta\n"
              b'data: {"type":"response.output_text.delta","delta":"hi"}\n\n'
              b"event: response.completed\n"
              b'data: {"type":"response.completed","response":{"id":"r1",'
              b'"usage":{"input_tokens":6,"output_tokens":3,"total_tokens":9}}}\n\n')
    assert feed_in(stream, [40, 41, 120]) == Usage(6, 3)


@pytest.mark.parametrize("stream", [
    sse(delta("a"), delta("b")),  # no usage at all
    sse(delta("a", None), delta("b", None)),  # include_usage asked, never sent
    b"",
    b"\n\n\n",
    b": keep-alive comment\n\nevent: ping\n\n",
    b'data: {"usage": {"prompt_tokens": 1, "completion_tokens": \n\n',  # cut short
    b"data: \xff\xfe not utf-8 \"usage\"\n\n",
    b'data: ["usage"]\n\n',
    b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n',  # not a data line
    sse({"error": {"message": "engine died", "usage": "n/a"}}),
])
def test_streams_without_usable_usage(stream: bytes) -> None:
    assert feed_in(stream, [len(stream) // 3]) is None


def test_a_stream_counts_its_reported_usage_else_a_token_per_event() -> None:
    reported = StreamUsage()
    for chunk in (sse(delta("a")), sse(delta("b")), INCLUDE_USAGE):
        reported.feed([chunk])
    assert reported.counted() == Usage(9, 2)  # the engine's word, not the events
    silent = StreamUsage()  # no usage asked for, or cut short before it came
    for chunk in (sse(delta("a"), done=False), sse(delta("b"), done=False),
                  b'data: {"usage": {"prompt_tok'):
        silent.feed([chunk])
    assert silent.end() is None
    assert silent.counted() == Usage(0, 3)
    assert StreamUsage().counted() is None  # nothing sent, nothing counted
    assert StreamUsage().feed([b": keep-alive\n\n"]) is None


def test_overlong_line_is_skipped_and_memory_stays_bounded() -> None:
    huge = delta("x" * (MAX_LINE_BYTES + 10))
    huge["usage"] = {"prompt_tokens": 999, "completion_tokens": 999}
    final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    stream = sse(huge, final)
    reader = StreamUsage()
    peak = 0
    for start in range(0, len(stream), 1000):
        reader.feed([stream[start:start + 1000]])
        peak = max(peak, len(reader._tail))
    assert reader.end() == Usage(3, 4)  # the long line's usage was skipped, not misread
    assert peak <= 2 * (MAX_LINE_BYTES + AFTER_USAGE_BYTES)


def test_fed_chunks_wait_until_half_the_settle_bytes_came_then_go_in_at_once() -> None:
    # A short stream is copied into the buffer once, when its usage is read; a long one
    # never has half of SETTLE_BYTES waiting once a feed returns.
    short = StreamUsage()
    short.feed([sse(delta("a"), done=False)])
    short.feed([sse(delta("b"))])
    assert len(short.pending) == 2 and short.counted() == Usage(0, 3)
    assert short.pending == []
    chunk = sse(delta("c" * 900), done=False)
    long, most = StreamUsage(), 0
    for _ in range(4 * SETTLE_BYTES // len(chunk)):
        long.feed([chunk])
        most = max(most, sum(map(len, long.pending)))
    assert SETTLE_BYTES // 2 - len(chunk) <= most < SETTLE_BYTES // 2
    assert long.events() == 4 * SETTLE_BYTES // len(chunk)


def test_a_line_without_end_does_not_grow_the_tail() -> None:
    reader = StreamUsage()
    reader.feed([sse(delta("a"), done=False)])  # a line end, then none for 1 MiB
    for _ in range(256):
        reader.feed([b"y" * 4096])
        assert len(reader._tail) <= reader._limit
    assert reader.events() == 1


def test_a_long_stream_keeps_only_its_tail_and_counts_every_event() -> None:
    chunks = [sse(delta(f"t{n}"), done=False) for n in range(5000)] + [INCLUDE_USAGE]
    reader = StreamUsage()
    for chunk in chunks:
        reader.feed([chunk])
    assert len(reader._tail) <= 2 * (MAX_LINE_BYTES + AFTER_USAGE_BYTES)
    assert reader.counted() == Usage(9, 2)
    silent = StreamUsage()
    for chunk in chunks[:-1]:
        silent.feed([chunk])
    assert len(silent._tail) < sum(map(len, chunks[:-1]))  # the front was dropped
    assert silent.counted() == Usage(0, 5000)  # events dropped from the tail still count


@pytest.mark.parametrize("seed", range(5))
def test_events_are_counted_however_the_stream_is_cut(seed: int) -> None:
    """Fed in random pieces, trimmed often (a short line limit): no event is lost or
    counted twice where a trim or a piece cuts through its ``\\ndata:``; nor when the
    pieces are settled in batches."""
    rng = random.Random(seed)
    stream = b"".join(sse(delta("x" * rng.randrange(0, 40)), done=False,
                          eol=rng.choice([b"\n", b"\r\n", b"\r"])) for _ in range(3000))
    reader, relayed = StreamUsage(max_line=64), StreamUsage(max_line=64)
    at = 0
    while at < len(stream):
        pieces = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            size = rng.randrange(1, 300)
            pieces.append(stream[at:at + size])
            at += size
        reader.feed([p for p in pieces if p])
        relayed.pending += [p for p in pieces if p]
        if rng.random() < 0.2:  # settled now and then, as a relay's sink does
            relayed.settle()
            assert len(relayed._tail) <= relayed._limit
    assert len(reader._tail) <= reader._limit
    assert reader.events() == relayed.events() == 3000
    assert reader.counted() == relayed.counted() == Usage(0, 3000)


def test_a_tail_that_begins_mid_line_is_not_read_as_a_line() -> None:
    # One line, too long to be read, that ends in what looks like a usage event: once the
    # tail's front is dropped, the tail may begin right at its "data:".
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
    line = b"y" * (3 * (MAX_LINE_BYTES + AFTER_USAGE_BYTES)) + usage + b"\n\n"
    reader = StreamUsage()
    start = len(line) - len(usage) - 2
    for cut in range(0, start, 4096):
        reader.feed([line[cut:min(cut + 4096, start)]])
    reader.feed([line[start:]])
    assert len(reader._tail) < len(line)  # the front was dropped
    assert reader.end() is None


def test_usage_is_read_from_the_streams_last_lines_only() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}}
    near = sse(usage, delta("x"), delta("y"))  # some engines send events after it
    assert feed_in(near, [len(near) // 2]) == Usage(5, 6)
    # A CRLF ends one line, not two: three events after it are well within the window.
    crlf = sse(usage, delta("x"), delta("y"), delta("z"), eol=b"\r\n")
    assert feed_in(crlf, [len(crlf) // 2]) == Usage(5, 6)
    far = sse(usage, *([delta("x")] * TAIL_LINES))
    assert feed_in(far, [len(far) // 2]) is None


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_the_usage_counts_on_the_last_lines_only(eol: bytes) -> None:
    # The usage line, then ``after`` blank lines: it is among the last TAIL_LINES lines (its
    # own line end and those after it fewer than TAIL_LINES) or not taken.
    usage = b"data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 2,
                                                             "completion_tokens": 1}}).encode()
    for after in range(TAIL_LINES + 2):
        stream = sse(delta("x"), done=False, eol=eol) + usage + eol * (1 + after)
        found = feed_in(stream, [len(stream) // 3])
        assert found == (Usage(2, 1) if 1 + after < TAIL_LINES else None), after


def _usage_anywhere_in_the_last_lines(data: bytes) -> Usage | None:
    """What `StreamUsage.end` finds in an uncut tail, by its rule, looking at every
    ``"usage"`` in it from the newest: the first whose line is among the last TAIL_LINES
    (fewer than TAIL_LINES LFs, and CRs, from its line's end) and is a ``data:`` line that
    holds a usage."""
    at = data.rfind(b'"usage"')
    while at >= 0:
        ends = [i for i in (data.find(b"\n", at), data.find(b"\r", at)) if i >= 0]
        end = min(ends) if ends else len(data)
        if max(data.count(b"\n", end), data.count(b"\r", end)) >= TAIL_LINES:
            return None
        start = max(data.rfind(b"\n", 0, at), data.rfind(b"\r", 0, at)) + 1
        line = data[start:end]
        if line.startswith(b"data:"):
            found = usage_from_body(line[5:])
            if found is not None:
                return found
        at = data.rfind(b'"usage"', 0, start)
    return None


def test_the_usage_is_found_as_if_every_line_were_looked_at() -> None:
    # Over streams of every line ending, with usage lines, blank lines and lines that name
    # "usage" without holding one, at any distance from the end, `end` finds what the rule
    # says, however it looks for it.
    rng = random.Random(8)
    lines = [b'data: {"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":1}}',
             b'data: {"usage": null, "choices": []}', b"data: [DONE]", b"",
             b"event: message", b'data: {"choices":[{"delta":{"content":"usage"}}]}',
             b'{"usage":{"prompt_tokens":9,"completion_tokens":9}}']
    found_some = found_none = 0
    for n in range(3000):
        picked = [rng.choice(lines) for _ in range(rng.randrange(1, 40))]
        stream = b"".join(
            (line % n if b"%d" in line else line) + rng.choice([b"\n", b"\r\n", b"\r"])
            for line in picked)
        stream = stream[:len(stream) - rng.randrange(3)]  # a last line may lack its end
        reader = StreamUsage()
        reader.feed([stream])
        expected = _usage_anywhere_in_the_last_lines(stream)
        assert reader.end() == expected, stream
        found_some += expected is not None
        found_none += expected is None
    assert found_some > 500 and found_none > 500  # both outcomes were put to the test


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_a_long_stream_with_any_line_ending_finds_its_usage(eol: bytes) -> None:
    reader = StreamUsage()
    for n in range(3000):  # more than the tail keeps
        reader.feed([sse(delta(f"t{n}"), done=False, eol=eol)])
    reader.feed([sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3000}},
                     eol=eol)])
    assert len(reader._tail) <= reader._limit  # the front was dropped
    assert reader.counted() == Usage(7, 3000)


def test_overlong_last_line_gives_nothing() -> None:
    reader = StreamUsage(max_line=64)
    reader.feed([b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}'])
    reader.feed([b"\n\n"])
    assert reader.end() is None
    reader = StreamUsage(max_line=64)  # the line after an overlong one is read again
    reader.feed([b"data: " + b"y" * 100 + b'\ndata: {"usage":{"prompt_tokens":1,'])
    reader.feed([b'"completion_tokens":2}}\n'])
    assert reader.end() == Usage(1, 2)
    reader = StreamUsage(max_line=64)  # ended by a chunk of whole lines without a usage
    reader.feed([b"data: " + b"y" * 100])
    reader.feed([b"yyy\n\n"])
    reader.feed([b'data: {"usage":{"prompt_tokens":1,"completion_tokens":2}}\n'])
    assert reader.end() == Usage(1, 2)


# --- metric labels ---------------------------------------------------------------------


def test_metric_model_only_names_declared_models() -> None:
    catalog = {"qwen", "llama"}
    assert metric_model("qwen", catalog) == "qwen"
    assert metric_model("gpt-4o", catalog) == "unknown"
    assert metric_model("", catalog) == "unknown"
    assert metric_model(None, catalog) == "unknown"


# --- limits ----------------------------------------------------------------------------


def test_windows_are_utc_minute_day_month() -> None:
    assert window_start("minute", T) == datetime(2025, 3, 31, 23, 59, tzinfo=UTC)
    assert window_start("day", T) == datetime(2025, 3, 31, tzinfo=UTC)
    assert window_start("month", T) == datetime(2025, 3, 1, tzinfo=UTC)
    assert window_end("minute", T) == datetime(2025, 4, 1, 0, 0, tzinfo=UTC)
    assert window_end("day", T) == datetime(2025, 4, 1, tzinfo=UTC)
    assert window_end("month", T) == datetime(2025, 4, 1, tzinfo=UTC)
    assert window_end("month", datetime(2025, 12, 15, tzinfo=UTC)) == datetime(
        2026, 1, 1, tzinfo=UTC)
    assert window_end("month", datetime(2024, 2, 29, 12, tzinfo=UTC)) == datetime(
        2024, 3, 1, tzinfo=UTC)
    # Another zone is the same moment: 01:30 at +02:00 is still March 31st in UTC.
    local = datetime(2025, 4, 1, 1, 30, tzinfo=timezone(timedelta(hours=2)))
    assert window_start("day", local) == datetime(2025, 3, 31, tzinfo=UTC)
    with pytest.raises(ValueError, match="naive datetime"):
        window_start("day", datetime(2025, 3, 1))
    with pytest.raises(ValueError, match="no window 'week'"):
        window_start("week", T)


def test_rpm_passes_the_limit_th_request_and_refuses_the_next() -> None:
    limits = Limits(rpm=60)
    assert judge(limits, Counts(requests_this_minute=60), T) is None
    refused = judge(limits, Counts(requests_this_minute=61), T)
    assert refused == Refusal("rpm", 60, 61, 12)  # 11.75 s left, rounded up
    assert refused.message == (
        "this key's limit of 60 requests per minute is used up; try again in 12 s")
    assert refused.code == "rate_limit_exceeded"


def test_token_limits_refuse_once_used_up() -> None:
    limits = Limits(tpm=1000, tokens_per_day=50_000, tokens_per_month=1_000_000)
    assert judge(limits, Counts(tokens_this_minute=999, tokens_today=49_999,
                                tokens_this_month=999_999), T) is None
    assert judge(limits, Counts(tokens_this_minute=1000), T).limit == "tpm"
    day = judge(limits, Counts(tokens_today=50_000, tokens_this_month=50_000),
                T - timedelta(hours=5))
    assert day.limit == "tokens_per_day" and day.retry_after_s == 5 * 3600 + 12
    assert day.message == ("this key's limit of 50,000 tokens per day (UTC) is used up; "
                           "try again in 5 h 1 min")
    assert day.code == "quota_exceeded"


def test_the_refusal_that_lasts_longest_is_given() -> None:
    limits = Limits(rpm=1, tpm=10, tokens_per_day=100, tokens_per_month=1000)
    counts = Counts(requests_this_minute=2, tokens_this_minute=10, tokens_today=100,
                    tokens_this_month=1000)
    mid_month = datetime(2025, 3, 10, 8, 0, 30, tzinfo=UTC)
    refused = judge(limits, counts, mid_month)
    assert refused.limit == "tokens_per_month"
    assert refused.retry_after_s == int(
        (datetime(2025, 4, 1, tzinfo=UTC) - mid_month).total_seconds())
    assert refused.message.endswith("try again in 21 d 16 h")  # 21 d 15 h 59 min 30 s


def test_no_limits_never_refuse() -> None:
    huge = Counts(requests_this_minute=10**9, tokens_this_minute=10**12,
                  tokens_today=10**12, tokens_this_month=10**12)
    assert judge(Limits(), huge, T) is None
    assert not Limits().any and Limits(tpm=5).any


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "60", 10**15 + 1])
def test_bad_limits_are_refused_in_words(bad: object) -> None:
    with pytest.raises(ValueError, match="rpm must be a whole number from 1 to"):
        Limits(rpm=bad)


@pytest.mark.parametrize(("seconds", "words"), [
    (1, "1 s"), (59, "59 s"), (60, "1 min"), (250, "4 min 10 s"), (3600, "1 h"),
    (3599, "59 min 59 s"), (3601, "1 h 1 min"), (18180, "5 h 3 min"), (86400, "1 d"),
    (86399, "24 h"), (273600, "3 d 4 h"), (273601, "3 d 5 h"),
])
def test_duration_words(seconds: int, words: str) -> None:
    assert duration_words(seconds) == words
