"""Requests served from callbacks (``GatewayFront.serve_now`` and ``direct.Exchange``): a
request whose replica has an idle kept-alive connection goes to the engine from the
server's callback and is answered from the engine connection's, with no task: streams,
mostly, and whole answers. Each test first sends one request, which opens that
connection, then the one it looks at, and checks that ``serve_now`` took it; what the
client sees must be what the task path gives.

In process, on loopback: the gateway's routes on llmgw's HTTP server, in front of a raw
asyncio engine that answers each request as the test's script says.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from unittest import mock

import aiohttp
import pytest

from llmgw.config import Gateway
from llmgw.server.auth import KeyCache, create_api_key
from llmgw.server.openai.usage import UsageRecorder
from llmgw.store import open_store, sqlite_url
from tests.integration.gateway_state import engine_answering, gateway_front_in_process

MODEL = "callback-model"
EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
STREAM = EVENT * 3 + b"data: [DONE]\n\n"
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
BODY = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}

Step = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool | None]]


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _dechunked(data: bytes) -> bytes:
    """A whole chunked body's data."""
    out = b""
    while True:
        size, _, data = data.partition(b"\r\n")
        if int(size, 16) == 0:
            assert data == b"\r\n"
            return out
        out += data[:int(size, 16)]
        assert data[int(size, 16):int(size, 16) + 2] == b"\r\n"
        data = data[int(size, 16) + 2:]


async def whole_stream(reader, writer) -> None:
    writer.write(HEAD + b"".join(_chunked(e) for e in (EVENT,) * 3)
                 + _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")


class Script:
    """The engine: the n-th request it gets is answered by the n-th step (the last one
    for all after it); it counts the requests."""

    def __init__(self, *steps: Step):
        self.steps = steps
        self.requests = 0

    async def __call__(self, head: bytes, body: bytes, reader, writer) -> bool | None:
        step = self.steps[min(self.requests, len(self.steps) - 1)]
        self.requests += 1
        return await step(reader, writer)


async def _post(http: aiohttp.ClientSession, url: str, **extra) -> tuple[int, bytes, dict]:
    async with http.post(url, json={**BODY, **extra}) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


def _raw_post(body: dict) -> bytes:
    """A chat request as a client writes it on its own socket."""
    data = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(data), data))


async def _until_free(front) -> None:
    """The replica's slot is free again: its lease is released just after the upstream
    connection closes, from the same callbacks; given a moment, never more."""
    for _ in range(100):
        if front.state.router.in_flight() == {"r0": 0}:
            return
        await asyncio.sleep(0.01)
    assert front.state.router.in_flight() == {"r0": 0}


async def _served(script: Script, gateway: Gateway | None = None):
    """(stack, url, front, http, server) with the first request sent and answered whole."""
    stack = contextlib.AsyncExitStack()
    running = await stack.enter_async_context(gateway_front_in_process(
        MODEL, engine_answering(script), gateway))
    port, front = running.port, running.front
    http = await stack.enter_async_context(
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)))
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    status, body, _ = await _post(http, url)
    assert (status, body) == (200, STREAM), body
    assert front.served_now == 0  # no connection to the engine was open yet
    return stack, url, front, http, running.server


async def test_a_stream_on_a_kept_alive_connection_is_relayed_byte_for_byte_from_callbacks():
    script = Script(whole_stream)
    stack, url, front, http, _ = await _served(script)
    try:
        for n in range(1, 4):
            status, body, headers = await _post(http, url)
            assert (status, body) == (200, STREAM), body
            assert headers["Content-Type"] == "text/event-stream"
            assert headers["Transfer-Encoding"] == "chunked"
            assert front.served_now == n
        # Not streamed: from callbacks too, and the engine's stream answered whole, as
        # the task path answers a request that did not ask for a stream.
        status, body, headers = await _post(http, url, stream=False)
        assert (status, body) == (200, STREAM) and front.served_now == 4
        assert headers["Content-Length"] == str(len(STREAM))
        assert "Transfer-Encoding" not in headers
        assert front.state.router.in_flight() == {"r0": 0}
    finally:
        await stack.aclose()


