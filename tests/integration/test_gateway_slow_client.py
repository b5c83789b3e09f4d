"""A streaming client slower than its engine, through the gateway served by llmgw's own HTTP
server: the engine's chunks are written to the client from the engine connection's
callback (http.BodyWriter), so a client that stops reading must pause reading from the
engine, and resume it when it reads again, losing and reordering nothing.

The real front (``routes.gateway_first``), router, upstream pool and uvicorn server on
loopback; the engine is a raw asyncio server streaming numbered SSE events as fast as its
socket takes them.
"""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from llmgw.transport.connection import Connection
from tests.integration.gateway_state import gateway_front_in_process

MODEL = "slow-reader-model"
EVENTS = 32768
# About 1 KiB an event: 32 MiB in all. What the socket buffers between the engine and the
# client hold before the engine is held back was measured at about 11 MiB on these machines.
PAD = "x" * 1000


def _event(i: int) -> bytes:
    data = b"data: " + json.dumps({"n": i, "pad": PAD}).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Engine:
    """Answers streamed requests on a kept-alive connection: the first ``short`` with three
    events, then EVENTS events, written as fast as they drain."""

    def __init__(self, short: int) -> None:
        self.short = short
        self.written = 0
        self.done = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                short = self.short > 0
                self.short -= 1
                for i in range(3 if short else EVENTS):
                    writer.write(_event(i))
                    if not short:
                        self.written = i + 1
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if not short:
                    self.done.set()
        except asyncio.IncompleteReadError:
            pass  # the gateway closed its kept-alive connection
        finally:
            writer.close()


def _events(body: bytes) -> list[bytes]:
    """The data lines of a chunked SSE body, in order."""
    data = bytearray()
    at = 0
    while True:
        eol = body.index(b"\r\n", at)
        size = int(body[at:eol], 16)
        if size == 0:
            break
        data += body[eol + 2:eol + 2 + size]
        at = eol + 2 + size + 2
    return [line for line in bytes(data).split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize("path", ["task", "callbacks"])
async def test_a_client_slower_than_its_engine_pauses_the_engine_and_gets_every_event(
        monkeypatch, path):
    # On the task path the engine's chunks go to a sink, which says when the client is
    # full; from callbacks (a connection to the engine is open: a stream before opened
    # it) they are relayed as they came, and the client's connection says it.
    paused = asyncio.Event()
    pause = Connection.pause

    def seen_pause(self) -> None:
        paused.set()
        pause(self)

    monkeypatch.setattr(Connection, "pause", seen_pause)
    engine = _Engine(short=1 if path == "callbacks" else 0)
    async with gateway_front_in_process(MODEL, engine.serve) as running:
        port, front = running.port, running.front
        body = json.dumps({"model": MODEL, "stream": True,
                           "messages": [{"role": "user", "content": "go"}]}).encode()
        if path == "callbacks":
            async with aiohttp.ClientSession() as http, http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", data=body) as resp:
                assert (await resp.read()).count(b"data: ") == 3
        client = socket.socket()
        try:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2**16)
            client.settimeout(10)
            await asyncio.to_thread(client.connect, ("127.0.0.1", port))
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                           b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                           % (len(body), body))
            # The client reads nothing: the gateway must stop reading from the engine,
            # which is then held back by its own socket, well short of the end.
            await asyncio.wait_for(paused.wait(), 10)
            assert front.served_now == (path == "callbacks")
            assert not engine.done.is_set()
            assert engine.written < EVENTS
            answer = bytearray()
            while not answer.endswith(b"\r\n0\r\n\r\n"):
                piece = await asyncio.to_thread(client.recv, 2**20)
                assert piece, "the gateway closed the connection mid-stream"
                answer += piece
            head, _, rest = bytes(answer).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 "), head
            lines = _events(rest)
            assert [json.loads(line[6:])["n"] for line in lines] == list(range(EVENTS))
            await asyncio.wait_for(engine.done.wait(), 5)
        finally:
            client.close()
