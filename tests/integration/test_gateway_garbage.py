"""A proxied request leaves nothing for the cyclic garbage collector.

Whatever a request makes (the server's cycle and BodyWriter, the engine's Answer, the
router's Lease, the closures that watch for the client leaving) must be freed by reference
counting the moment it is done. Objects caught in a reference cycle wait for a collection
instead, and a collection of a few thousand requests' worth held the event loop for 5-7 ms,
every request in flight waiting (the gateway's p99 at concurrency 16 went from 2.9 to
5.7-7.5 ms). Served here in process, on loopback, with the collector switched off while
requests run, so that anything left in a cycle is still there to be counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import Callable, Iterator

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from llmgw.server.openai.router import Lease
from llmgw.transport.answer import Answer
from llmgw.transport.server import _Light
from llmgw.transport.writer import BodyWriter
from tests.integration.gateway_state import engine_answering, gateway_in_process

MODEL = "garbage-model"
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
# Types made once per request; none may outlive it.
PER_REQUEST = (BodyWriter, RequestResponseCycle, _Light, Answer, Lease)


async def _answer_request(head: bytes, body: bytes, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
    """A JSON answer, or a stream of three events and a usage one."""
    if json.loads(body).get("stream"):
        events = [{"choices": [{"delta": {"content": str(i)}}]} for i in range(3)]
        events.append({"choices": [], "usage": USAGE})
        data = b"".join(b"data: %b\n\n" % json.dumps(e).encode() for e in events)
        data += b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
                     % (len(data), data))
    else:
        data = json.dumps({"choices": [{"message": {"content": "hi"}}],
                           "usage": USAGE}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(data), data))


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """One answer's body, read by its length or its chunks."""
    head = (await reader.readuntil(b"\r\n\r\n")).lower()
    assert head.startswith(b"http/1.1 200"), head
    if b"content-length: " in head:
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        return await reader.readexactly(length)
    body = b""
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readexactly(2)
    return body


def _alive() -> dict[str, int]:
    counts = {kind.__name__: 0 for kind in PER_REQUEST}
    for thing in gc.get_objects():
        if isinstance(thing, PER_REQUEST):
            counts[type(thing).__name__] += 1
    return counts


@contextlib.contextmanager
def _collector_off() -> Iterator[dict[str, int]]:
    """The cyclic collector off, so that anything left in a cycle stays to be counted;
    yields what was alive before."""
    gc.collect()
    before = _alive()
    gc.disable()
    try:
        yield before
    finally:
        gc.enable()


async def _until(predicate: Callable[[], bool], what: str) -> None:
    """The server acts from its own loop callbacks: given a moment, never more."""
    for _ in range(100):
        if predicate():
            return
        await asyncio.sleep(0.01)
    assert predicate(), f"waited a second for {what}: {_alive()}"


async def test_proxied_requests_plain_and_streamed_leave_no_reference_cycles():
    # Two plain and two streamed requests on one connection, then the connection closed:
    # nothing of them is left. The first goes through the app's task (a query string: not
    # a path the server holds for ``serve_now``), the rest are held and served from
    # callbacks.
    async with gateway_in_process(MODEL, engine_answering(_answer_request)) as port:
        with _collector_off() as before:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for target, stream in ((b"/v1/chat/completions?via=task", False),
                                   (b"/v1/chat/completions", True),
                                   (b"/v1/chat/completions", False),
                                   (b"/v1/chat/completions", True)):
                body = json.dumps({"model": MODEL, "stream": stream,
                                   "messages": [{"role": "user", "content": "hi"}]}).encode()
                writer.write(b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                             b"\r\ncontent-length: %d\r\n\r\n%b" % (target, len(body), body))
                answer = await asyncio.wait_for(_answer(reader), 5)
                assert (b'"usage"' in answer) and ((b"[DONE]" in answer) == stream), answer
            writer.close()
            await writer.wait_closed()
            await _until(lambda: _alive() == before, "nothing of a request left")


async def test_a_request_whose_client_leaves_before_its_body_is_in_leaves_no_cycle():
    # Held for serve_now while its body comes, then the connection is lost: nobody serves
    # it, and nothing of it is left.
    async with gateway_in_process(MODEL, engine_answering(_answer_request)) as port:
        with _collector_off() as before:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
                         b'{"model": "')
            await _until(lambda: _alive()["_Light"] == before["_Light"] + 1,
                         "the server to hold the request")
            writer.close()
            await writer.wait_closed()
            await _until(lambda: _alive() == before, "nothing of the request left")
