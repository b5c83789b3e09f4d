"""The gateway's upstream HTTP client against real sockets on loopback: keep-alive reuse,
bodies framed every way HTTP frames them, timeouts, a connection the engine closed while
pooled, cancellation and flow control, read by the chunk or piped to a sink."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from llmgw.transport.answer import Answer
from llmgw.transport.connection import Connection
from llmgw.transport.errors import ConnectError, Undelivered, UpstreamError, UpstreamTimeout
from llmgw.transport.pool import Pool, request_bytes

OK = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-other: dropped\r\n"
      b"content-length: 11\r\n\r\n{\"ok\":true}")


class Engine:
    """A raw asyncio server whose answer to each request is the test's to write."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # set when a connection's reader sees EOF
        self.requested = asyncio.Event()  # set when a request was read
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Engine:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                self.requested.set()
                if await self.answer(reader, writer, len(self.requests)) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            writer.close()


async def _ok(reader, writer, n):
    writer.write(OK)
    await writer.drain()


async def _post(pool: Pool, port: int, *, first_byte_s: float = 5, idle_s: float | None = 5,
                body: bytes = b'{"model":"m"}'):
    return await pool.post("127.0.0.1", port, "/v1/chat/completions", body,
                           b"application/json", first_byte_timeout_s=first_byte_s,
                           idle_timeout_s=idle_s)


async def test_requests_reuse_one_keep_alive_connection_and_keep_only_known_headers():
    pool = Pool(connect_timeout_s=2)
    async with Engine(_ok) as engine:
        for _ in range(5):
            answer = await _post(pool, engine.port)
            assert (answer.status, await answer.read()) == (200, b'{"ok":true}')
            answer.close()
        assert engine.connections == 1
        assert answer.headers == [(b"content-type", b"application/json")]
        head = engine.requests[0].split(b"\r\n\r\n")[0].lower()
        assert b"post /v1/chat/completions http/1.1" in head
        assert b"content-length: 13" in head and b"accept: application/json" in head
        assert engine.requests[0].endswith(b'{"model":"m"}')
    await pool.close()


async def test_a_watch_that_raises_is_logged_and_its_connection_kept(caplog):
    # A watch runs at the end of the engine connection's read: a bug in it is the
    # watcher's, not the connection's, which stays usable.
    pool = Pool(connect_timeout_s=2)
    async with Engine(_ok) as engine:
        answer = await _post(pool, engine.port)
        await answer.read()
        answer.close()  # one idle kept-alive connection
        answer = pool.send_now("127.0.0.1", engine.port,
                               request_bytes("127.0.0.1", engine.port, "/v1/chat/completions",
                                             b'{"model":"m"}', b"application/json"), 5, 5)
        assert answer is not None
        ran = asyncio.Event()

        def broken_watch() -> None:
            ran.set()
            raise RuntimeError("a bug in the watch")

        answer.watch(broken_watch)
        await asyncio.wait_for(ran.wait(), 5)
        assert answer.done and answer.error is None
        assert answer.take() == b'{"ok":true}'  # the read that ended it, left for the watch
        answer.close()
        again = await _post(pool, engine.port)
        assert (again.status, await again.read()) == (200, b'{"ok":true}')
        again.close()
        assert engine.connections == 1
        assert "unexpected error in the watch of an answer" in caplog.text
    await pool.close()


