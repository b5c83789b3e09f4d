"""The HTTP server for ``/v1``, the admin API and the page: uvicorn, in the server's own
event loop (uvloop), parsing with httptools.

Why uvicorn is the default and not granian (``listen.server``, docs/gateway.md): the
gateway's cost per request is mostly the server around it. granian does its I/O on its own
threads and hands each request, each body and each streamed chunk to the Python event loop
across threads; uvicorn parses and writes in the loop's thread, so a proxied request is a
few callbacks and two socket writes (bench/README.md has the figures).

What uvicorn leaves to us, done here: a request's head bounded in size and in time (its
httptools protocol keeps every header line it is sent, and waits for ever), a restart that
resets no request already sent, TLS 1.3 only, no ``server`` header, forwarding headers
never trusted, and signals left to ``llmgw server``. And two things added: a BodyWriter
per request, through which the gateway writes a stream's chunks from the engine
connection's callback instead of awaiting ``send`` for each; and requests that the app
serves from callbacks with no task at all (CallbackRoutes: the gateway's hot streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    HttpToolsProtocol,
    RequestResponseCycle,
)

from llmgw.transport.writer import BODY_WRITER, BodyWriter, nothing

log = logging.getLogger(__name__)


MAX_HEAD_BYTES = 64 * 1024
# From a connection's start, or a request's first byte, to the end of its headers.
HEAD_TIMEOUT_S = 30.0
# Once stopping, how long requests in flight (a stream, say) may take to finish.
GRACEFUL_STOP_S = 10
# Once stopping, how long a kept-alive connection may stay idle for its client's next
# request, which it is then answered and closed after (a paced client sends within this).
STOP_IDLE_GRACE_S = 0.5
# The ASGI extension (``scope["extensions"]``) that offers a request's BodyWriter.
class _NoEvent:
    """What a request served from callbacks has for uvicorn's ``message_event``: nobody
    waits on it."""

    __slots__ = ()

    def set(self) -> None:
        pass


class _Light:
    """A request held for CallbackRoutes.serve_now, in place of uvicorn's
    RequestResponseCycle: the state of it that BodyWriter and the protocol use, and no
    ASGI scope, ``asyncio.Event`` or the rest, which are made only if the request goes to
    the app (BoundedHeadProtocol._to_app)."""

    __slots__ = ("__weakref__", "body", "chunked_encoding", "default_headers",
                 "disconnected", "expected_content_length", "fields", "flow", "headers",
                 "keep_alive", "more_body", "on_response", "path", "response_complete",
                 "response_started", "transport", "waiting_for_100_continue", "writer")

    message_event = _NoEvent()

    def __init__(self, protocol: BoundedHeadProtocol, path: bytes,
                 fields: dict[bytes, bytes], keep_alive: bool):
        self.path = path
        self.headers = protocol.headers
        self.fields = fields  # the headers by name, for serve_now
        self.transport = protocol.transport
        self.flow = protocol.flow
        self.default_headers = protocol.server_state.default_headers
        self.keep_alive = keep_alive
        self.on_response = protocol.on_response_complete
        self.body = bytearray()
        self.more_body = True
        self.disconnected = self.response_started = self.response_complete = False
        self.waiting_for_100_continue = self.chunked_encoding = False
        self.expected_content_length = 0
        self.writer: BodyWriter | None = None


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request head bounded: over MAX_HEAD_BYTES it is
    refused with 431, and a head not complete within HEAD_TIMEOUT_S of the connection's
    start (or of its first byte, on a kept-alive connection) with 408. Otherwise a client
    could hold memory with endless header lines, or a connection with a head it never
    finishes. And a stop does not reset a connection whose next request may be on its way.

    Each request is offered a BodyWriter (above). A ``POST`` to one of the
    ``callback_paths`` of an app that is CallbackRoutes is held, as a ``_Light`` in place
    of uvicorn's request cycle and with no ASGI scope, until its body is in, then offered
    to the app's ``serve_now``; it goes to the app's ASGI task (``_to_app``) only if that
    declines (or hands it back), if its body is too large to hold, if its client waits
    for ``100 Continue``, or if it is pipelined behind a request still answering.

    It overrides parser callbacks (``on_message_begin``, which makes no scope, and
    ``on_header`` whole; ``on_headers_complete``, ``on_body`` and ``on_message_complete``
    around uvicorn's) and nine methods of uvicorn 0.54's protocol (pinned in
    pyproject.toml): ``data_received``, ``send_400_response``, which it calls on a parser
    error, ``shutdown``, ``pause_writing`` and ``resume_writing`` (after uvicorn's), the
    connection callbacks, and (to time the keep-alive limit with one timer per connection)
    ``on_response_complete`` and ``_unset_keepalive_if_required``; it makes the scope
    uvicorn's ``on_message_begin`` would (``_scope``); BodyWriter reads its request
    cycle's response state and writes as its ``send`` does (``start`` and ``finish`` do
    what ``send`` does). tests/integration/test_http_server.py fails if an upgrade changes
    them."""

    _head_timer: asyncio.TimerHandle | None = None
    _in_head = False
    _head_bytes = 0
    _head_refused: bytes | None = None
    _requests = 0
    _last_request = False
    _on_writable: Callable[[], None] | None = None
    # Called when the client's connection stops taking writes: a relay's (BodyWriter.relay).
    _on_full: Callable[[], None] | None = None
    _writer: BodyWriter | None = None  # the latest request's
    # Those of earlier requests still answering (HTTP pipelining), kept to be told of a loss.
    _earlier: tuple[BodyWriter, ...] = ()
    # The app's CallbackRoutes.callback_paths, if it has any.
    _callback_paths: frozenset[bytes] = frozenset()
    # A request held for the app's ``serve_now`` while its body comes.
    _deferred: _Light | None = None
    # Kept-alive and waiting for a request since this loop time; None while one is served.
    _idle_since: float | None = None
    _keep_alive_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.memo: dict = {}  # BodyWriter.connection_memo
        self._callback_paths = getattr(self.app, "callback_paths", frozenset())
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _scope(self, headers: list[tuple[bytes, bytes]]) -> dict:
        """A request's scope as uvicorn's ``on_message_begin`` makes it, less what its
        ``on_headers_complete`` adds: made only for a request that goes to the app."""
        return {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": headers,
            "state": self.app_state.copy(),
        }

    def _to_app(self, light: _Light, extensions: dict | None = None) -> None:
        """A request held for ``serve_now`` goes to the app's task, as uvicorn would have
        sent it (nothing of its answer was written), with ``extensions`` in its scope."""
        scope = self._scope(light.headers)
        path = light.path.decode("ascii")  # a callback path: no escapes, no query
        scope.update(method="POST", path=self.root_path + path,
                     raw_path=self.root_path.encode("ascii") + light.path, query_string=b"")
        cycle = RequestResponseCycle(
            scope=scope, transport=self.transport, flow=self.flow, logger=self.logger,
            access_logger=self.access_logger, access_log=self.access_log,
            default_headers=light.default_headers, message_event=asyncio.Event(),
            expect_100_continue=False, keep_alive=light.keep_alive,
            on_response=self.on_response_complete)
        cycle.body, cycle.more_body = light.body, light.more_body
        cycle.disconnected = light.disconnected
        cycle.message_event.set()  # what came of the body is there to be received
        writer = BodyWriter(self, cycle)
        scope["extensions"] = {BODY_WRITER: writer, **(extensions or {})}
        # The light one is done with: the protocol now knows the request by its cycle.
        light.on_response = nothing
        light.response_complete = True
        if self.cycle is light:
            self.cycle = cycle
        if self._writer is light.writer:
            self._writer = writer
        else:  # pipelined behind since
            self._earlier = tuple(writer if w is light.writer else w for w in self._earlier)
        HttpToolsProtocol._start_asgi_task(self, cycle, self.app)

    def on_body(self, body: bytes) -> None:
        light = self._deferred
        if light is None:
            super().on_body(body)
            return
        light.body += body
        if len(light.body) > HIGH_WATER_LIMIT:
            # Too large to be kept whole before it is served: served as any other, its
            # body read as the app's task takes it (uvicorn's on_body, from here).
            self._deferred = None
            self.flow.pause_reading()
            self._to_app(light)

    def on_message_complete(self) -> None:
        light = self._deferred
        if light is None:
            super().on_message_complete()
            return
        self._deferred = None
        light.more_body = False
        try:
            # The body as it was received (a bytearray): copied only for a request the
            # app's task serves.
            taken = self.app.serve_now(light.path, light.fields, light.body, light.writer,
                                       functools.partial(self._to_app, light))
        except Exception:
            # Where it failed is not known: the client is not answered twice.
            log.exception("unexpected error serving POST %s", light.path.decode("ascii"))
            self.transport.close()
            return
        if not taken:
            self._to_app(light)

    def connection_lost(self, exc: Exception | None) -> None:
        # Not kept for the cyclic collector to find: it may hold a client's API key.
        self.memo.clear()
        if self._deferred is not None:  # its body never came whole: nobody serves it
            self._deferred.on_response = nothing
            self._deferred = None
        self._stop_head_timer()
        if self._keep_alive_timer is not None:
            self._keep_alive_timer.cancel()
            self._keep_alive_timer = None
        self._on_writable = self._on_full = None
        super().connection_lost(exc)
        writers = (*self._earlier, self._writer)
        self._writer, self._earlier = None, ()
        for writer in writers:
            if writer is not None:
                writer._connection_lost()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._on_full is not None:
            self._on_full()

    def resume_writing(self) -> None:
        super().resume_writing()
        callback, self._on_writable = self._on_writable, None
        if callback is not None:
            callback()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            # A head that did not come whole, bounded by what came of it: of the read it
            # began in (-1: that read may hold requests before it), its lines so far; each
            # read after that, whole.
            if self._head_bytes < 0:
                self._head_bytes = self._head_size()
            else:
                self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.transport.write(_head_too_large())
                self.transport.close()
                return
            if self._head_timer is None:
                # From here it has HEAD_TIMEOUT_S to finish. (A head that comes in one
                # packet, as most do, never pays for a timer.)
                self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S,
                                                        self._head_timed_out)

    def on_message_begin(self) -> None:
        # uvicorn's, but for the scope, made once the request is known to need one.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._head_bytes = -1  # began in this read
        self._in_head = True

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, less the ``expect`` it looks for in every line (see
        # on_headers_complete): this runs for each of a request's ten or so lines.
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        headers = self.headers
        # Bounded by its size once whole; a head still coming, as it comes (data_received).
        if self._head_size() > MAX_HEAD_BYTES:
            self._head_refused = _head_too_large()
            # Stops the parser; data_received answers through send_400_response below.
            raise httptools.HttpParserCallbackError("request head too large")
        fields = dict(headers)  # built in C; what serve_now is given
        if b"expect" in fields:  # every such line, then
            self.expect_100_continue = any(
                name == b"expect" and value.lower() == b"100-continue"
                for name, value in headers)
        self._stop_head_timer()
        self._requests += 1
        url, parser, cycle = self.url, self.parser, self.cycle
        if (url in self._callback_paths and parser.get_method() == b"POST"
                and not self.expect_100_continue and parser.get_http_version() == "1.1"
                and not parser.should_upgrade()
                and (cycle is None or cycle.response_complete)):
            # Held for the app's serve_now (CallbackRoutes) until its body is in.
            light = self._deferred = _Light(self, url, fields, parser.should_keep_alive()
                                            and not self._last_request)
            # A trailer after a chunked body is not merged into the request's headers:
            # serve_now and the app, if it is handed back, see the head's alone (RFC 9110
            # 6.5.1; the task path reads its headers before the body, so none either).
            self.headers = []
            self.cycle = light
            # An earlier request's scope (its BodyWriter holds this protocol) is not kept.
            self.scope = None
            light.writer = self._new_writer(light)
            return
        self.scope = self._scope(self.headers)
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return  # a WebSocket upgrade: no cycle was made for it
        if self._last_request:
            cycle.keep_alive = False
        # Read by the app once its task runs, which is after this callback.
        cycle.scope["extensions"] = {BODY_WRITER: self._new_writer(cycle)}

    def _head_size(self) -> int:
        """The size of the request head parsed so far: its target and its lines' parts,
        "name: value\r\n" each, counted in C."""
        headers = self.headers
        return len(self.url) + sum(map(len, chain.from_iterable(headers))) + 4 * len(headers)

    def _new_writer(self, cycle: RequestResponseCycle | _Light) -> BodyWriter:
        """The request's BodyWriter, as the connection's latest."""
        if self._writer is not None and not self._writer.complete:
            # Pipelined behind a request still answering, which must hear of a loss too.
            self._earlier = (*self._earlier, self._writer)
        self._writer = writer = BodyWriter(self, cycle)
        return writer

    def on_response_complete(self) -> None:
        # uvicorn's, but for how the keep-alive limit is timed. uvicorn makes a timer after
        # every response and cancels it at the next request's first bytes: a few µs per
        # request. Here one timer is kept per connection: when it fires on a connection
        # that was busy since, it is set again for the rest of the limit, or left to the
        # next response if one is being served.
        self.server_state.total_requests += 1
        if self._earlier:
            self._earlier = tuple(w for w in self._earlier if not w.complete)
        if self.transport.is_closing():
            return
        if self.flow.read_paused:
            self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self._keep_alive_timer is None:
            self._keep_alive_timer = self.loop.call_later(self.timeout_keep_alive,
                                                          self._keep_alive_due)

    def _unset_keepalive_if_required(self) -> None:
        # Called by uvicorn for every packet received, and on a clean close.
        self._idle_since = None

    def _keep_alive_due(self) -> None:
        self._keep_alive_timer = None
        if self._idle_since is None:
            return  # serving: its response sets the timer again
        limit = STOP_IDLE_GRACE_S if self._last_request else self.timeout_keep_alive
        left = self._idle_since + limit - self.loop.time()
        if left > 0.001:
            self._keep_alive_timer = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()

    def shutdown(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            super().shutdown()  # answering: closed once its response is out
            return
        idle = self._idle_since
        if idle is not None and self.loop.time() - idle >= STOP_IDLE_GRACE_S:
            super().shutdown()  # idle for a while: closed now
            return
        # Between requests with the next one on its way (its first bytes in, or none yet
        # on a new connection), or kept-alive and idle only a moment, its client perhaps
        # sending now: closing would reset a request the client already sent, which a
        # restart on a socket systemd holds must not do. Its next request is served and
        # the connection closed after it; an idle one is closed once STOP_IDLE_GRACE_S
        # have passed with nothing sent, and the head timeout and the graceful stop's
        # limit bound the rest.
        self._last_request = True
        if idle is not None:
            if self._keep_alive_timer is not None:
                self._keep_alive_timer.cancel()
            self._keep_alive_timer = self.loop.call_later(
                idle + STOP_IDLE_GRACE_S - self.loop.time(), self._keep_alive_due)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.write(_refusal(
                b"408 Request Timeout",
                f"the request's headers did not arrive within {HEAD_TIMEOUT_S:g} s"))
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if self._head_refused is None:
            return super().send_400_response(msg)
        self.transport.write(self._head_refused)
        self.transport.close()


def _head_too_large() -> bytes:
    return _refusal(b"431 Request Header Fields Too Large",
                    f"the request line and headers are over {MAX_HEAD_BYTES // 1024} KiB; "
                    "send fewer or shorter headers")


def _refusal(status: bytes, reason: str) -> bytes:
    body = reason.encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


class Server(uvicorn.Server):
    """uvicorn's server, stopped by ``llmgw server``'s own signal handlers (``stop``).

    And woken once a second while it serves, not ten times: uvicorn's ``main_loop`` wakes
    every 0.1 s to see whether it should stop, which is most of an idle server's CPU.
    Here ``stop`` wakes it, and the second's tick keeps the ``date`` header current and
    notices a stop asked for some other way (uvicorn's own ``should_exit``)."""

    _wake: asyncio.Event | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn would take SIGINT/SIGTERM and raise them again once stopped.
        yield

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        # on_tick with a count of 0 sets the date header, then says whether to stop.
        while not await self.on_tick(0):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._wake.wait()

    def stop(self) -> None:
        """Stop taking requests and finish those in flight; a second call stops at once."""
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        if self._wake is not None:
            self._wake.set()


def _tls_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cert_file, key_file)
    context.set_alpn_protocols(["http/1.1"])
    return context


def make_server(app: Any, sock: socket.socket, tls: tuple[Path, Path] | None = None
                ) -> Server:
    """A server for ``app`` on the listening ``sock``; over TLS with ``(cert, key)``."""
    host, port = sock.getsockname()[:2]
    # uvicorn's "Started server process" and such: llmgw logs its own; and never each
    # WebSocket frame in hex, which is what its debug level adds.
    debug = logging.getLogger().level <= logging.DEBUG
    logging.getLogger("uvicorn.error").setLevel(logging.INFO if debug else logging.WARNING)
    config = uvicorn.Config(
        app, host=host, port=port, loop="none", http=BoundedHeadProtocol,
        ws="websockets-sansio", lifespan="on", log_config=None, access_log=False,
        server_header=False, proxy_headers=False,
        timeout_graceful_shutdown=GRACEFUL_STOP_S,
        ssl_context_factory=(lambda _config, _default: _tls_context(*tls)) if tls else None,
    )
    return Server(config)