async def test_an_engine_refusing_with_503_hands_the_request_back_before_a_byte_is_sent():
    async def refuse(reader, writer) -> None:
        body = b'{"error": "warming up"}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json"
                     b"\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))

    script = Script(whole_stream, refuse)
    stack, url, front, http, _ = await _served(script)
    try:
        status, body, headers = await _post(http, url)
        assert front.served_now == 1
        # Handed back to the task path, which knew r0 refused it and had no other replica.
        assert status == 503, body
        error = json.loads(body)["error"]
        assert error["code"] == "no_ready_replica"
        assert "r0 answered 503" in error["message"], error
        assert headers["Retry-After"] == "5"
        assert script.requests == 2  # not sent to r0 again
        assert front.state.router.in_flight() == {"r0": 0}
    finally:
        await stack.aclose()


async def test_a_request_the_engine_read_then_hung_up_on_is_a_502_and_not_sent_again():
    # As an engine that dies while generating: it read the request (its TCP acknowledged
    # it), so it may have been working on it. (A kept-alive connection the engine had
    # closed before the request reached it is sent again: test_gateway_engine_failures.py.)
    async def hang_up(reader, writer) -> bool:
        return False  # read the request, closed without a word

    script = Script(whole_stream, hang_up, whole_stream)
    stack, url, front, http, _ = await _served(script)
    try:
        status, body, _ = await _post(http, url)
        assert front.served_now == 1
        assert status == 502, body
        error = json.loads(body)["error"]
        assert error["code"] == "upstream_error"
        assert error["message"] == ("r0: the engine closed the connection before answering; "
                                    "not retried: the engine may have been working on it")
        assert script.requests == 2
        assert front.state.router.in_flight() == {"r0": 0}
    finally:
        await stack.aclose()


async def test_events_that_come_with_the_end_of_a_stream_are_relayed_and_timed():
    # The read that ends an answer is written with the end: here it holds every event, so
    # it is also the stream's first body, which the time-to-first-byte metric must see.
    rest = asyncio.Event()

    async def head_then_everything(reader, writer) -> None:
        writer.write(HEAD)
        await writer.drain()
        await rest.wait()  # the client has the head: the gateway read it on its own
        writer.write(b"".join(_chunked(e) for e in (EVENT,) * 3)
                     + _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    script = Script(whole_stream, head_then_everything)
    stack, url, front, http, _ = await _served(script)
    registry = front.state.metrics.registry
    firsts = {"model": MODEL}
    try:
        before = registry.get_sample_value("llmgw_time_to_first_byte_seconds_count", firsts)
        async with http.post(url, json=BODY) as resp:
            assert resp.status == 200 and front.served_now == 1
            rest.set()
            body = await resp.read()
        assert body == STREAM
        assert registry.get_sample_value("llmgw_time_to_first_byte_seconds_count",
                                         firsts) == before + 1
        assert front.state.router.in_flight() == {"r0": 0}
    finally:
        await stack.aclose()


async def test_usage_in_the_read_that_ends_a_stream_is_counted_for_the_key(tmp_path):
    # The engine's usage comes in the read that ends the stream, which the callback path
    # writes with the end: the key must still be charged what the engine reported.
    usage = (b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,'
             b'"total_tokens":12}}\n\n')
    rest = asyncio.Event()

    async def usage_at_the_end(reader, writer) -> None:
        writer.write(HEAD)
        await writer.drain()
        await rest.wait()
        writer.write(_chunked(EVENT) + _chunked(usage) + _chunked(b"data: [DONE]\n\n")
                     + b"0\r\n\r\n")

    store = await open_store(sqlite_url(tmp_path / "llmgw.db"))
    key, record = await create_api_key(store, "ci")
    stack = contextlib.AsyncExitStack()
    stack.push_async_callback(store.close)
    try:
        running = await stack.enter_async_context(gateway_front_in_process(
            MODEL, engine_answering(Script(whole_stream, usage_at_the_end))))
        state, front = running.front.state, running.front
        state.config.auth.require_api_key = True
        state.api_keys = KeyCache(store, 60.0)
        state.usage = recorder = UsageRecorder(store)
        http = await stack.enter_async_context(aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=10),
            headers={"authorization": f"Bearer {key}"}))
        url = f"http://127.0.0.1:{running.port}/v1/chat/completions"
        status, body, _ = await _post(http, url)  # the task path: reads the key, opens
        assert (status, body) == (200, STREAM)    # the connection
        async with http.post(url, json=BODY) as resp:
            assert resp.status == 200 and front.served_now == 1
            rest.set()
            assert await resp.read() == EVENT + usage + b"data: [DONE]\n\n"
        await recorder.flush()
        used = await store.usage_counts(record.id, datetime.now(UTC))
        # The first stream reported nothing: its 4 events count as 4 completion tokens.
        assert used.tokens_this_minute == 4 + 12
    finally:
        await stack.aclose()