async def test_a_chunked_stream_is_read_as_it_comes():
    release = asyncio.Event()

    async def stream(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await release.wait()  # the second event only once the first was read
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(stream) as engine:
        answer = await _post(pool, engine.port)
        assert await answer.chunk() == b"data: 1\n\n"
        release.set()
        rest = b""
        while chunk := await answer.chunk():
            rest += chunk
        assert rest == b"data: 2\n\n"
        answer.close()
        # Read to its end: the connection goes back to the pool and is used again.
        release.clear()
        release.set()
        again = await _post(pool, engine.port)
        assert await again.read() == b"data: 1\n\ndata: 2\n\n"
        again.close()
        assert engine.connections == 1
    await pool.close()


async def test_a_body_without_length_runs_to_the_end_of_the_connection():
    async def until_eof(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\n\r\n{\"whole\":")
        await writer.drain()
        writer.write(b"1}")
        await writer.drain()
        return False

    pool = Pool(connect_timeout_s=2)
    async with Engine(until_eof) as engine:
        for _ in range(2):
            answer = await _post(pool, engine.port)
            assert await answer.read() == b'{"whole":1}'
            answer.close()
        assert engine.connections == 2  # never reused
    await pool.close()


async def test_a_pooled_connection_the_engine_read_the_request_on_and_dropped_is_not_retried():
    # The engine read request 2 whole (its TCP acknowledged it) and closed without a word,
    # as one that dies while generating does: it may have been working on it, so it is
    # not sent again. (One the engine had closed before the request reached it is:
    # test_gateway_engine_failures.py.)
    async def first_then_drop(reader, writer, n):
        if n == 2:
            return False  # reads the second request, closes without answering
        writer.write(OK)
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(first_then_drop) as engine:
        answer = await _post(pool, engine.port)
        await answer.read()
        answer.close()
        with pytest.raises(UpstreamError, match="before answering") as caught:
            await _post(pool, engine.port)
        assert not isinstance(caught.value, Undelivered)
        assert (engine.connections, len(engine.requests)) == (1, 2)
    await pool.close()


async def test_a_fresh_connection_closed_without_an_answer_is_an_unanswered_error():
    async def drop(reader, writer, n):
        return False

    pool = Pool(connect_timeout_s=2)
    async with Engine(drop) as engine:
        with pytest.raises(UpstreamError, match="before answering") as caught:
            await _post(pool, engine.port)
        assert caught.value.answered is False
        assert engine.connections == 1  # a fresh connection is not tried twice
    await pool.close()


async def test_no_first_byte_in_time_drops_the_connection():
    async def silent(reader, writer, n):
        await reader.read()  # until the client goes

    pool = Pool(connect_timeout_s=2)
    async with Engine(silent) as engine:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(UpstreamTimeout) as caught:
            await _post(pool, engine.port, first_byte_s=0.2)
        assert caught.value.phase == "first_byte" and not caught.value.answered
        assert 0.15 <= loop.time() - began < 2
        await asyncio.wait_for(engine.closed.wait(), 2)
    await pool.close()


async def test_each_request_on_a_kept_alive_connection_keeps_its_own_limit():
    """The requests of one connection share one timer: a short limit after long ones
    still holds, and a long one after a short one is not cut at the short one's time."""
    async def answers(reader, writer, n):
        if n == 3:
            await reader.read()  # silent until the client goes
            return False
        if n == 5:
            await asyncio.sleep(1.2)
        writer.write(OK)
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(answers) as engine:
        loop = asyncio.get_running_loop()
        for _ in range(2):
            answer = await _post(pool, engine.port, first_byte_s=30)
            assert await answer.read() == b'{"ok":true}'
            answer.close()
        began = loop.time()
        with pytest.raises(UpstreamTimeout):
            await _post(pool, engine.port, first_byte_s=0.2)
        assert 0.15 <= loop.time() - began < 2
        assert engine.connections == 1

        answer = await _post(pool, engine.port, first_byte_s=0.6)  # a new connection
        assert await answer.read() == b'{"ok":true}'
        answer.close()
        began = loop.time()
        answer = await _post(pool, engine.port, first_byte_s=5)  # answered after 1.2 s
        assert await answer.read() == b'{"ok":true}'
        assert loop.time() - began >= 1.1  # past the 0.6 s limit before it
        answer.close()
        assert engine.connections == 2
    await pool.close()


async def test_a_stream_idle_too_long_times_out_between_chunks():
    async def stall(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n")
        await writer.drain()
        await reader.read()

    pool = Pool(connect_timeout_s=2)
    async with Engine(stall) as engine:
        answer = await _post(pool, engine.port, idle_s=0.3)
        assert await answer.chunk() == b"one"
        with pytest.raises(UpstreamTimeout) as caught:
            await answer.chunk()
        assert caught.value.phase == "idle" and caught.value.answered
        answer.close()
        await asyncio.wait_for(engine.closed.wait(), 2)
    await pool.close()


async def test_the_first_byte_limit_holds_until_the_first_byte_of_the_body():
    """An engine may send its status line at once and its first token after a long prefill
    (or a wait in its own queue): that wait is the first-byte limit's, not the idle one's."""
    async def late(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        if n == 3:
            await reader.read()  # never a byte of the body
            return False
        await asyncio.sleep(0.6)  # twice the idle limit, within the first-byte one
        writer.write(b"5\r\nfirst\r\n0\r\n\r\n")
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(late) as engine:
        answer = await _post(pool, engine.port, first_byte_s=1.5, idle_s=0.3)
        assert await answer.read() == b"first"
        answer.close()
        got: list[bytes] = []
        answer = await _post(pool, engine.port, first_byte_s=1.5, idle_s=0.3)
        await asyncio.wait_for(answer.pipe(lambda chunks: got.extend(chunks) is None), 5)
        assert got == [b"first"]
        answer.close()

        loop = asyncio.get_running_loop()
        began = loop.time()
        answer = await _post(pool, engine.port, first_byte_s=0.8, idle_s=0.2)
        with pytest.raises(UpstreamTimeout) as caught:
            await answer.read()
        assert caught.value.phase == "first_byte" and caught.value.answered
        assert 0.75 <= loop.time() - began < 3
        answer.close()
    await pool.close()


async def test_a_piped_stream_that_starts_then_stops_is_cut_at_the_idle_limit():
    """The body began while piped (no wait ended): from there the idle limit holds, not
    the much longer first-byte one."""
    async def stall(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"3\r\none\r\n")
        await writer.drain()
        await reader.read()  # silent until the client goes

    got: list[bytes] = []
    pool = Pool(connect_timeout_s=2)
    async with Engine(stall) as engine:
        loop = asyncio.get_running_loop()
        began = loop.time()
        answer = await _post(pool, engine.port, first_byte_s=30, idle_s=0.4)
        with pytest.raises(UpstreamTimeout) as caught:
            await asyncio.wait_for(answer.pipe(lambda chunks: got.extend(chunks) is None), 5)
        assert caught.value.phase == "idle" and got == [b"one"]
        assert 0.45 <= loop.time() - began < 2  # the chunk at 0.1 s, then 0.4 s of silence
        answer.close()
    await pool.close()


async def test_steady_chunks_within_the_idle_limit_never_time_out():
    async def steady(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(8):  # 8 x 0.1 s: longer in all than the idle limit
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(steady) as engine:
        answer = await _post(pool, engine.port, idle_s=0.35)
        assert await answer.read() == b"x" * 8
        answer.close()
    await pool.close()


async def test_cancelling_a_request_closes_its_connection():
    async def silent(reader, writer, n):
        await reader.read()

    pool = Pool(connect_timeout_s=2)
    async with Engine(silent) as engine:
        task = asyncio.create_task(_post(pool, engine.port))
        await asyncio.wait_for(engine.requested.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(engine.closed.wait(), 1)
    await pool.close()


async def test_closing_an_answer_before_its_end_drops_the_connection():
    async def endless(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(2000):  # bounded: the client leaves long before
            writer.write(b"5\r\ntoken\r\n")
            await writer.drain()
            await asyncio.sleep(0.005)

    pool = Pool(connect_timeout_s=2)
    async with Engine(endless) as engine:
        answer = await _post(pool, engine.port)
        assert (await answer.chunk()).startswith(b"token")
        answer.close()
        await asyncio.wait_for(engine.closed.wait(), 1)
        assert not any(pool._idle.values())
    await pool.close()


async def test_a_client_slower_than_its_engine_pauses_reading_and_loses_nothing():
    size = 4 * 2**20

    async def flood(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for i in range(size // 2**16):
            writer.write(bytes([i % 251]) * 2**16)
            await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(flood) as engine:
        answer = await _post(pool, engine.port)
        conn = answer._conn
        for _ in range(500):  # nothing read yet: the engine fills the buffer (5 s at most)
            if conn.paused:
                break
            await asyncio.sleep(0.01)
        assert conn.paused
        assert answer._queued <= 2 * 2**20  # bounded near the high-water mark
        got = bytearray()
        while chunk := await answer.chunk():
            got += chunk
        assert len(got) == size
        assert all(got[i * 2**16] == i % 251 for i in range(size // 2**16))
        answer.close()
    await pool.close()


async def test_data_waiting_for_a_slow_reader_is_not_idleness_and_wakes_no_busy_timer(
        monkeypatch):
    async def two_then_silence(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(2):
            await asyncio.sleep(0.05)
            writer.write(b"5\r\ntoken\r\n")
            await writer.drain()
        await asyncio.sleep(1.0)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    fired = 0
    expired = Answer._expired

    def counted(self):
        nonlocal fired
        fired += 1
        expired(self)

    monkeypatch.setattr(Answer, "_expired", counted)
    pool = Pool(connect_timeout_s=2)
    async with Engine(two_then_silence) as engine:
        answer = await _post(pool, engine.port, idle_s=0.1)
        assert await answer.chunk() == b"token"  # waited: the idle timer is armed
        # A reader slower than the idle limit: the second token waits, queued. Queued data
        # is activity, so the timer comes back once per idle period, not in a spin.
        await asyncio.sleep(0.5)
        assert 1 <= fired <= 10
        assert await answer.chunk() == b"token"
        # Then the engine is silent for 1 s: that is idleness.
        with pytest.raises(UpstreamTimeout):
            await answer.chunk()
        answer.close()
    await pool.close()


async def test_a_piped_stream_goes_to_the_sink_from_the_connection_callback():
    release = asyncio.Event()

    async def stream(reader, writer, n):
        # The first event comes with the head, before there is a sink.
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await release.wait()
        for i in (2, 3):
            writer.write(b"9\r\ndata: %d\n\n\r\n" % i)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    got: list[bytes] = []
    in_task: list[bool] = []

    def sink(chunks: list[bytes]) -> bool:
        got.extend(chunks)
        in_task.append(asyncio.current_task() is not None)
        release.set()
        return True

    pool = Pool(connect_timeout_s=2)
    async with Engine(stream) as engine:
        for _ in range(2):
            answer = await _post(pool, engine.port)
            got.clear()
            await asyncio.wait_for(answer.pipe(sink), 5)
            assert b"".join(got) == b"data: 1\n\ndata: 2\n\ndata: 3\n\n"
            # The first chunk was handed over by pipe itself; the others by the connection's
            # callback, outside any task: nothing was woken to carry them.
            assert in_task[0] and not any(in_task[1:])
            in_task.clear()
            answer.close()
            release.clear()
        assert engine.connections == 1  # piped to its end, the connection was kept
    await pool.close()


async def test_chunks_and_the_end_in_one_read_go_to_the_sink_in_one_call_in_order():
    release = asyncio.Event()

    async def stream(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await release.wait()
        # Three chunks and the end of the answer in one write, read in one go.
        writer.write(b"".join(b"9\r\ndata: %d\n\n\r\n" % i for i in (1, 2, 3)) + b"0\r\n\r\n")
        await writer.drain()

    calls: list[list[bytes]] = []

    def sink(chunks: list[bytes]) -> bool:
        calls.append(list(chunks))  # the list is the connection's, reused after the call
        return False  # full: reading pauses as the answer ends

    pool = Pool(connect_timeout_s=2)
    async with Engine(stream) as engine:
        answer = await _post(pool, engine.port)
        piping = asyncio.create_task(answer.pipe(sink))
        await asyncio.sleep(0)  # the sink is in place before the chunks come
        assert answer._sink is not None
        release.set()
        await asyncio.wait_for(piping, 5)
        # One read, one call: the three chunks in order.
        assert calls == [[b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"]]
        answer.close()
        # Paused as it ended, the connection went back to the pool read again.
        again = await _post(pool, engine.port)
        assert await asyncio.wait_for(again.read(), 5) == b"data: 1\n\ndata: 2\n\ndata: 3\n\n"
        again.close()
        assert engine.connections == 1
    await pool.close()


async def test_a_full_sink_pauses_reading_until_resumed_and_is_not_idleness():
    size = 4 * 2**20

    async def flood(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(size // 2**16):
            writer.write(b"%x\r\n%b\r\n" % (2**16, bytes([i % 251]) * 2**16))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    got = bytearray()
    full = asyncio.Event()

    def sink(chunks: list[bytes]) -> bool:
        for chunk in chunks:
            got.extend(chunk)
        if len(got) >= 2**20 and not full.is_set():
            full.set()
            return False  # as a client that stopped reading
        return True

    pool = Pool(connect_timeout_s=2)
    async with Engine(flood) as engine:
        answer = await _post(pool, engine.port, idle_s=0.2)
        piping = asyncio.create_task(answer.pipe(sink))
        await asyncio.wait_for(full.wait(), 5)
        assert answer._conn.paused
        # Paused for a client longer than the idle limit: the engine is not idle.
        await asyncio.sleep(0.6)
        assert not piping.done()
        held = len(got)
        assert held < size
        answer.resume()
        await asyncio.wait_for(piping, 5)
        assert len(got) == size
        assert all(got[i * 2**16] == i % 251 for i in range(size // 2**16))
        answer.close()
    await pool.close()


async def test_a_connection_paused_as_its_answer_ended_is_read_again_in_the_pool():
    """The relay's client took no more (it lagged, or left) just as the engine's last chunk
    and the answer's end came in one read: reading was paused, the answer was whole, the
    connection went back to the pool. The next request on it must be read."""
    async def whole(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n")
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(whole) as engine:
        answer = await _post(pool, engine.port)
        await asyncio.wait_for(answer.pipe(lambda chunks: False), 5)  # full: pause
        answer.close()
        loop = asyncio.get_running_loop()
        began = loop.time()
        answer = await _post(pool, engine.port, first_byte_s=3)
        got: list[bytes] = []
        await asyncio.wait_for(answer.pipe(lambda chunks: got.extend(chunks) is None), 5)
        assert got and b"".join(got) == b"onetwo"
        assert loop.time() - began < 1
        answer.close()
        assert engine.connections == 1  # the same connection, read again
    await pool.close()


async def test_a_piped_stream_times_out_when_idle_and_fails_when_broken_off():
    async def stall(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n")
        await writer.drain()
        if n == 1:
            await reader.read()  # silent until the client goes
            return None
        return False  # the second: closed mid-answer

    got: list[bytes] = []
    pool = Pool(connect_timeout_s=2)
    async with Engine(stall) as engine:
        answer = await _post(pool, engine.port, idle_s=0.3)
        with pytest.raises(UpstreamTimeout) as caught:
            await asyncio.wait_for(answer.pipe(lambda chunks: got.extend(chunks) is None), 5)
        assert caught.value.phase == "idle" and got == [b"one"]
        answer.close()
        await asyncio.wait_for(engine.closed.wait(), 2)
        answer = await _post(pool, engine.port, idle_s=5)
        with pytest.raises(UpstreamError, match="mid-answer"):
            await asyncio.wait_for(answer.pipe(lambda chunks: True), 5)
        answer.close()
    await pool.close()


async def test_an_answer_that_is_not_http_is_an_error():
    async def garbage(reader, writer, n):
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        await reader.read()

    pool = Pool(connect_timeout_s=2)
    async with Engine(garbage) as engine:
        with pytest.raises(UpstreamError, match="not valid HTTP"):
            await _post(pool, engine.port)
    await pool.close()


async def test_bytes_after_a_whole_answer_lose_none_of_it_and_the_connection():
    async def trailing(reader, writer, n):
        # A whole answer and bytes that are no answer, read in one go: an error after
        # the answer's end, in the same read as its body.
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhelloXYZ")
        await writer.drain()

    release = asyncio.Event()

    async def stream_then_trailing(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await release.wait()  # the sink is in place
        writer.write(b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\nXYZ")
        await writer.drain()

    async def another_answer(reader, writer, n):
        # A whole answer, then in the same write the start of another nobody asked for.
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
                     b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nEVI" if n == 1 else OK)
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(trailing) as engine:
        answer = await _post(pool, engine.port)
        assert await asyncio.wait_for(answer.read(), 5) == b"hello"
        answer.close()
        assert not any(pool._idle.values())  # that connection is not kept
    async with Engine(another_answer) as engine:
        answer = await _post(pool, engine.port)
        assert await asyncio.wait_for(answer.read(), 5) == b"hello"  # not "helloEVI"
        answer.close()
        assert not any(pool._idle.values())
        answer = await _post(pool, engine.port)  # on a new connection, whole
        assert await asyncio.wait_for(answer.read(), 5) == b'{"ok":true}'
        answer.close()
        assert engine.connections == 2
    async with Engine(stream_then_trailing) as engine:
        answer = await _post(pool, engine.port)
        got: list[bytes] = []
        piping = asyncio.create_task(answer.pipe(lambda chunks: got.extend(chunks) is None))
        await asyncio.sleep(0)  # pipe's first step: the sink is set before it waits
        assert answer._sink is not None
        release.set()
        await asyncio.wait_for(piping, 5)
        assert got == [b"data: 1\n\n", b"data: 2\n\n"]
        answer.close()
    await pool.close()


async def test_a_refused_connection_says_where():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = Pool(connect_timeout_s=2)
    with pytest.raises(ConnectError, match=f"cannot connect to 127.0.0.1:{port}") as caught:
        await _post(pool, port)
    assert not caught.value.timed_out and not caught.value.answered
    await pool.close()


async def test_an_ipv6_engine_gets_a_bracketed_host_header():
    server = await asyncio.start_server(lambda r, w: None, "::1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()

    async def answer(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        seen.append(head)
        writer.write(OK)
        await writer.drain()
        writer.close()

    seen: list[bytes] = []
    server = await asyncio.start_server(answer, "::1", port)
    pool = Pool(connect_timeout_s=2)
    try:
        reply = await pool.post("::1", port, "/v1/x", b"{}", b"application/json",
                                first_byte_timeout_s=5, idle_timeout_s=5)
        assert await reply.read() == b'{"ok":true}'
        reply.close()
        assert f"host: [::1]:{port}\r\n".encode() in seen[0]
    finally:
        await pool.close()
        server.close()
        await server.wait_closed()


async def test_an_engine_gone_leaves_no_entry_in_the_pool():
    release = asyncio.Event()

    async def answer_then_go(reader, writer, n):
        writer.write(OK)
        await writer.drain()
        await release.wait()
        return False  # the engine closes its keep-alive connection, as one that stops does

    pool = Pool(connect_timeout_s=2)
    async with Engine(answer_then_go) as engine:
        answer = await _post(pool, engine.port)
        await answer.read()
        answer.close()
        assert len(pool._idle) == 1
        release.set()
        for _ in range(200):  # 2 s at most: the pool drops the connection and the address
            if not pool._idle:
                break
            await asyncio.sleep(0.01)
    assert pool._idle == {}
    await pool.close()


# --- relayed as the engine framed it (Answer.relayable, Answer.start_relay) ---------------


class _Relay:
    """A watch that relays an answer as the callback path does: once its head is in, what
    came with it and every read after, as they came; the body's parts kept apart."""

    def __init__(self, answer: Answer, every: int = 2**16, ended: bool = False) -> None:
        self.answer = answer
        self.every = every
        # ``ended``: told of a whole answer's end by the relay's ``on_end``, not the watch.
        self.ends: list[str] | None = [] if ended else None
        self.steps = 0  # watch calls
        self.early: bytes | None = None  # relayable() at the head; None: not relayable
        self.written: list[bytes] = []
        self.kept: list[list[bytes]] = []
        self.firsts = 0
        self.over = asyncio.Event()
        answer.watch(self._step)

    def _first(self) -> None:
        assert not self.written, "on_first after a write"
        self.firsts += 1

    def _step(self) -> None:
        answer = self.answer
        self.steps += 1
        if answer.status and self.early is None and not self.over.is_set():
            self.early = answer.relayable()
            if self.early is None:
                self.over.set()
                return
            answer.start_relay(self.written.append, self._first,
                               lambda parts: self.kept.append(list(parts)), self.every,
                               None if self.ends is None else self._ended)
        if answer.done or answer.error is not None:
            self.over.set()

    def _ended(self) -> None:
        self.ends.append(f"done={self.answer.done} error={self.answer.error}")
        self.over.set()

    @property
    def relayed(self) -> bytes:
        return self.early + b"".join(self.written)

    @property
    def reads(self) -> int:
        """Reads relayed so far, the head's included."""
        return (self.early is not None) + len(self.written)


async def _until(predicate, what: str, timeout_s: float = 5.0) -> None:
    """Poll the connection's state, which offers no event to wait on; fail past the
    limit."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"waited {timeout_s} s for {what}"
        await asyncio.sleep(0.01)


async def _relayed(pool: Pool, port: int, *, idle_s: float | None = 5, every: int = 2**16,
                   ended: bool = False) -> _Relay:
    """A request sent on the pool's idle connection to ``port``, relayed by a _Relay."""
    answer = pool.send_now("127.0.0.1", port, request_bytes(
        "127.0.0.1", port, "/v1/chat/completions", b'{"model":"m"}', b"application/json"),
        5, idle_s)
    assert answer is not None, "no idle connection to send on"
    return _Relay(answer, every, ended)


async def _one_idle_connection(pool: Pool, port: int) -> None:
    answer = await _post(pool, port)
    await answer.read()
    answer.close()


CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"transfer-encoding: chunked\r\n\r\n")


def _one_chunk_then(step: asyncio.Event, rest):
    """An Engine handler: its first answer ``OK`` (for the pool's idle connection), each
    later one chunked, its chunk ``one`` in a read of its own; once ``step`` is set (and
    cleared), ``rest(reader, writer, n)`` writes the rest and says what the handler says."""

    async def answers(reader, writer, n):
        if n == 1:
            writer.write(OK)
            await writer.drain()
            return None
        writer.write(CHUNKED + b"3\r\none\r\n")
        await writer.drain()
        await step.wait()
        step.clear()
        return await rest(reader, writer, n)

    return answers


async def test_a_chunked_answer_is_relayed_read_by_read_as_the_engine_framed_it():
    # Framing no encoder of ours writes (sizes with leading zeros and in capitals, an
    # extension, a trailer), and reads that end mid size line, mid data and mid CRLF:
    # the relay writes exactly what came, and keeps exactly the body's data.
    body = (b"009;note=x\r\ndata: 1\n\n\r\n" b"1D\r\ndata: {\"text\": \"two words\"}\n\n\r\n"
            b"9\r\ndata: 3\n\n\r\n" b"0\r\nx-trailer: yes\r\n\r\n")
    pieces = [body[:5], body[5:12], body[12:24], body[24:40], body[40:]]
    step = asyncio.Event()

    async def pieces_apart(reader, writer, n):
        if n == 1:
            writer.write(OK)
        elif n == 2:
            writer.write(CHUNKED + pieces[0])
            for piece in pieces[1:]:
                await writer.drain()
                await step.wait()  # the client read what went before: a read each
                step.clear()
                writer.write(piece)
        else:
            writer.write(CHUNKED + body)
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(pieces_apart) as engine:
        await _one_idle_connection(pool, engine.port)
        relay = await _relayed(pool, engine.port, every=16)
        for k in range(len(pieces)):
            await _until(lambda k=k, r=relay: r.reads > k, f"read {k + 1}")
            step.set()
        await asyncio.wait_for(relay.over.wait(), 5)
        answer = relay.answer
        assert answer.done and answer.error is None
        assert relay.early == pieces[0]  # the head's read: its body part, as it came
        assert relay.written == pieces[1:]  # one write a read, each as it came
        assert relay.firsts == 1
        data = b"".join(b"".join(parts) for parts in relay.kept)
        assert data == b'data: 1\n\ndata: {"text": "two words"}\n\ndata: 3\n\n'
        # Kept every 16 bytes of reads and at the end: in more than one batch.
        assert len(relay.kept) > 1
        answer.close()
        # Relayed to its end, the connection was kept. The next answer comes whole in
        # the head's read: relayed in one piece, nothing written after.
        again = await _relayed(pool, engine.port)
        await asyncio.wait_for(again.over.wait(), 5)
        assert (again.early, again.written, again.firsts) == (body, [], 0)
        assert b"".join(b"".join(parts) for parts in again.kept) == data
        again.answer.close()
        assert engine.connections == 1
    await pool.close()


async def test_an_answer_is_relayed_only_when_chunked_with_its_head_first_in_a_read():
    # Where the body begins in a read is known only for a head that began the read and
    # ended in it; a body with a length is framed by the relay's writer instead.
    step = asyncio.Event()
    half = CHUNKED.index(b"\r\n") + 2

    async def answers(reader, writer, n):
        if n == 1:
            writer.write(OK)
        elif n == 2:
            writer.write(OK)  # a length, not chunks
        elif n == 3:
            writer.write(CHUNKED[:half])  # the head in two reads
            await writer.drain()
            await step.wait()
            writer.write(CHUNKED[half:] + b"5\r\nhello\r\n0\r\n\r\n")
        else:
            writer.write(b"\r\n\r\n" + CHUNKED + b"0\r\n\r\n")  # empty lines first
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(answers) as engine:
        await _one_idle_connection(pool, engine.port)
        for n in (2, 3, 4):
            relay = await _relayed(pool, engine.port)
            if n == 3:
                await _until(lambda r=relay: not r.answer._conn.got_nothing,
                             "the head's first half")
                step.set()
            await asyncio.wait_for(relay.over.wait(), 5)
            assert relay.answer.status == 200 and relay.early is None, n
            relay.answer.stop_pipe()
            relay.answer.watch(None)
            # Still there to read the usual way.
            assert await asyncio.wait_for(relay.answer.read(), 5) == {
                2: b'{"ok":true}', 3: b"hello", 4: b""}[n]
            relay.answer.close()
        assert engine.connections == 1
    await pool.close()


async def test_a_head_with_bare_line_feeds_is_not_http():
    # relayable() finds a head's end at its first CRLF CRLF: true only while llhttp takes
    # no line ended by a lone LF, as here.
    async def bare(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\ntransfer-encoding: chunked\n\n5\r\nhello\r\n0\r\n\r\n")
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(bare) as engine:
        with pytest.raises(UpstreamError, match="not valid HTTP"):
            await _post(pool, engine.port)
    await pool.close()


@pytest.mark.parametrize(("after", "ends", "at_chunk_end"), [
    (b"5\r\nhello\r\n", "silent", True),
    (b"5\r\nhel", "silent", False),
    (b"1", "silent", False),  # in a size line: "10" would be a size
    (b"1;a", "silent", False),  # in a size line's extension
    (b"4\r\n", "silent", False),  # a size line whole: "0\r\n\r\n" would be 4 of data
    (b"0", "silent", False),  # in the last chunk's line
    (b"0;ext", "silent", False),
    (b"0\r\n", "silent", False),  # after the last chunk, before its trailers' end
    (b"0\r\nx-t: y", "silent", False),  # in a trailer
    (b"0\r\nx-t: y\r\n", "silent", False),
    (b"5\r\nhello\r", "gone", False),
    (b"5\r\nhello\r\n", "gone", True),
    (b"5\r\nhello\r\nzz\r\n", "garbage", False),
    (b"5\r\nhello\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n", "garbage", False),
])
async def test_a_relayed_answer_that_breaks_off_says_whether_at_a_chunk_end(
        after, ends, at_chunk_end):
    # What the relay's writer needs to end its client's body: whether what it relayed
    # stopped between chunks (it may add a chunk of its own) or inside one (it may not).
    # A read that does not parse is not relayed, even if the answer ended in it.
    step = asyncio.Event()

    async def rest(reader, writer, n):
        writer.write(after)
        await writer.drain()
        if ends in ("garbage", "silent"):
            await reader.read()  # until the client goes
        return False

    pool = Pool(connect_timeout_s=2)
    async with Engine(_one_chunk_then(step, rest)) as engine:
        await _one_idle_connection(pool, engine.port)
        relay = await _relayed(pool, engine.port, idle_s=0.3)
        await _until(lambda: relay.early is not None, "the head")
        assert relay.early == b"3\r\none\r\n"
        step.set()
        await asyncio.wait_for(relay.over.wait(), 5)
        answer = relay.answer
        assert answer.error is not None
        if ends == "silent":
            assert isinstance(answer.error, UpstreamTimeout)
        elif ends == "garbage":
            assert "not valid HTTP" in str(answer.error)
        assert answer.at_chunk_end() is at_chunk_end
        assert answer.at_chunk_end() is at_chunk_end  # asked again: the same
        relayed = relay.relayed
        assert relayed == (b"3\r\none\r\n" if ends == "garbage" else b"3\r\none\r\n" + after)
        kept = b"".join(b"".join(parts) for parts in relay.kept)
        assert kept.startswith(b"one")
        answer.close()
    await pool.close()


async def test_a_relayed_answer_that_came_whole_ends_by_on_end_and_one_broken_by_its_watch():
    # The relay's caller learns of a whole answer's end from on_end, once, after the
    # read that ended it was relayed to its end, and its watch is not called for it; an
    # answer that broke off goes to the watch, as without on_end.
    step = asyncio.Event()

    async def rest(reader, writer, n):  # the second answer whole, the third broken off
        writer.write(b"3\r\ntwo\r\n0\r\n\r\n" if n == 2 else b"3\r\ntw")
        await writer.drain()
        return None if n == 2 else False

    pool = Pool(connect_timeout_s=2)
    async with Engine(_one_chunk_then(step, rest)) as engine:
        await _one_idle_connection(pool, engine.port)
        whole = await _relayed(pool, engine.port, ended=True)
        await _until(lambda: whole.early is not None, "the head")
        steps = whole.steps
        step.set()
        await asyncio.wait_for(whole.over.wait(), 5)
        assert whole.ends == ["done=True error=None"]
        assert whole.steps == steps, "the watch was called for the end"
        assert whole.relayed == b"3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n"
        whole.answer.close()
        broken = await _relayed(pool, engine.port, ended=True)
        await _until(lambda: broken.early is not None, "the head")
        step.set()
        await asyncio.wait_for(broken.over.wait(), 5)
        assert broken.ends == [] and broken.answer.error is not None
        assert not broken.answer.done
        broken.answer.close()
    await pool.close()


async def test_crs_and_lfs_after_a_relayed_answer_are_not_relayed():
    # llhttp skips CRs and LFs between answers: the read that ends an answer may bring
    # some after it, which are not the answer's, and must not reach a client that reads
    # its next answer on the same connection. Three ways: the end and more in one read;
    # the last chunk's line in one read, the rest of the end and more in the next; a
    # whole answer, and more, in the head's read.
    body = b"5\r\nhello\r\n0\r\n\r\n"
    step = asyncio.Event()

    async def answers(reader, writer, n):
        if n == 1:
            writer.write(OK)
        elif n in (2, 3):
            writer.write(CHUNKED + b"5\r\nhello\r\n")
            await writer.drain()
            await step.wait()  # a read of its own
            step.clear()
            writer.write(b"0\r\n\r\n\r\n\r\n" if n == 2 else b"0\r\n")
            if n == 3:
                await writer.drain()
                await step.wait()
                step.clear()
                writer.write(b"\r\n\r\n\n")
        else:
            writer.write(CHUNKED + body + b"\r\n")
        await writer.drain()

    pool = Pool(connect_timeout_s=2)
    async with Engine(answers) as engine:
        await _one_idle_connection(pool, engine.port)
        for n in (2, 3, 4):
            relay = await _relayed(pool, engine.port)
            reads = 2 if n == 2 else 3 if n == 3 else 1
            for k in range(reads - 1):
                await _until(lambda k=k, r=relay: r.reads > k, f"read {k + 1}")
                step.set()
            await asyncio.wait_for(relay.over.wait(), 5)
            assert relay.answer.done and relay.answer.error is None, n
            assert relay.relayed == body, (n, relay.relayed)
            relay.answer.close()
    await pool.close()


async def test_a_closed_answer_neither_pauses_nor_resumes_its_connection_any_more():
    # A client's connection calls back the writer that was full after its answer is over
    # (a late "drained", a "full" from the next response on it); by then the engine
    # connection serves another answer, whose reading only that answer may pause.
    pool = Pool(connect_timeout_s=2)
    async with Engine(_ok) as engine:
        first = await _post(pool, engine.port)
        await first.read()
        first.close()
        second = await _post(pool, engine.port)
        conn = second._conn
        assert first._conn is conn and engine.connections == 1  # the same, kept alive
        second.pause()
        first.resume()
        assert conn.paused
        second.resume()
        first.pause()
        assert not conn.paused
        assert (second.status, await second.read()) == (200, b'{"ok":true}')
        second.close()
    await pool.close()


async def test_a_relayed_stream_is_timed_by_when_the_engine_last_sent_data():
    # A relayed read notes no time of its own: when the idle alarm rings, the kernel says
    # how long the engine has been silent. Events 0.1 s apart for longer in all than the
    # idle limit go through; a silence past it ends the stream.
    async def steady_then_silent(reader, writer, n):
        if n == 1:
            writer.write(OK)
            return
        writer.write(CHUNKED + b"1\r\nx\r\n")
        for _ in range(8):  # 8 x 0.1 s: longer in all than the idle limit
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"1\r\ny\r\n")
        await writer.drain()
        if n == 2:
            writer.write(b"0\r\n\r\n")
        else:
            await reader.read()  # silent until the client goes

    pool = Pool(connect_timeout_s=2)
    async with Engine(steady_then_silent) as engine:
        await _one_idle_connection(pool, engine.port)
        relay = await _relayed(pool, engine.port, idle_s=0.35)
        await asyncio.wait_for(relay.over.wait(), 5)
        assert relay.answer.done and relay.answer.error is None
        assert b"".join(relay.written).count(b"y") == 8
        relay.answer.close()

        relay = await _relayed(pool, engine.port, idle_s=0.35)
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(relay.over.wait(), 5)
        took = asyncio.get_running_loop().time() - started
        assert isinstance(relay.answer.error, UpstreamTimeout), relay.answer.error
        assert relay.answer.error.phase == "idle"
        assert b"".join(relay.written).count(b"y") == 8
        assert 0.8 + 0.35 <= took < 0.8 + 0.35 + 1.0, took
        relay.answer.close()
    await pool.close()


async def test_an_answer_is_relayed_only_where_the_kernel_says_when_data_came(monkeypatch):
    # Where it cannot (no TCP_INFO), the answer is piped instead, each read noting the
    # time, so the idle limit still holds.
    async def chunked(reader, writer, n):
        writer.write(OK if n == 1 else CHUNKED + b"1\r\nx\r\n0\r\n\r\n")

    monkeypatch.setattr(Connection, "silent_for", lambda self: None)
    pool = Pool(connect_timeout_s=2)
    async with Engine(chunked) as engine:
        await _one_idle_connection(pool, engine.port)
        relay = await _relayed(pool, engine.port)
        await asyncio.wait_for(relay.over.wait(), 5)
        assert relay.early is None and relay.answer.status == 200
        relay.answer.close()
    await pool.close()
