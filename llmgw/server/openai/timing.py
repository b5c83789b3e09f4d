"""A streamed answer's time to its first token and between its next reads, observed as
each read of the engine's stream goes to the client.

What it adds to a relay is one Python call per read (``timed_write``, ``timed_sink``):
a clock read and a histogram bucket's count, written out in the call rather than
``Histogram.observe`` called (a read is the relay's hot path: about 35 bytecodes), with
a search for generated text only until the first token was seen. The gaps' sum is not
added up per read: they add up to the time from the first token to the last read, added
once when the stream is over (``StreamClock.done``).
"""

from __future__ import annotations

import re
import time
from bisect import bisect_left
from collections.abc import Callable

from llmgw.server.metrics import StreamSeries

# An event that carries generated text: a non-empty string as chat's delta `content`
# (or `reasoning_content`, `refusal`, a tool call's `arguments`), a completion's `text`,
# or the Responses API's `delta`. The first event of many engines has none (`"role":
# "assistant"` with an empty or null `content`): that is not the first token.
_GENERATED = re.compile(
    rb'"(?:content|reasoning_content|refusal|arguments|text|delta)"\s*:\s*"(?!")')

_clock = time.perf_counter


class StreamClock:
    """Times one stream: ``first_token``, seconds from the request's arrival (``began``,
    a ``time.perf_counter()``) to the first read that carries generated text, observed
    into the model's ``llmgw_time_to_first_token_seconds``; then the time between each
    read and the one before it, into ``llmgw_inter_token_latency_seconds``. ``last``:
    when the last read was timed, 0 until the first token. ``done`` once it is over."""

    __slots__ = ("began", "first_at", "first_token", "last", "series")

    def __init__(self, series: StreamSeries, began: float) -> None:
        self.series = series
        self.began = began
        self.first_token: float | None = None
        self.first_at = self.last = 0.0

    def read(self, data: bytes | bytearray) -> None:
        """``data``, one read of the stream, is on its way to the client."""
        now = _clock()
        if self.last:
            inter = self.series.inter_token
            inter.counts[bisect_left(inter.bounds, now - self.last)] += 1
        elif _GENERATED.search(data) is None:
            return
        else:
            self.first_at = now
            self.first_token = now - self.began
            self.series.first_token.observe(self.first_token)
        self.last = now

    def done(self) -> None:
        """The stream is over (call once): the gaps between its reads, added to the
        histogram's sum."""
        if self.last:
            self.series.inter_token.sum += self.last - self.first_at

    def reads(self, chunks: list[bytes]) -> None:
        """``read`` for what one read brought, as a list of the body's parts."""
        self.read(chunks[0] if len(chunks) == 1 else b"".join(chunks))


def timed_write(write: Callable[[bytes], object], clock: StreamClock
                ) -> Callable[[bytes], object]:
    """``write`` (a relay's: each read as it came), telling ``clock`` of each read."""
    read = clock.read
    inter = clock.series.inter_token
    counts, bounds = inter.counts, inter.bounds

    def timed(data: bytes) -> object:
        last = clock.last
        if last:  # StreamClock.read after the first token, written out
            now = clock.last = _clock()
            counts[bisect_left(bounds, now - last)] += 1
        else:
            read(data)
        return write(data)

    return timed


def timed_sink(sink: Callable[[list[bytes]], bool], clock: StreamClock
               ) -> Callable[[list[bytes]], bool]:
    """``sink`` (a pipe's: each read's parts), telling ``clock`` of each read."""
    reads = clock.reads
    inter = clock.series.inter_token
    counts, bounds = inter.counts, inter.bounds

    def timed(chunks: list[bytes]) -> bool:
        last = clock.last
        if last:  # StreamClock.read after the first token, written out
            now = clock.last = _clock()
            counts[bisect_left(bounds, now - last)] += 1
        else:
            reads(chunks)
        return sink(chunks)

    return timed