@pytest.mark.parametrize("apart", [False, True], ids=["with its head", "after its head"])
async def test_a_whole_answer_from_callbacks_is_the_task_paths_and_is_charged(tmp_path, apart):
    # A request not streamed, for a chat and for an embedding, answered from callbacks:
    # the engine's JSON and its type, with its length, and the key charged its usage;
    # byte for byte what the task path gives the same request. The body comes in the
    # head's write (written at once), or in a write of its own after a pause (kept until
    # it is all in); the same either way.
    answer = (b'{"object":"chat.completion","choices":[{"message":{"content":"hi"}}],'
              b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}')

    async def whole_json(reader, writer) -> None:
        head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(answer))
        if apart:
            writer.write(head + answer[:10])
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(answer[10:])
        else:
            writer.write(head + answer)

    store = await open_store(sqlite_url(tmp_path / "llmgw.db"))
    key, record = await create_api_key(store, "ci")
    stack = contextlib.AsyncExitStack()
    stack.push_async_callback(store.close)
    try:
        running = await stack.enter_async_context(gateway_front_in_process(
            MODEL, engine_answering(Script(whole_json))))
        state, front = running.front.state, running.front
        state.config.auth.require_api_key = True
        state.api_keys = KeyCache(store, 60.0)
        state.usage = recorder = UsageRecorder(store)
        http = await stack.enter_async_context(aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=10),
            headers={"authorization": f"Bearer {key}"}))
        base = f"http://127.0.0.1:{running.port}/v1"
        seen = []
        for path, extra in (("chat/completions", {"stream": False}),
                            ("chat/completions", {"stream": False}),
                            ("embeddings", {"input": "hi", "stream": False})):
            # The first through the task path (it reads the key, opens the connection).
            status, body, headers = await _post(http, f"{base}/{path}", **extra)
            assert (status, body) == (200, answer), body
            seen.append((headers["Content-Type"], headers["Content-Length"]))
        assert front.served_now == 2
        assert seen == [("application/json", str(len(answer)))] * 3
        await recorder.flush()
        used = await store.usage_counts(record.id, datetime.now(UTC))
        assert used.tokens_this_minute == 3 * 5
        assert front.state.router.in_flight() == {"r0": 0}
    finally:
        await stack.aclose()


async def test_an_engine_switching_protocols_is_refused_on_either_path():
    async def switch(reader, writer) -> None:
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n"
                     b"connection: upgrade\r\n\r\n")

    stack, url, front, http, _ = await _served(Script(whole_stream, switch))
    try:
        # First from callbacks (on the connection the first request left open), then
        # through the task path alone (that connection was dropped). Neither relays the
        # 101 or waits for ever, and neither sends the request again: the engine answered.
        for _ in range(2):
            status, body, _ = await _post(http, url)
            assert status == 502, body
            error = json.loads(body)["error"]
            assert error["code"] == "upstream_error"
            assert error["message"].startswith(
                "r0: the engine answered by switching protocols (101)"), error
            assert error["message"].endswith("not retried: the engine may have been working "
                                             "on it"), error
            assert front.served_now == 1
            assert front.state.router.in_flight() == {"r0": 0}
    finally:
        await stack.aclose()


async def test_a_json_answer_to_a_stream_request_is_relayed_whole():
    answer = b'{"error": {"message": "bad temperature", "type": "invalid_request_error"}}'

    async def bad_request(reader, writer) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\n\r\n" + _chunked(answer[:20])
                     + _chunked(answer[20:]) + b"0\r\n\r\n")

    stack, url, front, http, _ = await _served(Script(whole_stream, bad_request))
    try:
        status, body, headers = await _post(http, url)
        assert front.served_now == 1
        assert (status, body) == (400, answer)
        assert headers["Content-Type"] == "application/json"
        assert headers["Content-Length"] == str(len(answer))
    finally:
        await stack.aclose()


