"""The HTTP server around the app (llmgw.transport.server): what it adds to uvicorn, on loopback.

A small ASGI app that echoes what the server told it, served by ``make_server`` on a
socket bound here, reached by raw sockets and aiohttp: the head limit, TLS 1.3 only,
forwarding headers not trusted, no ``server`` header, the two-step stop, and a body
written through the BodyWriter to a client slower than the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import ssl
import threading
import time
from pathlib import Path

import aiohttp
import pytest
import uvicorn.server
import yarl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from llmgw.config import Listen
from llmgw.core.usage import SETTLE_BYTES, StreamUsage, Usage
from llmgw.server.listen import listening_socket
from llmgw.transport import server as http_server
from llmgw.transport.server import (
    GRACEFUL_STOP_S,
    MAX_HEAD_BYTES,
    STOP_IDLE_GRACE_S,
    make_server,
)
from llmgw.transport.writer import BODY_WRITER, BodyWriter

CHUNK = 2**16


async def _echo(scope, receive, send, running: _Running) -> None:
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"].startswith("/slow/"):  # /slow/SECONDS
        running.slow_started.set()
        await asyncio.sleep(float(scope["path"].rsplit("/", 1)[1]))
    if scope["path"].startswith(("/written/", "/sunk/", "/relayed/")):  # /WAY/CHUNKS
        way, chunks = scope["path"][1:].split("/")
        return await _written(scope, send, int(chunks), running, way)
    body = json.dumps({"client": scope["client"][0], "scheme": scope["scheme"]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def _written(scope, send, chunks: int, running: _Running, way: str) -> None:
    """``chunks`` chunks of CHUNK bytes (chunk i all bytes i % 251) written through the
    BodyWriter from loop callbacks, as the gateway does, waiting whenever it says full:
    with ``write``; or ("sunk") through the function ``sink`` makes, as the gateway's
    pipe does, one or (every third call) two chunks a call, as one read from an engine
    brings, each also handed to a stream's usage reader (``running.tap``); or
    ("relayed") framed already, with the write ``relay`` gives, and the end with them,
    waiting whenever it calls its ``pause``."""
    sunk, relayed = way == "sunk", way == "relayed"
    writer = scope["extensions"][BODY_WRITER]
    writer.hold()  # the head leaves with the first chunk
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/octet-stream")]})
    done = asyncio.Event()
    written = 0

    full = False

    def pause() -> None:
        nonlocal full
        if done.is_set():
            running.late_pauses += 1  # a later response filled the connection
            return
        full = True
        running.full.set()
        running.resumed -= 1

    def pump() -> None:
        nonlocal written, full
        while relayed:
            full = False
            while written < chunks and not full:
                written += 1
                relay(b"%x\r\n%b\r\n" % (CHUNK, bytes([(written - 1) % 251]) * CHUNK))
            if full:
                return
            relay(b"0\r\n\r\n")
            writer.end_relayed()
            done.set()
            return
        while written < chunks:
            written += 1
            chunk = bytes([(written - 1) % 251]) * CHUNK
            if sunk:
                batch = [chunk]
                if written % 3 == 0 and written < chunks:
                    written += 1
                    batch.append(bytes([(written - 1) % 251]) * CHUNK)
            if not (sink(batch) if sunk else writer.write(chunk)):
                running.full.set()
                running.resumed -= 1  # counted back when the writer calls pump again
                if not sunk:
                    writer.when_writable(resumed)  # the sink arranged it itself
                return
        done.set()

    def resumed() -> None:
        running.resumed += 1
        pump()

    def first() -> None:
        assert not running.tap.settled, "on_first after a chunk"
        running.firsts += 1

    if sunk:
        sink = writer.sink(resumed, first, running.tap)
    if relayed:
        relay = writer.relay(b"", pause, resumed)
    pump()
    await done.wait()
    if not relayed:  # else ended with the relayed bytes
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Tap:
    """A ChunkTap, as the gateway's usage reader (``StreamUsage``) is one: keeps what a
    sink hands it, and the most that waited in ``pending`` before a ``settle``."""

    settle_bytes = SETTLE_BYTES

    def __init__(self) -> None:
        self.pending: list[bytes] = []
        self.settled: list[bytes] = []
        self.most_waiting = 0

    def settle(self) -> None:
        self.most_waiting = max(self.most_waiting, sum(map(len, self.pending)))
        self.settled += self.pending
        self.pending.clear()


class _Running:
    def __init__(self, tls: tuple[Path, Path] | None = None):
        self.sock, _ = listening_socket(Listen(host="127.0.0.1", port=0))
        self.port = self.sock.getsockname()[1]
        self.slow_started = asyncio.Event()
        self.full = asyncio.Event()  # a BodyWriter said the client's connection was full
        self.resumed = 0  # when_writable calls not yet called back, negated
        self.tap = _Tap()  # what a sink handed on for a stream's usage
        self.firsts = 0  # a sink's on_first calls
        self.late_pauses = 0  # a relay's pause called once its response was over

        async def app(scope, receive, send) -> None:
            await _echo(scope, receive, send, self)

        self.server = make_server(app, self.sock, tls)
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> _Running:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        await _until(lambda: self.server.started or self.task.done(), "the server to start")
        assert not self.task.done(), self.task.exception()
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.task.done():
            self.server.stop()
            await asyncio.wait_for(self.task, 15)

    async def slow_request(self, http: aiohttp.ClientSession, seconds: float) -> asyncio.Task:
        """A request the app is busy with for ``seconds``, once it has started on it."""
        request = asyncio.create_task(http.get(f"http://127.0.0.1:{self.port}/slow/{seconds}"))
        await asyncio.wait_for(self.slow_started.wait(), 5)
        return request


async def _until(predicate, what: str, timeout_s: float = 5.0) -> None:
    """Poll uvicorn's own state, which offers no event to wait on."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"waited {timeout_s} s for {what}"
        await asyncio.sleep(0.01)


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer


