"""One keep-alive connection to an engine: an ``asyncio.Protocol`` parsing answers with
httptools (llhttp), feeding the connection's current Answer, and asking the kernel
(TCP_INFO) when data last came and whether a request was ever taken.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from time import monotonic as _monotonic
from typing import TYPE_CHECKING

import httptools

from llmgw.transport.answer import ALARM_SLACK_S, Answer
from llmgw.transport.errors import Undelivered, UpstreamError

if TYPE_CHECKING:
    from llmgw.transport.pool import Pool

log = logging.getLogger(__name__)

# Passed on from the engine's answer; everything else (hop-by-hop, lengths) is ours.
KEPT_HEADERS = frozenset({b"content-type", b"cache-control"})
# struct tcp_info (linux/tcp.h): ``tcpi_last_data_recv``, milliseconds since data last
# came in, a u32 after 8 bytes of u8 fields and 11 u32 ones.
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_AT = 52
_TCP_INFO_BYTES = _LAST_DATA_RECV_AT + _LAST_DATA_RECV.size
# And, for a connection that broke before any answer (``Connection.undelivered``):
# ``tcpi_bytes_acked`` (a u64 at 120, Linux 4.1), ``tcpi_bytes_sent`` and
# ``tcpi_bytes_retrans`` (u64s at 200 and 208, Linux 4.19).
_U64 = struct.Struct("=Q")
_BYTES_ACKED_AT = 120
_BYTES_SENT_AT = 200
_BYTES_RETRANS_AT = 208
_TCP_INFO_SENT_BYTES = _BYTES_RETRANS_AT + _U64.size


class _Unasked(Exception):
    """An answer came with no request waiting for it: the read fails to parse
    (``on_message_begin``)."""


class Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, parsing its answers with httptools."""

    # Slots, not a dict: over 30 attributes, an instance's dict would not share its keys,
    # and every attribute read on the path of each relayed read would be a dict lookup.
    __slots__ = ("_alarm", "_alarm_at", "_chunked", "_framed", "_head_read", "_headers",
                 "_keep_alive", "_lost", "_parser", "_parts", "_probing", "_read",
                 "_relay_every", "_relay_keep", "_relay_left", "_timer", "_timer_at",
                 "_until_eof", "_upgraded", "address", "answer", "due", "got_nothing",
                 "kernel_clock", "loop", "on_body", "paused", "pool", "relay", "sink",
                 "transport")

    def __init__(self, pool: Pool, address: tuple):
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
        if self._alarm_at - self.loop.time() > ALARM_SLACK_S:
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