async def test_an_engine_silent_or_gone_mid_stream_ends_it_with_an_error_event():
    async def one_then_silence(reader, writer) -> bool:
        writer.write(HEAD + _chunked(EVENT))
        await reader.read()  # nothing more, until the gateway goes
        return False

    async def one_then_gone(reader, writer) -> bool:
        writer.write(HEAD + _chunked(EVENT))
        return False

    script = Script(whole_stream, one_then_silence, whole_stream, one_then_gone)
    stack, url, front, http, _ = await _served(
        script, Gateway(first_byte_timeout_s=2.0, idle_timeout_s=0.3))
    try:
        status, body, _ = await _post(http, url)
        assert front.served_now == 1 and status == 200
        assert body.startswith(EVENT), body
        error = json.loads(body[len(EVENT) + 6:])["error"]
        assert error["code"] == "upstream_timeout"
        assert "nothing for 0.3 s in the middle of the stream" in error["message"], error

        # The silent engine's connection was dropped: the next request opens another.
        status, body, _ = await _post(http, url)
        assert (status, body) == (200, STREAM) and front.served_now == 1
        status, body, _ = await _post(http, url)
        assert front.served_now == 2 and status == 200
        assert body.startswith(EVENT), body
        error = json.loads(body[len(EVENT) + 6:])["error"]
        assert error == {"message": "the engine of r0 broke off the stream",
                         "type": "server_error", "code": "upstream_error"}
        assert front.state.router.in_flight() == {"r0": 0}
    finally:
        await stack.aclose()


async def test_a_whole_answer_from_callbacks_that_stalls_or_breaks_off_is_a_504_or_502():
    # Not streamed, from callbacks: an engine silent before its head, silent in the middle
    # of its body, or gone mid-body gets the task path's answers, and frees its slot.
    answer = b'{"choices":[{"message":{"content":"hi"}}]}'
    whole = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
             b"content-length: %d\r\n\r\n" % len(answer))

    async def whole_json(reader, writer) -> None:
        writer.write(whole + answer)

    async def silent(reader, writer) -> bool:
        await reader.read()  # nothing, until the gateway goes
        return False

    async def half_then_silence(reader, writer) -> bool:
        writer.write(whole + answer[:10])
        await reader.read()
        return False

    async def half_then_gone(reader, writer) -> bool:
        writer.write(whole + answer[:10])
        return False

    script = Script(whole_stream, silent, whole_json, half_then_silence, whole_json,
                    half_then_gone)
    stack, url, front, http, _ = await _served(
        script, Gateway(first_byte_timeout_s=0.3, idle_timeout_s=0.3))
    try:
        status, body, _ = await _post(http, url, stream=False)
        assert (status, front.served_now) == (504, 1), body
        error = json.loads(body)["error"]
        assert error["code"] == "upstream_timeout"
        assert error["message"] == ("r0 sent nothing for 0.3 s "
                                    "(gateway.first_byte_timeout_s)")
        for served, why in ((2, "r0 sent nothing for 0.3 s in the middle of its answer "
                                "(gateway.idle_timeout_s)"),
                            (3, "the engine of r0 broke off its answer: the engine "
                                "closed the connection mid-answer")):
            # The engine's connection was dropped: the next request opens another, and
            # the one after that is served from callbacks on it.
            status, body, _ = await _post(http, url, stream=False)
            assert (status, body) == (200, answer) and front.served_now == served - 1
            status, body, _ = await _post(http, url, stream=False)
            assert front.served_now == served and status in (502, 504), body
            assert json.loads(body)["error"]["message"] == why
        assert front.state.router.in_flight() == {"r0": 0}
    finally:
        await stack.aclose()


