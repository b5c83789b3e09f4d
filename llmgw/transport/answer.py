"""An engine's answer to one request: its head, then its body read whole, chunk by chunk,
piped to a sink, or relayed as the engine framed it (see ``Answer``); with the first-byte and
idle timeouts of the exchange.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from time import monotonic as _monotonic
from typing import TYPE_CHECKING

from llmgw.transport.errors import UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from llmgw.transport.connection import Connection

log = logging.getLogger(__name__)

# Above this much unread answer, reading from the engine pauses until the client catches up.
_HIGH_WATER = 256 * 1024
# A connection's alarm rings this early rather than be set again for less: the loop's
# timers count in milliseconds.
ALARM_SLACK_S = 0.001


class Answer:
    """One answer from an engine: status and kept headers once ``Pool.post`` returns, then
    the body with ``read()`` (whole), ``chunk()`` (as it comes, ``b""`` at the end) or
    ``pipe()`` (handed on from the connection's callback), or a chunked one relayed as the
    engine framed it (``relayable``, ``start_relay``). ``close()`` ends it early, dropping
    the connection so the engine learns nobody listens."""

    __slots__ = ("_at_chunk_end", "_chunks", "_conn", "_first_by", "_first_byte_s", "_idle_s",
                 "_last", "_limit", "_on_end", "_queued", "_sink", "_waiter", "_watch",
                 "_watch_due", "done", "error", "headers", "status")

    def __init__(self, conn: Connection, first_byte_timeout_s: float,
                 idle_timeout_s: float | None):
        self._conn = conn
        self._first_byte_s = first_byte_timeout_s
        self._idle_s = idle_timeout_s
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._sink: Callable[[list[bytes]], bool] | None = None
        self.done = False  # the whole answer came
        self.error: UpstreamError | None = None  # why it broke off (a limit, the engine)
        self._waiter: asyncio.Future | None = None
        # Called instead of waking a waiter: see ``watch``.
        self._watch: Callable[[], None] | None = None
        self._watch_due = False
        self._on_end: Callable[[], None] | None = None  # see ``start_relay``
        # The limit the connection's alarm runs for this answer: "first_byte", "idle", or
        # None for none.
        self._limit: str | None = None
        # Loop time by which the first byte of the body must have come: the first-byte
        # limit holds until then, not only until the status line (an engine may send
        # that at once and the first token after a long prefill).
        self._first_by = 0.0
        # When the body last moved (monotonic seconds), or 0.0 while none of it has come.
        # A relayed body sets it at its first read only: how long the engine has been
        # silent since is the kernel's to say (``Connection.silent_for``).
        self._last = 0.0
        self._at_chunk_end: bool | None = None  # once asked

    # --- read side ------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Some of the body was received and not read yet."""
        return bool(self._chunks)

    async def headers_done(self) -> None:
        if self.status:
            return
        self._arm_head()
        try:
            await self._wait()
        finally:
            self._disarm()
        if not self.status:
            raise self.error or UpstreamError("the answer ended early", answered=False)

    async def read(self) -> bytes:
        """The whole body; its first byte under the first-byte limit, each wait for more
        under the idle limit."""
        parts = []
        while True:
            chunk = await self.chunk()
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    async def chunk(self) -> bytes:
        """The body as it comes: everything received since the last call, ``b""`` once the
        answer is complete. Raises UpstreamError when the engine breaks it off, and
        UpstreamTimeout when its first byte does not come within the first-byte limit or
        it then sends nothing for the idle limit."""
        if not self._chunks and not self.done and self.error is None:
            if not self._last:
                if self._limit is None:
                    self._arm_first()
            elif self._idle_s is not None:
                self._last = _monotonic()
                if self._limit != "idle":
                    self._arm(self._idle_s)
            await self._wait()
        if self._chunks:
            data = self._chunks.popleft() if len(self._chunks) == 1 else self._drain()
            self._queued = 0
            if self._conn.paused:
                self._conn.resume()
            return data
        if self.error is not None:
            raise self.error
        self._disarm()
        return b""

    async def pipe(self, sink: Callable[[list[bytes]], bool]) -> None:
        """Hand the body to ``sink`` as it comes, from the connection's own callback: no
        task is woken per chunk. ``sink`` is given a list of chunks, never empty: what came
        before the pipe, then what each read from the engine brought (one call per read,
        however many chunks it held); the list is reused once the call returns. ``sink``
        returns False when whoever it writes to takes no more for now; reading from the
        engine then pauses until ``resume()``. Returns once the answer is complete; raises
        as ``chunk()`` does, the idle limit counting only while reading is not paused."""
        self.start_pipe(sink)
        try:
            while not self.done and self.error is None:
                await self._wait()
        finally:
            self.stop_pipe()
        if self.error is not None:
            raise self.error

    def start_pipe(self, sink: Callable[[list[bytes]], bool]) -> None:
        """``pipe`` without waiting, for a caller that ``watch``es the answer: the body goes
        to ``sink`` from here on, until ``stop_pipe``; the answer is complete or failed
        when the watch finds ``done`` or ``error``."""
        if self._chunks:  # came before there was a sink
            self._queued = 0
            chunks = list(self._chunks)
            self._chunks.clear()
            if sink(chunks):
                self.resume()  # had it paused at the high-water mark
            else:
                self._conn.pause()
        self._sink = sink
        if not self.done and self._conn.answer is self:
            self._conn.sink = sink  # the rest of the body goes to it as it comes
        if not self.done:  # else it came whole before there was a sink: nothing to time
            self._time_body()

    def _time_body(self) -> None:
        """The body is handed on as it comes from here: timed by the first-byte limit
        until its first byte, then by the idle limit, from now."""
        if not self._last:
            self._arm_first()
        elif self._idle_s is not None:
            self._last = _monotonic()
            self._arm(self._idle_s)

    def stop_pipe(self) -> None:
        """No more of the body goes to the ``start_pipe`` sink or the ``start_relay``
        write."""
        self._unsink()
        self._sink = None
        self._disarm()

    def relayable(self) -> bytes | None:
        """For a caller that would relay the body as the engine framed it, chunk sizes and
        all, rather than have it parsed into parts and framed again (``start_relay``): the
        bytes of the body that came with the head, as they came (maybe none). None when
        the body cannot be relayed so: it is not chunked, its head came in more than one
        read (where it ends is then not known here), a read came since the head, or the
        kernel cannot say when the engine last sent data (``Connection.kernel_clock``)."""
        conn = self._conn
        data = conn._read
        if conn.answer is not self or not conn._chunked or conn._head_read is not data \
                or conn.relay is not None or not data.startswith(b"HTTP/") \
                or not conn.kernel_clock:
            return None  # (llhttp skips empty lines before a head: not known how many)
        # The head began the read, and ends at its first empty line: llhttp takes no line
        # that ends without a CR (tests/integration/test_upstream_client.py). A whole
        # answer ends where its last chunk does.
        end = conn._end_in(data) if self.done else len(data)
        return data[data.index(b"\r\n\r\n") + 4:end]

    def start_relay(self, write: Callable[[bytes], object], on_first: Callable[[], None] | None,
                    keep: Callable[[list[bytes]], None] | None, every: int,
                    on_end: Callable[[], None] | None = None) -> None:
        """After ``relayable`` gave the body's first bytes (which the caller writes): each
        read from the engine goes to ``write`` as it came, from the connection's callback,
        head excepted, chunk framing and the body's end included. The reads are still
        parsed, for where the answer ends and for its body's parts, which go to ``keep``
        (if any) once ``every`` bytes came since the last time, and when the relay ends:
        first those that came with the head. ``on_first`` is called before the first
        read is written. As with a pipe, ``watch`` learns when the answer is complete or
        failed (for a caller that ``watch``es it); a failed one may have stopped in the
        middle of a chunk (``at_chunk_end``). ``on_end``, if given, is called instead of
        the watch when the answer came whole and its end was relayed, from the read that
        ended it. ``pause`` and ``resume`` are for when ``write``'s reader lags behind."""
        conn = self._conn
        parts = list(self._chunks)
        self._chunks.clear()
        self._queued = 0
        if keep is not None and parts:
            keep(parts)
        if self.done or self.error is not None:
            return  # came whole with the head
        conn._relay_keep, conn._relay_every, conn._relay_left = keep, every, every
        self._on_end = on_end
        if on_first is None:
            conn.relay = write
        else:
            def first(data: bytes) -> None:
                if conn.relay is first:  # else this very read ended the relay
                    conn.relay = write
                self._last = _monotonic()  # the body began: timed by the idle limit
                on_first()
                write(data)

            conn.relay = first
        self._time_body()

    def at_chunk_end(self) -> bool:
        """A relayed answer that failed, or whose relay was stopped before its end, stopped
        where one chunk ended and before the next began: a caller may end what it relayed
        with chunks of its own. False once a read did not parse (its bytes were not
        relayed). Its connection is not used again (``close`` drops it)."""
        if not self.status or (self.done and self.error is None):
            raise RuntimeError("Answer.at_chunk_end of an answer with no head, or whole")
        if self._at_chunk_end is None:
            # What was relayed ended a line, and the end of a body would end the answer:
            # from inside a chunk, or a size line, its last chunk or a trailer, the parser
            # takes those bytes as data, or fails on them (tests/integration/
            # test_upstream_client.py tries each).
            conn = self._conn
            self._at_chunk_end = conn._read.endswith(b"\r\n") and \
                conn.ends_with(b"0\r\n\r\n")
        return self._at_chunk_end

    def pause(self) -> None:
        """Stop reading from the engine until ``resume``. Nothing once the answer let go of
        its connection (``close``), which may serve another answer by then: a writer's
        callback can come late."""
        if self._conn.answer is self:
            self._conn.pause()

    def watch(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` when the answer moves on (its head came, body came with no
        sink, it completed or failed), instead of waking an ``await``: for a caller driven
        by callbacks, with no task. Called by the connection once the read that moved it
        was handed on whole (the read that completes the answer is left ``pending`` for
        it: ``take``), or soon from the loop for a limit or a lost connection."""
        self._watch = callback

    def resume(self) -> None:
        """Read from the engine again after a ``pipe`` sink said it was full (or after
        ``pause``). Nothing once the answer let go of its connection, as ``pause``."""
        conn = self._conn
        if conn.paused and conn.answer is self:
            conn.resume()

    def take(self) -> bytes:
        """What came and was not handed on yet (``pending``), taken: after a ``watch`` found
        the answer ``done``, the last read's part of the body."""
        self._queued = 0
        return self._drain()

    def _drain(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        """Release the connection: back to the pool when the answer was read to its end,
        else dropped. Nothing of the answer is handed on, relayed or watched after this
        (its connection's ``finish`` takes back a sink or a relay of its own)."""
        self._watch = self._sink = self._on_end = None
        self._disarm()
        self._conn.finish(self, reuse=self.done and self.error is None and not self._chunks)

    # --- timers ---------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        """The idle limit, ``seconds`` from now."""
        self._limit = "idle"
        self._conn.alarm(self._conn.loop.time() + seconds, self._expired)

    def _arm_at(self, when: float) -> None:
        """The first-byte limit, at loop time ``when``."""
        self._limit = "first_byte"
        self._conn.alarm(when, self._expired)

    def _arm_head(self) -> None:
        """The request was sent: its first byte is due within the first-byte limit."""
        self._first_by = self._conn.loop.time() + self._first_byte_s
        self._arm_at(self._first_by)

    def _arm_first(self) -> None:
        """Head in, none of the body yet: ring at the first-byte deadline, or sooner, after
        the idle limit, to notice a body that began streaming in the meantime (a ``pipe``
        sink takes chunks without a wait ending) and time it by the idle limit."""
        when = self._first_by
        if self._idle_s is not None:
            when = min(when, self._conn.loop.time() + self._idle_s)
        self._arm_at(when)

    def _disarm(self) -> None:
        if self._limit is not None:
            self._limit = None
            if self._conn.answer is self:
                self._conn.alarm(0.0, None)

    def _expired(self) -> None:
        self._limit = None
        if self.done or self.error is not None:
            return
        if self.status:
            if self._chunks or self._conn.paused:
                # Data waits for our reader (a slow client): the engine is not idle.
                if self._idle_s is not None:
                    self._arm(self._idle_s)
                return
            if not self._last:
                if self._conn.loop.time() < self._first_by - ALARM_SLACK_S:
                    self._arm_first()
                    return
            elif self._idle_s is not None:
                idle_for = self._conn.silent_for()
                if idle_for is None:
                    idle_for = _monotonic() - self._last
                if idle_for < self._idle_s:
                    # Data came since the limit was set: wait out the rest of the period.
                    self._arm(self._idle_s - idle_for)
                    return
            else:
                return  # no idle limit: the body may take its time
        self._fail(UpstreamTimeout("idle" if self._last else "first_byte",
                                   answered=bool(self.status)))
        self._conn.abort()

    # --- fed by the connection ------------------------------------------------------------

    def _wake(self) -> None:
        """The answer moved on outside a read from the engine (a limit rang, the connection
        was lost): its waiter is woken, or its watch run soon, from the loop."""
        if self._waiter is None and self._watch is not None and not self._watch_due:
            self._watch_due = True
            self._conn.loop.call_soon(self._run_watch)
        else:
            self._moved()

    def _moved(self) -> None:
        """The answer moved on in the middle of a read: its waiter is woken (it runs after
        the read anyway), or its watch marked due, for ``Connection.data_received`` to run
        once the read is handed on whole: no loop callback in between."""
        waiter = self._waiter
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(None)
        elif self._watch is not None:
            self._watch_due = True
            self._conn.due = True

    def _run_watch(self) -> None:
        if self._watch_due:  # not already run by the read that made it due again
            self._watch_due = False
            if self._watch is not None:
                self._watch()

    def _fail(self, error: UpstreamError, in_read: bool = False) -> None:
        if self.error is None and not self.done:
            self.error = error
            self._unsink()
            if in_read:
                self._moved()
            else:
                self._wake()

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = headers
        self._moved()

    def _unsink(self) -> None:
        """What comes of the body from here on is no longer handed to the sink, or relayed,
        as it comes (``Connection.data_received``)."""
        conn = self._conn
        if self._sink is not None and conn.sink is self._sink:
            conn.sink = None
        if conn.relay is not None and conn.answer is self:
            conn.stop_relay()

    def _queue(self, parts: list[bytes]) -> None:
        """A read's body parts with no ``pipe`` sink yet (or the last read's, for a
        watch): kept for ``chunk``/``read``/``pipe``/``take``."""
        self._chunks.extend(parts)
        self._queued += sum(map(len, parts))
        if self._queued > _HIGH_WATER:
            self._conn.pause()
        self._moved()

    def _complete(self, in_read: bool = False) -> None:
        self.done = True
        if self._watch is not None:
            # The read that ends it is queued, for the watch to end the answer with it.
            self._unsink()
        if in_read:
            self._moved()
        else:
            self._wake()


