"""Writing a response straight to the client's connection: BodyWriter, offered to the
app with each request as the ASGI extension BODY_WRITER, and the CallbackRoutes protocol of
an app that serves some requests from callbacks.

It knows chunks and connections, not what they carry: what looks at a stream's chunks on
their way (the gateway's token count) is a ChunkTap the app hands to ``sink``.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    RequestResponseCycle,
)

if TYPE_CHECKING:
    from llmgw.transport.server import BoundedHeadProtocol, _Light

log = logging.getLogger(__name__)


BODY_WRITER = "llmgw.body_writer"
# One chunk of a chunked body: its size in hex, the chunk.
_CHUNK = b"%x\r\n%b\r\n"
# A header field of a response's head, from its (name, value).
_FIELD = b": ".join


def _framed(chunks: list[bytes]) -> bytes:
    """``chunks`` as chunks of a chunked body, in one bytes."""
    if len(chunks) == 1:  # nearly always: an engine's read is mostly one event
        chunk = chunks[0]
        return _CHUNK % (len(chunk), chunk)
    return b"".join([_CHUNK % (len(chunk), chunk) for chunk in chunks])


class CallbackRoutes(Protocol):
    """An app (ASGI, called for everything else) that serves some requests from the
    connection's callbacks, with no task: a ``POST`` to one of ``callback_paths`` (the
    request target as sent: no query, no escapes) is held by the server until its body is
    in (unless it is large), then handed to ``serve_now``. No ASGI scope is made for it
    unless it goes to the app."""

    callback_paths: frozenset[bytes]

    def serve_now(self, path: bytes, headers: dict[bytes, bytes], body: bytearray,
                  writer: BodyWriter, fall_back: Callable[[dict | None], None]) -> bool:
        """Serve the request through ``writer`` (``start``, ``sink``, ``finish``), from
        callbacks; False to have it served as any other, through the ASGI app, now. Once
        it said True, ``fall_back(extensions)`` still hands it to the app, with
        ``extensions`` (if any) added to its scope's, as long as nothing of the answer was
        written. ``fall_back`` holds the request's state (the writer holds it only
        weakly): keep it until the answer is over. ``headers`` are by name, in lower case
        (of a name sent more than once, the last); ``body`` is the server's own buffer:
        read, never changed."""


class ChunkTap(Protocol):
    """What sees a relayed stream's chunks on their way (the gateway's token count): each
    read's chunks are appended to ``pending``, and ``settle`` is called once
    ``settle_bytes`` more were written, so that what ``pending`` holds stays bounded."""

    pending: list[bytes]
    settle_bytes: int

    def settle(self) -> None:
        """Take in what ``pending`` holds, and empty it."""


# With no tap, the kept list is emptied this often.
_UNTAPPED_SETTLE_BYTES = 64 * 1024


class BodyWriter:
    """Writes the chunks of one request's streamed response body straight to the client's
    connection, from any callback: the gateway hands each chunk of an engine's stream over
    from the engine connection's own callback, with no task woken and no ``send`` awaited
    per chunk (bench/README.md has what that saves). And joins what ``send`` writes, so
    that a response's head and body leave in one packet. Offered to the app as the ASGI
    extension BODY_WRITER.

    ``write`` (and ``sink``, and ``relay``, which hands out the connection's own write for
    bytes already framed as chunks) is for a chunked response only, between its start and
    its end: each sent through ``send``, or written with ``start`` and ``finish`` (or
    ``end_relayed``), which keep uvicorn's account of the response as ``send`` does
    (keep-alive, the next pipelined request)."""

    __slots__ = ("_callbacks", "_cycle", "_flow", "_held", "_last", "_on_gone", "_protocol",
                 "_streaming", "_transport")

    def __init__(self, protocol: BoundedHeadProtocol, cycle: RequestResponseCycle | _Light):
        self._protocol: BoundedHeadProtocol | None = protocol  # None once the client left
        # Weakly: the cycle holds the scope, which holds this writer. A strong reference
        # back would leave every request a reference cycle for the cyclic collector, which
        # then ran every 1,300 or so requests for 5-7 ms, every request in flight waiting.
        # The cycle lives as long as its request's task, which is as long as anyone writes.
        self._cycle = weakref.ref(cycle)
        # The connection's own, for ``write`` (``cycle.transport`` is ours while held).
        self._transport = cycle.transport
        self._flow = cycle.flow
        self._held: _Held | None = None
        self._on_gone: Callable[[], None] | None = None
        # The response was seen started and chunked: later writes skip asking the cycle.
        self._streaming = False
        # The connection's callbacks it set (``when_writable``, ``relay``): taken back
        # when the response is over, if still there.
        self._callbacks: tuple[Callable[[], None], ...] = ()
        self._last = b""  # the body's last part written by ``write`` or a sink

    @property
    def client_host(self) -> str | None:
        """The client's address as the connection has it (None once it left)."""
        protocol = self._protocol
        client = protocol.client if protocol is not None else None
        return client[0] if client else None

    @property
    def last_part(self) -> bytes:
        """The last part of a chunked body that ``write`` or a ``sink`` wrote (``b""``
        before any): where the body stopped, for a caller that would add to it."""
        return self._last

    @property
    def connection_memo(self) -> dict:
        """A dict that lives as long as the client's connection, for what an app would
        rather work out once a connection than once a request (keyed by names of its
        own); a new one, kept nowhere, once the connection is gone."""
        protocol = self._protocol
        return {} if protocol is None else protocol.memo

    @property
    def disconnected(self) -> bool:
        """The client's connection was lost before the response was complete."""
        cycle = self._cycle()
        return cycle is not None and cycle.disconnected

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (from the event loop) if the client's connection is lost
        before the response is complete; None takes it back. What ``receive`` would say
        with ``http.disconnect``, without a task waiting on it. Not called for a loss
        before this: ask ``disconnected`` first."""
        self._on_gone = callback

    @property
    def complete(self) -> bool:
        """The response was written to its end (or its request is long gone)."""
        cycle = self._cycle()
        return cycle is None or cycle.response_complete

    def _connection_lost(self) -> None:
        self._protocol = None
        cycle = self._cycle()
        if cycle is not None and not cycle.response_complete and not cycle.disconnected:
            # uvicorn says so only to the connection's latest request; under pipelining
            # this one may be an earlier one, still answering.
            cycle.disconnected = True
            cycle.message_event.set()
        callback = self._on_gone
        if callback is not None and self.disconnected:
            self._on_gone = None
            callback()

    def hold(self) -> None:
        """Keep what ``send`` writes (a response's head, a whole answer's body) until the
        next ``write`` or ``release``, so that it leaves in one packet: the client is
        woken once, not once per part. ``release`` must follow, whatever happens."""
        if self._held is None:
            cycle = self._cycle()
            self._held = _Held(cycle.transport)
            cycle.transport = self._held  # what uvicorn's send writes to

    def release(self) -> None:
        """Write what ``hold`` kept, if anything is still kept."""
        held = self._held
        if held is not None:
            self._held = None
            cycle = self._cycle()
            if cycle is not None:
                cycle.transport = held.transport
                if held.parts and not (cycle.disconnected or held.transport.is_closing()):
                    held.transport.write(b"".join(held.parts))

    def start(self, status: int, headers: list[tuple[bytes, bytes]],
              length: int | None = None, then: bytes = b"") -> None:
        """What ``send`` does with an ``http.response.start``, at once, for a caller with no
        task to await it in: the head with ``headers`` (names in lower case, and no CR or
        LF in them: llmgw's own, or an engine's as httptools parsed them; no length or
        framing), a body of ``length`` bytes, or chunked when ``length`` is None. Nothing
        once the client is gone. ``finish`` ends the response. ``then``, the first bytes of
        the body as they go on the wire (framed already, if chunked), leaves in the same
        write as the head."""
        cycle = self._cycle()
        if cycle is None or cycle.disconnected:
            return
        if cycle.response_started:
            raise RuntimeError("BodyWriter.start on a response already started")
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        # Each ``name: value``, joined in C, not a loop in Python.
        fields = b"\r\n".join(map(_FIELD, (*cycle.default_headers, *headers)))
        if length is None:
            cycle.chunked_encoding = True
            cycle.expected_content_length = 0
            framing = b"transfer-encoding: chunked\r\n"
        else:
            cycle.chunked_encoding = False
            cycle.expected_content_length = length
            framing = b"content-length: %d\r\n" % length
        cycle.transport.write(b"".join((
            STATUS_LINE[status], fields, b"\r\n" if fields else b"", framing,
            b"" if cycle.keep_alive else b"connection: close\r\n", b"\r\n", then)))

    def finish(self, body: bytes = b"") -> None:
        """What ``send`` does with the last ``http.response.body``, at once: ``body`` (the
        whole body of a response with a length; the last chunk, if any, of a chunked
        one), then the response is complete and the connection serves its next request
        (or closes, when not kept alive)."""
        cycle = self._cycle()
        if cycle is None or cycle.disconnected or cycle.response_complete:
            return
        if cycle.chunked_encoding:
            body = (_CHUNK % (len(body), body) if body else b"") + b"0\r\n\r\n"
        elif len(body) != cycle.expected_content_length:
            raise RuntimeError("BodyWriter.finish with a body not of the length sent")
        cycle.transport.write(body)
        self._complete(cycle)

    def end_relayed(self) -> None:
        """``finish`` for a body ``relay``ed to its end, last chunk and all: the response is
        complete, nothing more is written."""
        cycle = self._cycle()
        if cycle is not None and not cycle.disconnected and not cycle.response_complete:
            self._complete(cycle)

    def cut(self) -> None:
        """End a chunked body that stopped where nothing of ours may follow (inside a
        relayed chunk, inside an event of a stream): the connection is closed once what
        was written has gone, and the client sees the body end before its last chunk, as
        a broken response. Nothing more is written; for uvicorn, as if the client left
        (an app's task that returns after this is not an error)."""
        self._take_back_callbacks()
        cycle = self._cycle()
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
            cycle.disconnected = True
            self._transport.close()

    def _complete(self, cycle: RequestResponseCycle | _Light) -> None:
        self._take_back_callbacks()
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()

    def served(self) -> None:
        """The request was served with no task (``start``, ``finish``), or its client left:
        what the end of uvicorn's task would do. It lets go of the connection's callback
        that the request's cycle holds, which would otherwise keep the connection and the
        cycle in a reference cycle for the cyclic collector."""
        cycle = self._cycle()
        if cycle is not None:
            cycle.on_response = nothing

    def write(self, chunk: bytes) -> bool:
        """Write ``chunk`` (not empty) as one chunk of the body. False when the client takes
        no more for now: its connection's buffer is full (``when_writable`` says when it
        drains) or it is gone (the app learns that from ``receive``)."""
        self._last = chunk
        return self._write_framed(_CHUNK % (len(chunk), chunk))

    def _write_framed(self, data: bytes) -> bool:
        """``write`` of bytes already framed as chunks."""
        if not self._streaming:
            # Once per response (the cycle is asked here, not per chunk: this runs for
            # every chunk of every stream).
            cycle = self._cycle()
            if cycle is None or not cycle.chunked_encoding or cycle.response_complete:
                raise RuntimeError("BodyWriter.write outside a started chunked response")
            self._streaming = True
        if self._transport.is_closing():
            # The client is gone (asked of the transport, not of the cycle: a loss reaches
            # only the connection's latest request, which under HTTP pipelining may not
            # be the one writing).
            return False
        if self._held is None:
            self._transport.write(data)
        else:
            self._held.parts.append(data)
            self.release()
        # (A write never loses the connection there and then: uvloop reports it later.)
        return not self._flow.write_paused

    def sink(self, resume: Callable[[], None], on_first: Callable[[], None],
             tap: ChunkTap | None = None) -> Callable[[list[bytes]], bool]:
        """A function for an upstream ``Answer.pipe`` to hand a stream's chunks to, in the
        started chunked response, a list at a time (what one read from the engine
        brought): the chunks go to ``tap`` (if any, settled every ``tap.settle_bytes``), then
        are written as ``write`` does, all in one write. It returns False when the client
        takes no more for now, and then calls ``resume`` once the client's connection
        drains. ``on_first`` is called before the first chunk.

        ``write``, unrolled: this runs for every read of every stream. One write for what
        one read brought: an engine a little ahead of the gateway sends two or three
        events a read, and a socket write costs more than the rest of relaying them."""
        cycle = self._cycle()
        if cycle is None or not cycle.chunked_encoding or cycle.response_complete:
            raise RuntimeError("BodyWriter.sink outside a started chunked response")
        self._streaming = True
        transport, flow = self._transport, self._flow
        write, closing = transport.write, transport.is_closing
        if tap is not None:
            keep, settle, every = tap.pending.extend, tap.settle, tap.settle_bytes
        else:
            kept: list[bytes] = []  # nobody reads it: emptied as a tap's would be
            keep, settle, every = kept.extend, kept.clear, _UNTAPPED_SETTLE_BYTES
        first = True
        # Bytes written until the tap's chunks are settled (the first read starts it).
        budget = 0

        def sink(chunks: list[bytes]) -> bool:
            nonlocal budget, first
            keep(chunks)
            self._last = chunks[-1]
            if len(chunks) == 1:  # _framed's common case, without its call
                chunk = chunks[0]
                data = _CHUNK % (size := len(chunk), chunk)
            else:
                data = _framed(chunks)
                size = len(data)
            budget -= size
            if budget < 0:
                # Once ``every`` bytes were written since the last settle; and at the first
                # read, which waits in ``pending`` like any other.
                if not first:
                    settle()
                    budget = every
                else:
                    first = False
                    budget += every
                    if budget < 0:
                        settle()
                        budget = every
                    on_first()
                    if self._write_framed(data):  # with a held head, if any
                        return True
                    self.when_writable(resume)
                    return False
            if closing():
                return False  # the client is gone, as ``write`` says
            write(data)
            if not flow.write_paused:
                return True
            self.when_writable(resume)
            return False

        return sink

    def relay(self, early: bytes, pause: Callable[[], None], resume: Callable[[], None]
              ) -> Callable[[bytes], object]:
        """For a chunked body relayed as its source framed it, in the started chunked
        response: writes ``early``, the body's first bytes (maybe none; with a held head,
        if any), and returns the function that writes the rest, the connection's own
        write, for the source's callback to call with each read as it came: no Python
        call of ours between the two sockets. While the client takes no more, ``pause``
        is called, then ``resume`` once its connection drained. Ended with ``end_relayed``
        (the source's end was relayed), ``finish`` (at a chunk's end) or ``cut``."""
        cycle = self._cycle()
        if cycle is None or not cycle.chunked_encoding or cycle.response_complete:
            raise RuntimeError("BodyWriter.relay outside a started chunked response")
        self._streaming = True
        protocol = self._protocol

        def full() -> None:
            pause()
            self.when_writable(resume)

        if protocol is not None:
            protocol._on_full = full  # from the write that fills the client's buffer
            self._callbacks += (full,)
        if early:
            self._write_framed(early)
        else:
            self.release()
        if self._flow.write_paused and protocol is not None:
            full()  # full before this write, or by it
        return self._transport.write

    def _take_back_callbacks(self) -> None:
        """The response is over: the connection's callbacks this writer set are taken back
        (a later request on the connection, pipelined or kept alive, must not pause or
        resume this one's engine)."""
        protocol, mine = self._protocol, self._callbacks
        if protocol is not None and mine:
            if protocol._on_full in mine:
                protocol._on_full = None
            if protocol._on_writable in mine:
                protocol._on_writable = None
        self._callbacks = ()

    def when_writable(self, callback: Callable[[], None]) -> None:
        """After ``write`` said False: call ``callback`` once, when the client's connection
        has drained (never, if the client is gone)."""
        if self._protocol is not None:
            self._protocol._on_writable = callback
            if callback not in self._callbacks:  # a sink's resume, each time it is full
                self._callbacks += (callback,)


def nothing() -> None:
    pass


class _Held:
    """Stands in for a client's transport while BodyWriter.hold keeps what is written."""

    __slots__ = ("parts", "transport")

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        # uvicorn's send closes the connection after the last body of a response that
        # does not keep it alive: what was kept goes first.
        if self.parts:
            self.transport.write(b"".join(self.parts))
            self.parts.clear()
        self.transport.close()