async def test_a_client_leaving_a_stream_served_from_callbacks_frees_the_engine():
    loop = asyncio.get_running_loop()
    upstream_closed = loop.create_future()

    async def endless(reader, writer) -> bool:
        writer.write(HEAD + _chunked(EVENT))
        await reader.read()  # until the gateway closes the upstream connection
        upstream_closed.set_result(loop.time())
        return False

    stack, url, front, http, _ = await _served(Script(whole_stream, endless))
    try:
        resp = await http.post(url, json=BODY)
        first = await resp.content.readuntil(b"\n\n")
        assert first == EVENT and front.served_now == 1
        assert front.state.router.in_flight() == {"r0": 1}
        left = loop.time()
        resp.connection.transport.abort()  # the client goes, mid-stream
        resp.release()
        closed = await asyncio.wait_for(upstream_closed, 5)
        assert closed - left < 1.0
        assert front.state.router.in_flight() == {"r0": 0}
    finally:
        await stack.aclose()


async def test_an_answer_nobody_asked_for_after_a_whole_one_is_not_relayed():
    # The engine sends a whole answer and, in the same write, the start of another: the
    # client gets the first as it was, and the connection is not used again (before,
    # the next request served from callbacks on it waited for ever).
    answer = b'{"ok":1}'
    whole = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
             b"content-length: %d\r\n\r\n%b" % (len(answer), answer))

    async def whole_json(reader, writer) -> None:
        writer.write(whole)

    async def whole_then_another(reader, writer) -> None:
        writer.write(whole + b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nEV")

    script = Script(whole_json, whole_then_another, whole_json, whole_json)
    running = gateway_front_in_process(MODEL, engine_answering(script))
    async with running as running, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=10)) as http:
        url = f"http://127.0.0.1:{running.port}/v1/chat/completions"
        front = running.front
        for served in (0, 1, 1, 2):  # the third opens a new connection, in a task
            status, body, _ = await _post(http, url, stream=False)
            assert (status, body) == (200, answer) and front.served_now == served
        assert front.state.router.in_flight() == {"r0": 0}


async def test_a_client_leaving_before_a_whole_answer_from_callbacks_frees_the_engine():
    # Not streamed: the engine is still working on the answer (nothing sent yet) when the
    # client goes; the upstream connection is closed within a second.
    loop = asyncio.get_running_loop()
    upstream_closed = loop.create_future()
    received = asyncio.Event()

    async def thinking(reader, writer) -> bool:
        received.set()
        await reader.read()  # until the gateway closes the upstream connection
        upstream_closed.set_result(loop.time())
        return False

    stack, url, front, _, _ = await _served(Script(whole_stream, thinking))
    try:
        port = int(url.split(":")[2].split("/")[0])
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_raw_post({**BODY, "stream": False}))
        await asyncio.wait_for(received.wait(), 5)
        assert front.served_now == 1 and front.state.router.in_flight() == {"r0": 1}
        left = loop.time()
        writer.transport.abort()  # the client goes before any answer
        closed = await asyncio.wait_for(upstream_closed, 5)
        assert closed - left < 1.0
        await _until_free(front)
    finally:
        await stack.aclose()


@pytest.mark.parametrize("path", ["callbacks", "task"])
async def test_a_client_that_pipelines_and_leaves_frees_the_engine(path):
    """The client sends its next request before the stream it waits on is over (HTTP
    pipelining), then goes: the stream's upstream is closed, not only the latest
    request's. (The server does not read a connection with a request queued, so it
    learns of the loss from its next write, when the engine sends more.)"""
    loop = asyncio.get_running_loop()
    upstream_closed = loop.create_future()

    async def endless(reader, writer) -> bool:
        writer.write(HEAD + _chunked(EVENT))
        gone = asyncio.ensure_future(reader.read())  # b"" once the gateway closes
        while not gone.done():
            writer.write(_chunked(EVENT))
            await asyncio.wait([gone], timeout=0.05)
        upstream_closed.set_result(loop.time())
        return False

    if path == "callbacks":
        stack, url, front, _, server = await _served(Script(whole_stream, endless))
    else:  # no request before: no idle connection to the engine, so through the task
        stack = contextlib.AsyncExitStack()
        running = await stack.enter_async_context(gateway_front_in_process(
            MODEL, engine_answering(Script(endless))))
        front, server = running.front, running.server
        url = f"http://127.0.0.1:{running.port}/v1/chat/completions"
    try:
        port = int(url.split(":")[2].split("/")[0])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = _raw_post(BODY)
        writer.write(request)
        assert (await asyncio.wait_for(reader.readuntil(EVENT), 5)).endswith(EVENT)
        assert front.served_now == (path == "callbacks")
        writer.write(request)  # pipelined behind the stream
        for _ in range(500):  # until the server has read it: queued, not yet served
            if any(c._earlier for c in server.server_state.connections):
                break
            await asyncio.sleep(0.01)
        assert any(c._earlier for c in server.server_state.connections)
        assert front.state.router.in_flight() == {"r0": 1}
        left = loop.time()
        writer.transport.abort()
        closed = await asyncio.wait_for(upstream_closed, 5)
        assert closed - left < 1.0
        await _until_free(front)
    finally:
        await stack.aclose()