async def test_a_head_over_the_limit_is_refused_with_431_and_a_reason():
    async with _Running() as running:
        padding = b"".join(b"x-pad-%d: %s\r\n" % (i, b"a" * 1000)
                           for i in range(MAX_HEAD_BYTES // 1000 + 2))
        answer = await asyncio.to_thread(
            _raw, running.port, b"GET / HTTP/1.1\r\nhost: x\r\n" + padding + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b"send fewer or shorter headers" in answer
        # A head under the limit is served, and the connection's close did not stop the
        # server.
        padding = b"x-pad: " + b"a" * (MAX_HEAD_BYTES // 2) + b"\r\n"
        answer = await asyncio.to_thread(
            _raw, running.port,
            b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + padding + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def _unfinished_head(port: int) -> bytes:
    """A head that never ends, sent a header line at a time while the server reads: what
    the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        with contextlib.suppress(ConnectionError):  # refused before the last lines
            for i in range(MAX_HEAD_BYTES // 1000 + 8):
                conn.sendall(b"x-pad-%d: %s\r\n" % (i, b"a" * 1000))
        answer = b""
        with contextlib.suppress(ConnectionError):
            while chunk := conn.recv(65536):
                answer += chunk
        return answer


async def test_a_head_that_keeps_coming_is_refused_once_over_the_limit():
    # Not left to the head's timeout (30 s; the socket gives up after 5): the lines
    # already taken are what is bounded.
    async with _Running() as running:
        answer = await asyncio.to_thread(_unfinished_head, running.port)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"send fewer or shorter headers" in answer


@pytest.mark.parametrize("expect", [b"Expect: 100-Continue\r\n",
                                    b"Expect: 100-continue\r\nexpect: other\r\n"],
                         ids=["one line", "and another expect line after it"])
async def test_a_client_that_expects_100_continue_gets_it_before_sending_its_body(expect):
    def exchange(port: int) -> tuple[bytes, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n" + expect +
                         b"content-length: 2\r\nconnection: close\r\n\r\n")
            interim = conn.recv(65536)  # before the body is sent
            conn.sendall(b"{}")
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
            return interim, answer

    async with _Running() as running:
        interim, answer = await asyncio.to_thread(exchange, running.port)
    assert interim.startswith(b"HTTP/1.1 100 Continue\r\n"), interim
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def _silent_then_read(port: int, request: bytes, served: bytes = b"") -> tuple[bytes, float]:
    """Send ``served`` (a whole request) and read its answer, then send ``request`` (a head
    left unfinished, or nothing) and read until the server closes: what it said to that,
    and after how long."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        if served:
            conn.sendall(served)
            answer = b""
            while not answer.endswith(b"\r\n0\r\n\r\n"):
                chunk = conn.recv(65536)
                assert chunk, "closed before answering the first request"
                answer += chunk
        started = time.monotonic()
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer, time.monotonic() - started


HALF_A_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nho"


@pytest.mark.parametrize(("served", "request_sent"), [
    (b"", b""), (b"", HALF_A_HEAD), (b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", HALF_A_HEAD),
], ids=["nothing", "half a head", "half a head after a request on the same connection"])
async def test_a_head_not_finished_in_time_is_refused_with_408(monkeypatch, served,
                                                               request_sent):
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 0.3)
    async with _Running() as running:
        answer, took = await asyncio.to_thread(_silent_then_read, running.port, request_sent,
                                               served)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"did not arrive within 0.3 s" in answer
        assert 0.25 < took < 5
        # A whole request on a new connection is still served.
        answer = await asyncio.to_thread(
            _raw, running.port, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


async def test_no_server_header_and_forwarded_for_is_not_trusted():
    headers = {"x-forwarded-for": "203.0.113.9", "x-forwarded-proto": "https"}
    async with (_Running() as running, aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{running.port}/", headers=headers) as resp):
        assert resp.status == 200
        assert "server" not in resp.headers
        seen = await resp.json()
    # The peer's address, not the header's: metrics and login throttling key on it.
    assert seen == {"client": "127.0.0.1", "scheme": "http"}


async def test_tls_13_is_served_and_tls_12_refused(server_cert):
    ca, cert, key = server_cert
    async with _Running((cert, key)) as running, aiohttp.ClientSession() as http:
        modern = ssl.create_default_context(cafile=ca)
        async with http.get(f"https://127.0.0.1:{running.port}/", ssl=modern) as resp:
            assert resp.status == 200
            assert (await resp.json())["scheme"] == "https"
        old = ssl.create_default_context(cafile=ca)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(aiohttp.ClientConnectorError):
            async with http.get(f"https://127.0.0.1:{running.port}/", ssl=old):
                pass


async def test_stop_lets_a_request_in_flight_finish():
    async with _Running() as running, aiohttp.ClientSession() as http:
        request = await running.slow_request(http, 0.5)
        running.server.stop()
        resp = await request
        assert resp.status == 200  # finished although the server was stopping
        await resp.release()
        await asyncio.wait_for(running.task, 15)


async def test_an_idle_server_ticks_once_a_second_and_a_stop_wakes_it_at_once():
    running = _Running()
    ticks: list[float] = []
    ticked = asyncio.Event()
    on_tick = running.server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(asyncio.get_running_loop().time())
        ticked.set()
        return await on_tick(counter)

    running.server.on_tick = counted
    async with running:
        await asyncio.sleep(2.2)
        # uvicorn's own loop ticks ten times a second (22 here): an idle server's CPU.
        assert 2 <= len(ticks) <= 4, ticks
        ticked.clear()
        await asyncio.wait_for(ticked.wait(), 2)
        # Just after a tick: without a wake, the stop would wait out the second.
        running.server.stop()
        await asyncio.wait_for(running.task, 0.8)


async def test_a_second_stop_does_not_wait_for_requests_in_flight():
    async with _Running() as running, aiohttp.ClientSession() as http:
        request = await running.slow_request(http, 30)
        started = asyncio.get_running_loop().time()
        running.server.stop()
        running.server.stop()
        await asyncio.wait_for(running.task, 15)
        # Had it waited, it would have waited GRACEFUL_STOP_S (10 s) and then cut the
        # request; it stopped at once and left the request running.
        assert asyncio.get_running_loop().time() - started < GRACEFUL_STOP_S / 2
        assert not request.done()
        request.cancel()


async def test_a_connection_accepted_before_a_stop_gets_its_request_served():
    # As under systemd socket activation: a client connected just before the restart sends
    # its request while the old server stops; it must be answered, not reset.
    async with _Running() as running:
        conn = await asyncio.to_thread(socket.create_connection,
                                       ("127.0.0.1", running.port), 5)
        try:
            await _until(lambda: running.server.server_state.connections, "the connection")
            running.server.stop()
            # uvicorn stops listening and goes over the open connections in one step.
            await _until(lambda: running.server.servers and not any(
                s.is_serving() for s in running.server.servers), "the listener to close")
            conn.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while chunk := await asyncio.to_thread(conn.recv, 65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
            assert b"connection: close" in answer.lower()
        finally:
            conn.close()
        await asyncio.wait_for(running.task, 15)


def _read_answer(conn: socket.socket) -> bytes:
    """The head of one chunked answer, read whole from a kept-alive connection."""
    data = b""
    while not (b"\r\n\r\n" in data and data.endswith(b"\r\n0\r\n\r\n")):
        chunk = conn.recv(65536)
        assert chunk, f"closed with no whole answer: {data!r}"
        data += chunk
    return data.split(b"\r\n\r\n", 1)[0]


async def test_a_kept_alive_client_sending_its_next_request_as_the_server_stops_is_served():
    # A paced client reuses its connection a moment after each answer. Had the stop closed
    # the idle connection at once, a request sent in that moment would meet a reset.
    async with _Running() as running:
        paced = await asyncio.to_thread(socket.create_connection,
                                        ("127.0.0.1", running.port), 5)
        quiet = await asyncio.to_thread(socket.create_connection,
                                        ("127.0.0.1", running.port), 5)
        try:
            for conn in (paced, quiet):
                conn.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                head = await asyncio.to_thread(_read_answer, conn)
                assert head.startswith(b"HTTP/1.1 200 ") and b"close" not in head.lower()
            stopped = asyncio.get_running_loop().time()
            running.server.stop()
            await _until(lambda: running.server.servers and not any(
                s.is_serving() for s in running.server.servers), "the listener to close")
            paced.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await asyncio.to_thread(_read_answer, paced)
            assert head.startswith(b"HTTP/1.1 200 "), head
            assert b"connection: close" in head.lower()
            # The one that sends nothing is closed once the grace is out, not kept.
            assert await asyncio.to_thread(quiet.recv, 1) == b""
            assert await asyncio.to_thread(paced.recv, 1) == b""
            await asyncio.wait_for(running.task, 15)
            waited = asyncio.get_running_loop().time() - stopped
            assert waited < STOP_IDLE_GRACE_S + GRACEFUL_STOP_S / 2, waited
        finally:
            paced.close()
            quiet.close()


def _dechunk(data: bytes) -> tuple[list[bytes], bytes]:
    """The chunks of a chunked body, and what follows its last chunk."""
    chunks = []
    while True:
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            assert data.startswith(b"\r\n")
            return chunks, data[2:]
        chunks.append(data[:size])
        assert data[size:size + 2] == b"\r\n"
        data = data[size + 2:]


async def _slow_client(port: int) -> socket.socket:
    """A client connection with a small receive buffer, connected, reading nothing yet."""
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2**18)
    conn.settimeout(10)
    await asyncio.to_thread(conn.connect, ("127.0.0.1", port))
    return conn


@pytest.mark.parametrize("way", ["written", "sunk", "relayed"])
async def test_a_body_writer_waits_for_a_slow_client_and_loses_nothing(way):
    chunks = 128  # 8 MiB: well over what the socket buffers between app and client hold
    async with _Running() as running:
        conn = await _slow_client(running.port)
        try:
            conn.sendall(f"GET /{way}/{chunks} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            # The client reads nothing yet: the writer must say full, and wait.
            await asyncio.wait_for(running.full.wait(), 10)
            assert running.resumed < 0
            answer = b""
            while not answer.endswith(b"\r\n0\r\n\r\n"):
                piece = await asyncio.to_thread(conn.recv, 2**20)
                assert piece, "the server closed the connection mid-answer"
                answer += piece
            head, body = answer.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 200 ")
            assert b"transfer-encoding: chunked" in head.lower()
            received, rest = _dechunk(body)
            assert rest == b""
            data = b"".join(received)
            assert len(data) == chunks * CHUNK
            assert all(data[i * CHUNK] == i % 251 == data[(i + 1) * CHUNK - 1]
                       for i in range(chunks))
            assert running.resumed == 0  # every wait was called back
            if way == "sunk":
                assert running.firsts == 1
                tapped = running.tap.settled + running.tap.pending
                assert b"".join(tapped) == data  # every chunk, in order
                # Settled once SETTLE_BYTES were written since the last time: what waits
                # is at most that, and the read that went over it.
                assert running.tap.most_waiting <= SETTLE_BYTES + 2 * CHUNK
            # The response ended through send: the connection is kept for the next one.
            conn.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            again = await asyncio.to_thread(conn.recv, 65536)
            assert again.startswith(b"HTTP/1.1 200 "), again[:200]
        finally:
            conn.close()


class _Recording(asyncio.Transport):
    """A client connection that keeps each write apart, to count them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8080)}.get(
            name, default)

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    closed = False


class _Protocol:
    """llmgw's HTTP protocol, as ``make_server`` configures it, serving ``app`` over a
    recording transport: each write to the client is kept apart, to count them."""

    def __init__(self, app) -> None:
        self.transport = _Recording()
        sock, _ = listening_socket(Listen(host="127.0.0.1", port=0))
        try:
            config = make_server(app, sock).config
            config.load()
        finally:
            sock.close()
        self.state = uvicorn.server.ServerState()
        self.protocol = config.http_protocol_class(config=config, server_state=self.state,
                                                   app_state={})
        self.protocol.connection_made(self.transport)

    async def request(self, head: bytes) -> list[bytes]:
        """The writes made to answer one request (its head given whole)."""
        self.transport.writes.clear()
        self.protocol.data_received(head)
        await asyncio.wait_for(asyncio.gather(*self.state.tasks), 5)
        return list(self.transport.writes)

    def close(self) -> None:
        """The client's connection lost, as uvloop reports it: closing, then told."""
        self.transport.closed = True
        self.protocol.connection_lost(None)


async def test_a_sink_settles_a_long_stream_for_its_usage_reader_in_bounded_batches():
    # Events of a long stream, one a read, through a sink to a real usage reader: the
    # chunks wait in its `pending` a batch at a time, never more than SETTLE_BYTES and one
    # read, and every event is seen, the usage in the last one found.
    events = [b"data: " + json.dumps({"n": n, "text": "x" * 150}).encode() + b"\n\n"
              for n in range(1500)]
    events[-1] = b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":5}}\n\n'
    usage = StreamUsage()
    waiting: list[int] = []

    async def app(scope, receive, send) -> None:
        writer = scope["extensions"][BODY_WRITER]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        sink = writer.sink(lambda: None, lambda: None, usage)
        for event in events:
            assert sink([event])
            waiting.append(sum(map(len, usage.pending)))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    served = _Protocol(app)
    writes = await served.request(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    received, rest = _dechunk(b"".join(writes).split(b"\r\n\r\n", 1)[1])
    assert rest == b"" and b"".join(received) == b"".join(events)
    longest = max(map(len, events))
    assert max(waiting) <= SETTLE_BYTES + longest
    assert max(waiting) > SETTLE_BYTES // 2  # batched, not settled every read
    assert usage.events() == len(events)
    assert usage.counted() == Usage(4, 5)


async def test_a_held_head_leaves_with_the_first_chunk_in_one_write():
    seen: list[list[bytes]] = []

    async def app(scope, receive, send) -> None:
        writer = scope["extensions"][BODY_WRITER]
        writer.hold()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        seen.append(list(served.transport.writes))  # the head is held: nothing written yet
        if scope["path"] == "/chunk":
            assert writer.write(b"data: 1\n\n")
        elif scope["path"] == "/sink":
            sink = writer.sink(lambda: None, lambda: None)
            assert sink([b"data: 1\n\n"])
            assert sink([b"data: 2\n\n", b"data: 3\n\n"])
        writer.release()  # whatever is still held goes now, once
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    served = _Protocol(app)
    for path in (b"/chunk", b"/sink", b"/nothing"):
        writes = await served.request(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
        assert seen.pop() == []
        head, chunked_end = writes[0].split(b"\r\n\r\n", 1), writes[1:]
        assert head[0].startswith(b"HTTP/1.1 200 OK")
        if path == b"/sink":
            assert head[1] == b"9\r\ndata: 1\n\n\r\n"  # the head and the first chunk
            # Two chunks a call: one write.
            assert chunked_end[0] == b"9\r\ndata: 2\n\n\r\n9\r\ndata: 3\n\n\r\n"
            chunked_end = chunked_end[1:]
        elif path == b"/chunk":
            assert head[1] == b"9\r\ndata: 1\n\n\r\n"  # one write: the head and the chunk
        else:
            assert head[1] == b""  # released: the head alone
        assert chunked_end == [b"0\r\n\r\n"]
    served.close()


@pytest.mark.parametrize("connection", [b"keep-alive", b"close"])
async def test_a_held_answer_leaves_whole_in_one_write(connection):
    async def app(scope, receive, send) -> None:
        writer = scope["extensions"][BODY_WRITER]
        writer.hold()
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", b"11")]})
            await send({"type": "http.response.body", "body": b'{"ok":true}'})
        finally:
            writer.release()

    served = _Protocol(app)
    writes = await served.request(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: " + connection
                                  + b"\r\n\r\n")
    assert len(writes) == 1, writes  # the head and the body
    assert writes[0].startswith(b"HTTP/1.1 200 OK")
    assert writes[0].endswith(b'\r\n\r\n{"ok":true}')
    # Not kept alive: closed after the answer was written, not before.
    assert served.transport.closed is (connection == b"close")
    served.close()


async def test_a_body_writer_says_when_the_client_leaves_before_the_answer_is_done():
    left: list[str] = []
    waiting, finish = asyncio.Event(), asyncio.Event()
    writers = []

    async def app(scope, receive, send) -> None:
        writer = scope["extensions"][BODY_WRITER]
        writers.append(writer)
        writer.on_disconnect(lambda: left.append(scope["path"]))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        assert writer.write(b"data: 1\n\n")
        if scope["path"] == "/leaves":
            waiting.set()
            await finish.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    served = _Protocol(app)
    # An answer that was done: the client leaving after it is nobody's business.
    await served.request(b"GET /stays HTTP/1.1\r\nhost: x\r\n\r\n")
    served.protocol.data_received(b"GET /leaves HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(waiting.wait(), 5)
    assert not writers[1].disconnected
    served.close()
    assert left == ["/leaves"]  # called from the connection's loss, once
    assert writers[1].disconnected and not writers[0].disconnected
    written = len(served.transport.writes)
    assert not writers[1].write(b"data: 2\n\n")  # nobody to write to: nothing written
    sink = writers[1].sink(lambda: pytest.fail("resumed for nobody"), lambda: None)
    assert not sink([b"data: 2\n\n"])
    assert not sink([b"data: 3\n\n"])
    assert len(served.transport.writes) == written
    finish.set()
    await asyncio.wait_for(asyncio.gather(*served.state.tasks), 5)
    assert left == ["/leaves"]


async def test_a_sink_is_refused_outside_a_started_chunked_response():
    refused: list[str] = []

    async def app(scope, receive, send) -> None:
        writer = scope["extensions"][BODY_WRITER]

        def try_sink() -> None:
            try:
                writer.sink(lambda: None, lambda: None)
            except RuntimeError as err:
                refused.append(str(err))

        try_sink()  # before the head
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        try_sink()  # a head with a length: not chunked
        await send({"type": "http.response.body", "body": b"ok"})

    served = _Protocol(app)
    writes = await served.request(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert b"".join(writes).endswith(b"\r\n\r\nok")
    assert refused == ["BodyWriter.sink outside a started chunked response"] * 2
    served.close()


async def test_a_served_request_leaves_no_reference_cycle_behind():
    """A request's cycle, scope and BodyWriter are freed by their reference counts once it
    is done. Left in a reference cycle, they wait for the cyclic collector, which then ran
    for 5-7 ms every 1,300 or so requests of the gateway, every request in flight held up."""

    async def app(scope, receive, send) -> None:
        writer = scope["extensions"][BODY_WRITER]
        writer.hold()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        assert writer.write(b"data: 1\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def alive() -> int:
        return sum(isinstance(o, (BodyWriter, RequestResponseCycle))
                   for o in gc.get_objects())

    gc.collect()
    before = alive()
    gc.disable()  # cyclic garbage stays where alive() sees it
    try:
        served = _Protocol(app)
        for _ in range(3):
            writes = await served.request(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert b"data: 1" in b"".join(writes)
        served.close()
        del served
        assert alive() == before
    finally:
        gc.enable()


async def test_a_kept_alive_connection_is_closed_after_the_keep_alive_limit_of_silence():
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    served = _Protocol(app)
    served.protocol.timeout_keep_alive = 1.0
    loop = asyncio.get_running_loop()
    await served.request(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.sleep(0.5)
    # A second request within the limit: the limit counts from its answer, though the
    # connection's timer was set by the first.
    writes = await served.request(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    answered = loop.time()
    assert writes and not served.transport.closed
    await _until(lambda: served.transport.closed, "the idle connection to be closed")
    # The first answer's limit ran out 0.5 s after the second: closed then is the fault.
    assert 0.9 <= loop.time() - answered < 3


class _NowOrAsgi:
    """An app that serves POST /now/* from the connection's callbacks (CallbackRoutes):
    /now/stream as a chunked answer of the body's words, /now/whole as one answer with a
    length, /now/back handed to the ASGI app after a moment with an extension (as the
    gateway hands back a request an engine refused); anything else through ASGI: /now/*
    answered with what its scope and body were, the rest by ``_echo``. Each /now/whole
    counts itself in its connection's memo (``memos``: the memo each saw)."""

    callback_paths = frozenset({b"/now/stream", b"/now/whole", b"/now/back", b"/now/other"})

    def __init__(self, running: _Running):
        self.running = running
        self.now: list[str] = []  # paths serve_now served
        self.memos: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/now/"):
            return await _echo(scope, receive, send, self.running)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if body == b"raise":
            raise RuntimeError("an app's bug")
        seen = {key: scope[key] for key in ("method", "path", "scheme")}
        seen.update(raw_path=scope["raw_path"].decode(), body=len(body),
                    query_string=scope["query_string"].decode(),
                    back=scope["extensions"].get("test.back"),
                    headers={k.decode(): v.decode() for k, v in scope["headers"]},
                    writer=scope["extensions"][BODY_WRITER] is not None)
        answer = json.dumps(seen).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    def serve_now(self, path, headers, body, writer, fall_back) -> bool:
        path = path.decode()
        loop = asyncio.get_running_loop()
        assert dict(headers)[b"x-test"] == b"Held"  # names in lower case, values as sent
        if path == "/now/back":
            self.now.append(path)
            loop.call_later(0.05, fall_back, {"test.back": "refused"})
            return True
        if path == "/now/stream":
            self.now.append(path)
            writer.start(200, [(b"content-type", b"text/plain")])
            words = body.split()

            def next_word() -> None:  # one chunk per loop pass, from callbacks
                if words:
                    sink([words.pop(0)])
                    loop.call_soon(next_word)
                else:
                    writer.finish(b"!")
                    writer.served()

            sink = writer.sink(lambda: None, lambda: None)
            loop.call_soon(next_word)
            return True
        if path == "/now/whole":
            self.now.append(path)
            memo = writer.connection_memo
            memo["requests"] = memo.get("requests", 0) + 1
            self.memos.append(memo)
            writer.start(201, [(b"content-type", b"text/plain")], len(body))
            writer.finish(body)
            writer.served()
            return True
        return False


async def test_a_connection_memo_lasts_as_long_as_its_connection():
    # What an app keeps per connection (the gateway: an API key's digest) is shared by the
    # connection's requests only, and let go of when it closes, not when the cyclic
    # collector gets to the connection.
    running = _Running()
    app = _NowOrAsgi(running)
    running.server = make_server(app, running.sock)
    async with running:
        for _ in range(2):  # two connections, two requests on each
            async with aiohttp.ClientSession(headers={"X-Test": "Held"}) as http:
                for _ in range(2):
                    async with http.post(f"http://127.0.0.1:{running.port}/now/whole",
                                         data=b"x") as resp:
                        assert resp.status == 201
        first, again, second, its_again = app.memos
        assert first is again and second is its_again and first is not second
        await _until(lambda: first == {} and second == {}, "both memos emptied")


async def test_requests_an_app_serves_from_callbacks_are_held_for_their_body_then_served():
    running = _Running()
    app = _NowOrAsgi(running)
    running.server = make_server(app, running.sock)
    async with running, aiohttp.ClientSession(
            headers={"X-Test": "Held"}, timeout=aiohttp.ClientTimeout(total=10)) as http:
        base = f"http://127.0.0.1:{running.port}"
        for _ in range(2):  # on one kept-alive connection, one after the other
            async with http.post(base + "/now/stream", data=b"one two three") as resp:
                assert resp.status == 200 and resp.headers["transfer-encoding"] == "chunked"
                assert await resp.read() == b"onetwothree!"
            async with http.post(base + "/now/whole", data=b"all of it") as resp:
                assert (resp.status, await resp.read()) == (201, b"all of it")
                assert resp.headers["content-length"] == "9"
        # Said no, or handed back later, or too large to hold: through the ASGI app, with
        # the scope uvicorn would have made, the body whole, and what was handed back.
        for path, data, back in (("/now/other", b"x", None), ("/now/back", b"xy", "refused"),
                                 ("/now/whole", b"y" * (2**16 + 1), None)):
            async with http.post(base + path, data=data) as resp:
                assert resp.status == 200
                seen = await resp.json()
            assert seen.pop("headers")["x-test"] == "Held"
            assert seen == {"method": "POST", "path": path, "raw_path": path,
                            "query_string": "", "scheme": "http", "body": len(data),
                            "back": back, "writer": True}
        # Not a callback path as sent (a query, an escape): through the app, unheld.
        for target, path in (("/now/whole?x=1", "/now/whole"), ("/now/%77hole", "/now/whole")):
            async with http.post(yarl.URL(base + target, encoded=True), data=b"z") as resp:
                seen = await resp.json()
            assert (seen["path"], seen["body"]) == (path, 1)
        # The app's failure after all: uvicorn's 500, and the connection serves on.
        async with http.post(base + "/now/other", data=b"raise") as resp:
            assert resp.status == 500
        async with http.post(base + "/now/whole", data=b"again") as resp:
            assert (resp.status, await resp.read()) == (201, b"again")
        assert app.now == ["/now/stream", "/now/whole"] * 2 + ["/now/back", "/now/whole"]
        assert running.server.server_state.total_requests == 11


async def test_a_held_requests_trailer_is_not_taken_for_one_of_its_headers():
    # A chunked body may end with trailer fields: neither serve_now nor the app it hands
    # the request back to takes one for a header of the request (here the test header
    # again, as an Authorization trailer could be).
    running = _Running()
    app = _NowOrAsgi(running)
    running.server = make_server(app, running.sock)
    request = (b"POST /now/back HTTP/1.1\r\nhost: x\r\nx-test: Held\r\n"
               b"transfer-encoding: chunked\r\n\r\n2\r\nxy\r\n0\r\nx-test: Trailer\r\n\r\n")
    async with running:
        answers = await asyncio.to_thread(_pipelined, running.port, [request], 1)
    seen = json.loads(answers[0].partition(b"\r\n\r\n")[2])
    assert (seen["headers"]["x-test"], seen["back"], seen["body"]) == ("Held", "refused", 2)
    assert app.now == ["/now/back"]  # serve_now took it (its x-test was the head's)


def _pipelined(port: int, requests: list[bytes], answers: int) -> list[bytes]:
    """``requests`` sent in one write on one connection: its first ``answers`` answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"".join(requests))
        data = b""
        got: list[bytes] = []
        while len(got) < answers:
            head, sep, rest = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if sep and length is not None and len(rest) >= length:
                got.append(head + sep + rest[:length])
                data = rest[length:]
                continue
            chunk = conn.recv(65536)
            assert chunk, f"closed after {len(got)} answers"
            data += chunk
        return got


async def test_a_request_pipelined_behind_one_handed_back_is_answered_after_it():
    # The first is held for serve_now and handed to the app 50 ms later; the second came
    # meanwhile, and waits for the first's answer, however the first was served.
    running = _Running()
    app = _NowOrAsgi(running)
    running.server = make_server(app, running.sock)

    def post(path: bytes, body: bytes) -> bytes:
        return (b"POST %s HTTP/1.1\r\nhost: x\r\nx-test: Held\r\ncontent-length: %d\r\n\r\n%s"
                % (path, len(body), body))

    async with running:
        answers = await asyncio.to_thread(
            _pipelined, running.port,
            [post(b"/now/back", b"first"), post(b"/now/whole", b"second")], 2)
    first, second = (json.loads(a.partition(b"\r\n\r\n")[2]) for a in answers)
    assert (first["path"], first["body"], first["back"]) == ("/now/back", 5, "refused")
    assert (second["path"], second["body"], second["back"]) == ("/now/whole", 6, None)
    assert app.now == ["/now/back"]  # the second, pipelined, went to the app
    assert running.server.server_state.total_requests == 2


async def test_many_requests_pipelined_in_one_go_are_all_answered():
    # Thousands of small requests in one write, over the head limit together: the server
    # reads them in large reads that end inside a head, which is bounded by its own bytes,
    # not by the requests before it in the read. The last head comes a moment later, so
    # that a read ends inside it.
    running = _Running()
    app = _NowOrAsgi(running)
    running.server = make_server(app, running.sock)
    request = b"POST /now/other HTTP/1.1\r\nhost: x\r\nx-test: Held\r\ncontent-length: 1\r\n\r\nx"
    count = MAX_HEAD_BYTES * 3 // len(request)

    def pipelined(port: int) -> int:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            def send() -> None:  # apart from the reading: neither side waits on the other
                conn.sendall(request * (count - 1) + request[:20])
                time.sleep(0.3)  # what the server reads meanwhile ends inside the last head
                conn.sendall(request[20:])

            sender = threading.Thread(target=send)
            sender.start()
            data, answers = b"", 0
            while answers < count:
                chunk = conn.recv(1 << 20)
                assert chunk, f"closed after {answers} answers: {data[-300:]!r}"
                data += chunk
                answers = data.count(b"HTTP/1.1 200 ")
            sender.join()
            assert b" 431 " not in data
            return answers

    async with running:
        assert await asyncio.to_thread(pipelined, running.port) == count


async def test_a_relayed_response_over_leaves_no_callback_for_the_next_on_its_connection():
    # A relayed response, then one pipelined behind it that fills the client's connection:
    # the connection saying so must reach the second's writer only, not the first's relay
    # (whose engine connection may by then serve another request).
    async with _Running() as running:
        conn = await _slow_client(running.port)
        try:
            conn.sendall(b"GET /relayed/1 HTTP/1.1\r\nhost: x\r\n\r\n"
                         b"GET /written/128 HTTP/1.1\r\nhost: x\r\n\r\n")
            await asyncio.wait_for(running.full.wait(), 10)  # the second is full
            answer = b""
            while answer.count(b"\r\n0\r\n\r\n") < 2:
                piece = await asyncio.to_thread(conn.recv, 2**20)
                assert piece, "the server closed the connection mid-answer"
                answer += piece
            assert answer.count(b"HTTP/1.1 200 ") == 2
            assert running.late_pauses == 0
            assert running.resumed == 0
        finally:
            conn.close()
