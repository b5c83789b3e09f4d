"""A lean HTTP/1.1 client for the one thing the gateway does upstream: POST a body to an
engine and read its answer, whole or chunk by chunk.

aiohttp's client, measured on the gateway's hot path, cost more CPU per proxied request
than everything else llmgw does for it (request objects, header multidicts, timeouts as
context managers, a task per read). This client keeps one ``asyncio.Protocol`` per
keep-alive connection with httptools (llhttp) parsing the answer, and writes each request
as one buffer. It does no redirects, cookies, proxies, TLS, decompression or pipelining:
engines are plain HTTP on the cluster's network.

Timeouts are timer handles on the exchange, not ``asyncio.timeout`` scopes: the idle timer
is re-armed lazily (at most once per idle period), so a stream of thousands of chunks costs
a handful of timers.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import socket
import struct
from collections.abc import Callable
from time import monotonic as _monotonic

import httptools

from llmgw.core.names import url_host

log = logging.getLogger(__name__)

# Passed on from the engine's answer; everything else (hop-by-hop, lengths) is ours.
KEPT_HEADERS = frozenset({b"content-type", b"cache-control"})
# Above this much unread answer, reading from the engine pauses until the client catches up.
_HIGH_WATER = 256 * 1024
# What a request body is unless told otherwise, and what an answer without a type is.
JSON_TYPE = b"application/json"
# Idle keep-alive connections kept per engine address.
_MAX_IDLE = 64
# A connection's alarm rings this early rather than be set again for less: the loop's
# timers count in milliseconds.
_ALARM_SLACK_S = 0.001
# struct tcp_info (linux/tcp.h): ``tcpi_last_data_recv``, milliseconds since data last
# came in, a u32 after 8 bytes of u8 fields and 11 u32 ones.
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_AT = 52
_TCP_INFO_BYTES = _LAST_DATA_RECV_AT + _LAST_DATA_RECV.size
# And, for a connection that broke before any answer (``_Connection.undelivered``):
# ``tcpi_bytes_acked`` (a u64 at 120, Linux 4.1), ``tcpi_bytes_sent`` and
# ``tcpi_bytes_retrans`` (u64s at 200 and 208, Linux 4.19).
_U64 = struct.Struct("=Q")
_BYTES_ACKED_AT = 120
_BYTES_SENT_AT = 200
_BYTES_RETRANS_AT = 208
_TCP_INFO_SENT_BYTES = _BYTES_RETRANS_AT + _U64.size


@functools.lru_cache(maxsize=1024)
def _host_header(host: str, port: int) -> bytes:
    """``host:port`` as the Host header has it (IPv6 in brackets), once per engine address:
    the idna codec is pure Python and would cost more than the rest of the request head."""
    return url_host(host).encode("idna") + b":" + str(port).encode()


def request_bytes(host: str, port: int, path: str, body: bytes, accept: bytes,
                  content_type: bytes = JSON_TYPE) -> bytes:
    """A POST of ``body`` to the engine at ``host:port``, head and body in one buffer."""
    return b"".join((b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\nhost: ",
                     _host_header(host, port),
                     b"\r\ncontent-type: ", content_type, b"\r\naccept: ", accept,
                     b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n\r\n", body))


class UpstreamError(Exception):
    """The exchange with the engine failed. ``answered`` is False when the engine sent no
    status line; the request may still have reached it, and it may have been working on
    it (only ``ConnectError`` and ``Undelivered`` say that it did not)."""

    def __init__(self, message: str, *, answered: bool):
        super().__init__(message)
        self.answered = answered


class ConnectError(UpstreamError):
    """No connection could be made (refused, unreachable, or not within the limit)."""

    def __init__(self, message: str, *, timed_out: bool = False):
        super().__init__(message, answered=False)
        self.timed_out = timed_out


class Undelivered(UpstreamError):
    """The connection broke, with no byte of an answer, before the engine's end had taken
    the whole request: its TCP acknowledged less than was sent. The engine had closed the
    connection before the request reached it (a kept-alive one it let go as it was
    picked), or went away before it had all of it; either way no engine read the request
    whole, so it may be sent again (see ``Pool.post``)."""

    def __init__(self) -> None:
        super().__init__("the engine had closed the connection before the request "
                         "reached it", answered=False)


class UpstreamTimeout(UpstreamError):
    """The engine sent nothing for too long: ``phase`` is "first_byte" or "idle"."""

    def __init__(self, phase: str, answered: bool):
        super().__init__(f"no data ({phase})", answered=answered)
        self.phase = phase


class Pool:
    """Keep-alive connections per engine address, for every upstream request of a server
    process."""

    def __init__(self, connect_timeout_s: float):
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], collections.deque[_Connection]] = {}
        self._closed = False

    async def post(self, host: str, port: int, path: str, body: bytes, accept: bytes,
                   *, first_byte_timeout_s: float, idle_timeout_s: float | None,
                   content_type: bytes = JSON_TYPE) -> Answer:
        """Send the request and wait for the answer's status and headers (under
        ``first_byte_timeout_s``); the body is read from the returned Answer, its first
        byte still under ``first_byte_timeout_s``, each wait for more after that under
        ``idle_timeout_s`` when given. The request is sent a second time only when it went
        on a kept-alive connection that the engine had closed before the request reached
        it (``Undelivered``), and then on a new connection; an error of that one is
        raised as it is."""
        payload = request_bytes(host, port, path, body, accept, content_type)
        for attempt in range(2):
            conn, reused = await self._connection(host, port, fresh=attempt > 0)
            answer = Answer(conn, first_byte_timeout_s, idle_timeout_s)
            conn.start(answer, payload)
            try:
                await answer.headers_done()
                return answer
            except UpstreamError as err:
                conn.abort()
                # A pooled connection the engine had closed before the request reached it
                # (its TCP never acknowledged it): once more, on a new connection, never
                # another pooled one. Anything else that broke after the request was
                # written is not sent again: the engine may have been working on it. A
                # new connection is never tried twice.
                if reused and isinstance(err, Undelivered):
                    continue
                raise
            except BaseException:
                conn.abort()  # cancelled while waiting: the engine must see us go
                raise
        raise AssertionError("unreachable")

    def send_now(self, host: str, port: int, payload: bytes, first_byte_timeout_s: float,
                 idle_timeout_s: float | None) -> Answer | None:
        """``payload`` (``request_bytes``) sent at once on an idle kept-alive connection to
        the engine, without waiting: its Answer, whose head comes later (``Answer.watch``
        says when), under the same limits as ``post``. None when no idle connection is
        there (``post`` makes one)."""
        conn = self._idle_connection(host, port)
        if conn is None:
            return None
        answer = Answer(conn, first_byte_timeout_s, idle_timeout_s)
        conn.start(answer, payload)
        answer._arm_head()
        return answer

    def _idle_connection(self, host: str, port: int) -> _Connection | None:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
        return None

    async def _connection(self, host: str, port: int, fresh: bool = False
                          ) -> tuple[_Connection, bool]:
        """A connection to the engine, and whether it was kept alive from an earlier
        request: an idle one from the pool unless ``fresh``, else a new one."""
        if not fresh:
            conn = self._idle_connection(host, port)
            if conn is not None:
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, (host, port)), host, port)
        except TimeoutError:
            raise ConnectError(f"no connection to {host}:{port} within "
                               f"{self.connect_timeout_s:g} s", timed_out=True) from None
        except OSError as err:
            raise ConnectError(f"cannot connect to {host}:{port}: "
                               f"{err.strerror or err}") from None
        return conn, False

    def _put_back(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        idle = self._idle.get(conn.address)
        if idle is None:
            self._idle[conn.address] = collections.deque((conn,))
        elif len(idle) >= _MAX_IDLE:
            conn.abort()
        else:
            idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.address)
        if idle is None:
            return
        if conn in idle:
            idle.remove(conn)
        if not idle:
            # Replicas come and go on new ports: keep no entry for an address with no
            # connection left.
            del self._idle[conn.address]

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().abort()


class Answer:
    """One answer from an engine: status and kept headers once ``Pool.post`` returns, then
    the body with ``read()`` (whole), ``chunk()`` (as it comes, ``b""`` at the end) or
    ``pipe()`` (handed on from the connection's callback), or a chunked one relayed as the
    engine framed it (``relayable``, ``start_relay``). ``close()`` ends it early, dropping
    the connection so the engine learns nobody listens."""

    __slots__ = ("_at_chunk_end", "_chunks", "_conn", "_first_by", "_first_byte_s", "_idle_s",
                 "_last", "_limit", "_on_end", "_queued", "_sink", "_waiter", "_watch",
                 "_watch_due", "done", "error", "headers", "status")

    def __init__(self, conn: _Connection, first_byte_timeout_s: float,
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
        # silent since is the kernel's to say (``_Connection.silent_for``).
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
        kernel cannot say when the engine last sent data (``_Connection.kernel_clock``)."""
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
                if self._conn.loop.time() < self._first_by - _ALARM_SLACK_S:
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
        the read anyway), or its watch marked due, for ``_Connection.data_received`` to run
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
        as it comes (``_Connection.data_received``)."""
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


class _Unasked(Exception):
    """An answer came with no request waiting for it: the read fails to parse
    (``on_message_begin``)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, parsing its answers with httptools."""

    # Slots, not a dict: over 30 attributes, an instance's dict would not share its keys,
    # and every attribute read on the path of each relayed read would be a dict lookup.
    __slots__ = ("_alarm", "_alarm_at", "_chunked", "_framed", "_head_read", "_headers",
                 "_keep_alive", "_lost", "_parser", "_parts", "_probing", "_read",
                 "_relay_every", "_relay_keep", "_relay_left", "_timer", "_timer_at",
                 "_until_eof", "_upgraded", "address", "answer", "due", "got_nothing",
                 "kernel_clock", "loop", "on_body", "paused", "pool", "relay", "sink",
                 "transport")

    def __init__(self, pool: Pool, address: tuple[str, int]):
        self.pool = pool
        # The alarm: one timer kept across the connection's requests (see ``alarm``).
        self._alarm: Callable[[], None] | None = None
        self._alarm_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.answer: Answer | None = None
        # The answer's pipe sink while its body comes: each read's parts go to it at once.
        self.sink: Callable[[list[bytes]], bool] | None = None
        # The answer's relay while its body comes (``Answer.start_relay``): each read goes
        # to it as it came; the body's parts go to ``_relay_keep`` every ``_relay_every``
        # bytes (``_relay_left`` to go).
        self.relay: Callable[[bytes], object] | None = None
        self._relay_keep: Callable[[list[bytes]], None] | None = None
        self._relay_every = self._relay_left = 0
        # An answer's watch was made due in a read: ``data_received`` runs it at its end.
        self.due = False
        self.got_nothing = True
        self._headers: list[tuple[bytes, bytes]] = []
        # The body's parts, as the parser found them in one read: httptools calls
        # ``on_body`` for each, here a list's append (C, no Python call per part), and
        # ``data_received`` hands them on once the read is parsed.
        self._parts: list[bytes] = []
        self.on_body = self._parts.append
        # The latest read (relayed, as far as it was), and the one the answer's head began
        # in (``Answer.relayable``).
        self._read = b""
        self._head_read: bytes | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._lost = False
        self.paused = False
        self.loop = asyncio.get_running_loop()
        self._framed = False  # the answer says where its body ends
        self._probing = False  # ``ends_with`` is feeding the parser
        self._chunked = False  # in chunks, and only that
        self._keep_alive = False
        self._until_eof = False
        self._upgraded = False  # the answer was a switch of protocols
        self.kernel_clock = False  # see connection_made

    def silent_for(self) -> float | None:
        """Seconds since the engine last sent data on this connection, as the kernel
        counts them (TCP_INFO's ``tcpi_last_data_recv``), whether or not it was read
        yet; None where the kernel does not say. A relayed stream's reads do not note
        the time each (a clock read per event, in the hottest path); its idle limit asks
        this instead when its alarm rings."""
        sock = self.transport.get_extra_info("socket") if self.transport else None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        except (AttributeError, OSError):  # no socket, no TCP_INFO: not Linux, or gone
            return None
        if len(info) < _TCP_INFO_BYTES:
            return None
        return _LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_AT)[0] / 1000

    def undelivered(self) -> bool:
        """The engine's TCP acknowledged less than was sent on this connection, as the
        kernel counts both (TCP_INFO): asked once it broke with no byte of an answer.
        Every earlier request on it was acknowledged (an answer to it came, and carried
        the acknowledgment), so what is missing is the current request's: the engine's
        end never had all of it. Such a connection was closed by the engine before the
        request reached it (an engine that closes a kept-alive connection answers what
        comes after with a reset, acknowledging none of it); one whose engine read the
        request and then died, or was killed, acknowledged it all. False where the kernel
        does not say (not Linux, before 4.19): the request is then taken as delivered.
        A reset that came before the request could be written leaves nothing
        unacknowledged either, and Linux counts the SYN as one byte acknowledged, so one
        byte short reads as none: both taken as delivered, which errs the safe way."""
        sock = self.transport.get_extra_info("socket") if self.transport else None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SENT_BYTES)
        except (AttributeError, OSError):
            return False
        if len(info) < _TCP_INFO_SENT_BYTES:
            return False
        acked = _U64.unpack_from(info, _BYTES_ACKED_AT)[0]
        sent = _U64.unpack_from(info, _BYTES_SENT_AT)[0] - \
            _U64.unpack_from(info, _BYTES_RETRANS_AT)[0]
        return acked < sent

    def usable(self) -> bool:
        return not self._lost and self.transport is not None and \
            not self.transport.is_closing()

    def start(self, answer: Answer, payload: bytes) -> None:
        self.answer = answer
        self.sink = None
        self.relay = None
        self.got_nothing = True
        self._headers = []
        self._framed = self._chunked = False
        self._read, self._head_read = b"", None
        self.transport.write(payload)

    def finish(self, answer: Answer, reuse: bool) -> None:
        if self.answer is not answer:
            return
        self.answer = self.sink = None
        if self.relay is not None:
            self.stop_relay()
        self._read, self._head_read = b"", None  # not kept while idle
        if reuse and self._keep_alive and self.usable():
            # Read whole, but reading may have been paused for a client that left or
            # lagged as the last chunk came: the next answer on it must be read.
            if self.paused:
                self.resume()
            self.pool._put_back(self)
        else:
            self.abort()

    def abort(self) -> None:
        self._lost = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()

    def alarm(self, when: float, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` at loop time ``when``; ``None`` calls nothing. One timer serves
        every request of the connection: a timer set for an earlier time is kept, and when
        it fires is set again for the time asked last. Most requests end within their
        limit, so most set no timer of their own (uvloop makes and closes one per
        ``call_at``: microseconds on every request, in a hot path of a hundred or so)."""
        self._alarm, self._alarm_at = callback, when
        if callback is not None and (self._timer is None or self._timer_at > when):
            self._stop_timer()
            self._timer, self._timer_at = self.loop.call_at(when, self._ring), when

    def _ring(self) -> None:
        self._timer = None
        callback = self._alarm
        if callback is None:
            return
        if self._alarm_at - self.loop.time() > _ALARM_SLACK_S:
            self._timer, self._timer_at = self.loop.call_at(self._alarm_at, self._ring), \
                self._alarm_at
            return
        self._alarm = None
        callback()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def stop_relay(self) -> None:
        """The relay ends: the body's parts not yet kept go to its ``keep``."""
        if self.relay is None:
            return
        self.relay = None
        self._settle_relay()
        self._relay_keep = None

    def _settle_relay(self) -> None:
        keep, parts = self._relay_keep, self._parts
        self._relay_left = self._relay_every
        try:
            if keep is not None and parts:
                keep(parts)
        finally:
            parts.clear()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self._lost:
            self.paused = False
            self.transport.resume_reading()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # Whether the kernel says when the engine last sent data (Linux's TCP does):
        # only then is an answer relayed, its reads noting no time (``silent_for``).
        self.kernel_clock = self.silent_for() is not None

    def data_received(self, data: bytes) -> None:
        # Every read of every stream: kept short, in one frame; the rest is handled apart.
        # (Bytes nobody asked for fail the parse: ``on_message_begin``.)
        relay = self.relay
        if relay is not None:
            # A relayed stream: parsed for its end and its parts (into ``_parts``, for
            # ``_relay_keep``), written on as it came. The read that ends it stops the
            # relay as it is parsed and is still written here.
            try:
                self._parser.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as err:
                self._unparsable(err, relaying=True)
                return
            if self.due:
                self._relayed_last(relay, data)
                return
            relay(data)
            self._read = data
            left = self._relay_left - len(data)
            self._relay_left = left
            if left < 0:
                self._settle_relay()
            return
        self._read = data
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as err:
            self._unparsable(err)
            return
        parts = self._parts
        if parts:
            # What the read brought goes on at once: ``_hand_on``, unrolled for a stream
            # piped to a sink.
            sink = self.sink
            if sink is not None:
                self.answer._last = _monotonic()
                try:
                    if not sink(parts):
                        self.pause()
                finally:
                    parts.clear()  # never handed on twice, whatever a sink does
            else:
                self._hand_on()
        if self.due:
            self._run_due()

    def _hand_on(self) -> None:
        """The body's parts parsed from a read go to the answer's sink, or, with none (no
        pipe yet, or the read that ends an answer someone watches: the watch ends the
        answer with it, in one write), to its queue, in order, once the read is parsed
        (an end of the answer found in it only woke the answer's reader, which runs after
        this)."""
        answer, parts = self.answer, self._parts
        try:
            answer._last = _monotonic()
            sink = self.sink
            if sink is None:
                answer._queue(parts)
            elif not sink(parts):
                self.pause()
        finally:
            parts.clear()  # never handed on twice, whatever a sink does

    def _unparsable(self, err: httptools.HttpParserError | httptools.HttpParserUpgrade,
                    relaying: bool = False) -> None:
        """The read did not parse: what parsed before the error is the answer's (bytes
        after a whole answer are the connection's fault, not the answer's) and is handed
        on, then the answer fails and the connection is dropped. A relayed answer fails
        even if it ended in the read: ``relaying`` writes a read whole or not at all, so
        its end was not relayed."""
        answer = self.answer
        if answer is None:
            # Nothing was asked: an engine talking out of turn is not to be trusted.
            self._parts.clear()
            self.abort()
            return
        self._read = b""  # not to be relayed (``Answer.relayable``)
        self.stop_relay()
        if isinstance(err, httptools.HttpParserUpgrade):
            # A 101: its head was kept from the answer (on_headers_complete).
            broken = UpstreamError("the engine answered by switching protocols (101), "
                                   "which llmgw does not relay", answered=False)
        else:
            broken = UpstreamError(f"the engine's answer is not valid HTTP: {err}",
                                   answered=bool(answer.status))
        try:
            if self._parts:
                self._hand_on()
        finally:
            if relaying and answer.done:
                answer.error = broken  # its watch, due, finds it failed
            answer._fail(broken, in_read=True)
            self.abort()
            if self.due:
                self._run_due()

    def _run_due(self) -> None:
        # Last in a read: the watch may end the answer and hand this connection on. What
        # it raises is logged, as the loop would a callback's: this connection is not at
        # fault.
        self.due = False
        answer = self.answer
        if answer is None or not answer._watch_due:
            return
        try:
            answer._run_watch()
        except Exception:
            log.exception("unexpected error in the watch of an answer")

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._stop_timer()
        self.pool._forget(self)
        answer = self.answer
        if answer is None:
            return
        if self._until_eof and answer.status:
            answer._complete()
        elif answer.error is None and not answer.status and self.got_nothing \
                and self.undelivered():
            answer._fail(Undelivered())
        else:
            answer._fail(UpstreamError("the engine closed the connection"
                                       + (" mid-answer" if answer.status else
                                          " before answering"),
                                       answered=bool(answer.status)))

    # httptools callbacks

    def on_message_begin(self) -> None:
        # The answer's first byte (once per answer, not per read). A message with no request
        # waiting for it (none, or the one before it already whole: an engine that sent
        # more than it said) fails the read, and the connection is dropped; the answer
        # before it keeps what it had.
        answer = self.answer
        if answer is None or answer.done:
            raise _Unasked
        self.got_nothing = False
        self._head_read = self._read

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in KEPT_HEADERS:
            self._headers.append((name, value))
        elif name == b"transfer-encoding":
            self._framed = True
            self._chunked = value.lower() == b"chunked"
        elif name == b"content-length":
            self._framed = True

    def on_headers_complete(self) -> None:
        parser = self._parser
        if parser.should_upgrade():
            # A switch of protocols (101) is no answer to relay: the answer never sees
            # it, and the read fails (data_received).
            self._upgraded = True
            return
        # Read here: after the message, llhttp no longer says.
        self._keep_alive = parser.should_keep_alive()
        # Neither a length nor chunks: the body runs to the end of the connection.
        self._until_eof = not self._framed
        self.answer._head(parser.get_status_code(), self._headers)

    def on_message_complete(self) -> None:
        if self._probing:
            self._probing = False  # ``ends_with``'s bytes ended the answer
        elif not self._upgraded:
            self.answer._complete(in_read=True)

    def _relayed_last(self, relay: Callable[[bytes], object], data: bytes) -> None:
        """A relayed read that moved the answer on (it ended in it: the relay stopped as
        it was parsed), written up to the answer's end, then its watch (or, for one that
        came whole, its relay's ``on_end``)."""
        if self.relay is None:
            data = data[:self._end_in(data)]
        relay(data)
        self._read = data
        self._relay_left -= len(data)
        if self._relay_left < 0 and self.relay is not None:
            self._settle_relay()
        answer = self.answer
        on_end = answer._on_end if answer is not None and answer.done else None
        if on_end is None or answer.error is not None:
            self._run_due()
            return
        self.due = answer._watch_due = False
        try:
            on_end()
        except Exception:
            log.exception("unexpected error at the end of a relayed answer")

    def _end_in(self, data: bytes) -> int:
        """Where the relayed answer that ended in ``data`` ends in it: at the empty line
        after its last chunk (and trailers). llhttp skips CRs and LFs between answers, so
        they are all that may follow; the four bytes of that empty line's CRLF and the one
        before it come after the last other byte, in this read or (the rest) the one
        before. (Were that one also all CRs and LFs, the end is put too late, never too
        early.)"""
        rest = len(data.rstrip(b"\r\n"))
        if rest:
            return rest + 4
        before = self._read
        return 4 - (len(before) - len(before.rstrip(b"\r\n")))

    def ends_with(self, end: bytes) -> bool:
        """Whether ``end`` would end the answer whose read stopped (it failed, and the
        connection is dropped): ``end`` is fed to the parser, which is of no use after.
        With the end of a chunked body, whether the answer stopped between chunks: in a
        chunk, the parser takes those bytes as the chunk's, or fails on them."""
        self._probing = True
        try:
            self._parser.feed_data(end)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return False
        else:
            return not self._probing  # on_message_complete says so
        finally:
            self._probing = False
            self._parts.clear()