async def test_a_chunked_stream_reaches_the_client_framed_as_the_engine_framed_it():
    # Relayed from the engine connection's callback as it came: framing no encoder of ours
    # writes (sizes with leading zeros and in capitals, an extension, an event in two
    # chunks, a trailer) reaches the client unchanged. A stream with no chunks (it runs
    # to the end of the connection) is framed in chunks by the gateway instead.
    body = (b"00%X;x=1\r\n%b\r\n" % (len(EVENT), EVENT)
            + _chunked(EVENT[:10]) + _chunked(EVENT[10:])
            + _chunked(b"data: [DONE]\n\n") + b"0\r\nx-trailer: 1\r\n\r\n")

    async def odd_framing(reader, writer) -> None:
        writer.write(HEAD)
        await writer.drain()
        writer.write(body)

    async def until_the_end(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"connection: close\r\n\r\n" + STREAM)
        return False

    script = Script(whole_stream, odd_framing, until_the_end)
    stack, url, front, _, _ = await _served(script)
    try:
        port = int(url.split(":")[2].split("/")[0])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_raw_post(BODY))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head
        got = await asyncio.wait_for(reader.readexactly(len(body)), 5)
        assert got == body and front.served_now == 1
        # The same connection, the next request: the engine's stream has no chunks.
        writer.write(_raw_post(BODY))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ")
        got = b""
        while not got.endswith(b"\r\n0\r\n\r\n"):
            got += await asyncio.wait_for(reader.read(65536), 5)
        assert _dechunked(got) == STREAM
        assert front.served_now == 2
        writer.close()
        await _until_free(front)
    finally:
        await stack.aclose()


@pytest.mark.parametrize("ends", ["silent", "gone"])
async def test_a_stream_that_breaks_off_inside_a_chunk_is_cut_not_ended(ends):
    # The engine stops in the middle of a chunk: no event of the gateway's can follow
    # what was relayed, so the client's connection is closed with the body unended (its
    # client sees a broken stream), and the engine is freed.
    partial = b"40\r\ndata: {\"choi"

    async def half_a_chunk(reader, writer) -> bool:
        writer.write(HEAD + _chunked(EVENT))
        await writer.drain()
        writer.write(partial)
        if ends == "silent":
            await reader.read()  # until the gateway goes
        return False

    script = Script(whole_stream, half_a_chunk, whole_stream, half_a_chunk)
    stack, url, front, http, _ = await _served(
        script, Gateway(first_byte_timeout_s=2.0, idle_timeout_s=0.3))
    try:
        port = int(url.split(":")[2].split("/")[0])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_raw_post(BODY))
        answer = await asyncio.wait_for(reader.read(), 5)  # to the connection's end
        head, _, relayed = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and front.served_now == 1
        assert relayed == _chunked(EVENT) + partial  # unended: no last chunk
        writer.close()
        await _until_free(front)
        # With aiohttp, as a client would see it, once a request opened a connection again.
        assert await _post(http, url) == (200, STREAM, mock.ANY)
        async with http.post(url, json=BODY) as resp:
            assert resp.status == 200 and front.served_now == 2
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        await _until_free(front)
    finally:
        await stack.aclose()


async def test_a_bug_while_a_stream_is_relayed_ends_it_with_an_internal_error(monkeypatch):
    # The relay started, then llmgw's own code failed: what was relayed stopped between
    # chunks, so the stream ends with an error event of llmgw's, and the engine is freed.
    from llmgw.transport.answer import Answer

    start_relay = Answer.start_relay

    def start_then_fail(self, *args) -> None:
        start_relay(self, *args)
        raise RuntimeError("a bug after the relay started")

    monkeypatch.setattr(Answer, "start_relay", start_then_fail)

    async def one_then_more(reader, writer) -> bool:
        writer.write(HEAD + _chunked(EVENT))
        await reader.read()  # until the gateway goes
        return False

    stack, url, front, http, _ = await _served(Script(whole_stream, one_then_more))
    try:
        status, body, _ = await _post(http, url)
        assert status == 200 and front.served_now == 1
        assert body.startswith(EVENT), body
        assert json.loads(body[len(EVENT) + 6:])["error"]["code"] == "internal_error"
        await _until_free(front)
    finally:
        await stack.aclose()


@pytest.mark.parametrize("where", ["between events", "inside an event"])
async def test_under_another_asgi_server_a_broken_stream_is_ended_only_between_events(where):
    # Under an ASGI server that offers no BodyWriter (uvicorn's own protocol), the routes
    # send each chunk through ``send``. Broken off inside an event, the stream is left
    # unended, for the server to close the connection: an error event of llmgw's would be
    # read as part of the broken one (until 1 December 2026 it was appended all the same).
    sent = EVENT + (b"" if where == "between events" else b'data: {"choi')

    async def lengthed_then_gone(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"content-length: 4096\r\n\r\n" + sent)
        return False  # and the engine closes the connection

    async with gateway_front_in_process(MODEL, engine_answering(Script(lengthed_then_gone)),
                                        plain_uvicorn=True) as running:
        reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
        writer.write(_raw_post(BODY).replace(b"host: x\r\n",
                                             b"host: x\r\nconnection: close\r\n"))
        answer = await asyncio.wait_for(reader.read(), 5)  # to the connection's end
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and running.front.served_now == 0
        if where == "between events":
            events = _dechunked(body)
            assert events.startswith(EVENT), events
            error = json.loads(events[len(EVENT) + 6:])["error"]
            assert error["code"] == "upstream_error", error
        else:
            assert body == _chunked(sent)  # unended: no last chunk, no event of ours
        await _until_free(running.front)


@pytest.mark.parametrize("where", ["between events", "inside an event"])
@pytest.mark.parametrize("ends", ["silent", "gone"])
async def test_a_piped_stream_that_breaks_off_is_ended_only_between_events(where, ends,
                                                                          caplog):
    # A stream the engine frames by its length, not in chunks, is piped (parsed, and
    # framed again), on the task path and from callbacks alike. Broken off between two
    # events, it ends with llmgw's error event; inside one, an event of llmgw's would be
    # read as part of it (garbled JSON to the client), so the client's connection is
    # closed with the body unended instead, as a relayed stream's is.
    sent = EVENT + (b"" if where == "between events" else b'data: {"choi')

    async def lengthed_then_broken(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"content-length: 4096\r\n\r\n" + sent)
        if ends == "silent":
            await reader.read()  # until the gateway goes
        return False

    # The first request takes the task path (no connection is open yet) and drops its
    # connection; the second opens one again; the third is served from callbacks.
    script = Script(lengthed_then_broken, whole_stream, lengthed_then_broken)
    stack = contextlib.AsyncExitStack()
    running = await stack.enter_async_context(gateway_front_in_process(
        MODEL, engine_answering(script), Gateway(first_byte_timeout_s=2.0,
                                                 idle_timeout_s=0.3)))
    try:
        answers = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            writer.write(_raw_post(BODY).replace(b"host: x\r\n",
                                                 b"host: x\r\nconnection: close\r\n"))
            answer = await asyncio.wait_for(reader.read(), 5)  # to the connection's end
            writer.close()
            answers.append(answer.partition(b"\r\n\r\n"))
            await _until_free(running.front)
        assert running.front.served_now == 1  # the third
        assert _dechunked(answers[1][2]) == STREAM
        for head, _, body in (answers[0], answers[2]):
            assert head.startswith(b"HTTP/1.1 200 ")
            if where == "between events":
                events = _dechunked(body)
                assert events.startswith(EVENT), events
                error = json.loads(events[len(EVENT) + 6:])["error"]
                assert error["code"] == ("upstream_timeout" if ends == "silent"
                                         else "upstream_error"), error
            else:
                assert body == _chunked(sent)  # unended: no last chunk, no event of ours
        # Cut on purpose: no error logged for it (uvicorn's "returned without completing
        # response", on the task path).
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        await stack.aclose()
