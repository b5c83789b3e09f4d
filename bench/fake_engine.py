"""The bare asyncio HTTP/1.1 servers that ``bench.gateway`` runs, each in its own process.

- ``engine``: a fake OpenAI-compatible engine. ``POST /v1/chat/completions`` (and
  ``/v1/completions``) answers a fixed small JSON, or, when the body asks for
  ``"stream": true``, ``--events`` SSE events ``--gap-ms`` apart then ``data: [DONE]``;
  ``GET /health`` answers 200. It reads no JSON and answers prepared bytes, so a request
  costs it little more than the event loop's wake-up and the loopback TCP (the issue
  measured about 10 µs; on a busy two-core machine it reads 30 to 50 µs): what a gateway
  adds is then most of what there is to measure.
- ``proxy``: the floor, the issue's bare Python L7 proxy (uvloop and httptools) to one
  upstream: it parses each request's head and body, forwards it over a pooled keep-alive
  connection, and relays the answer, a chunked stream chunk by chunk straight from the
  upstream's socket callback to the client's. It reads no field of the body (a gateway
  must read ``model`` and ``stream`` to route; with msgspec that is about 1 µs).

The engine keeps its minimal HTTP/1.1 parsing on plain asyncio streams: keep-alive,
``content-length`` bodies, nothing else (no pipelining, no ``expect``, no trailers); its
CPU is measured but is not what the bench compares. Neither imports anything of llmgw, so
the processes start fast and carry no weight a gateway would not.

Run as ``python bench/fake_engine.py engine --host H --port P`` (other
flags, such as those llmgw's llama.cpp adapter passes, are ignored) or ``... proxy --port P
--upstream HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import time

import httptools
import uvloop

_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')
# A connection that ends, or one cut short when the process stops (asyncio.run cancels the
# handlers, and 3.11's start_server logs a cancelled handler as an error).
_CLOSED = (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
           asyncio.CancelledError)


def parse_head(head: bytes) -> tuple[bytes, bytes, dict[bytes, bytes]]:
    """(method or version, path or status, headers with lower-case names) of a head that
    ends with an empty line."""
    lines = head.split(b"\r\n")
    first = lines[0].split(b" ", 2)
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
    return first[0], first[1] if len(first) > 1 else b"", headers


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type
            + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# --- the fake engine -----------------------------------------------------------------------


class FakeEngine:
    def __init__(self, model: str, events: int, gap_s: float):
        created = int(time.time())
        reply = {
            "id": "chatcmpl-fake", "object": "chat.completion", "created": created,
            "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "Hello from the fake."}}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13},
        }
        self.plain = _response(b"200 OK", b"application/json",
                               json.dumps(reply, separators=(",", ":")).encode())
        self.health = _response(b"200 OK", b"application/json", b'{"status":"ok"}')
        self.not_found = _response(b"404 Not Found", b"application/json",
                                   b'{"error":{"message":"not found"}}')
        self.stream_head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
        event = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created,
                 "model": model,
                 "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]}
        self.event = _chunk(b"data: " + json.dumps(event, separators=(",", ":")).encode()
                            + b"\n\n")
        self.done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.events = events
        self.gap_s = gap_s

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, path, headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
                length = int(headers.get(b"content-length", b"0"))
                body = await reader.readexactly(length) if length else b""
                if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
                    if _STREAM_RE.search(body):
                        await self._stream(writer)
                    else:
                        writer.write(self.plain)
                elif path == b"/health":
                    writer.write(self.health)
                else:
                    writer.write(self.not_found)
                await writer.drain()
                if headers.get(b"connection", b"").lower() == b"close":
                    break
        except _CLOSED:
            pass
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        writer.write(self.stream_head + self.event)
        for _ in range(self.events - 1):
            await writer.drain()
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
            writer.write(self.event)
        writer.write(self.done)


# --- the floor proxy -----------------------------------------------------------------------


class FloorProxy:
    """Every request to one upstream, over a pool of idle keep-alive connections.

    Protocols on uvloop, parsed by httptools, the way the issue measured the floor: a
    request is forwarded when its body is complete; the answer's head is written to the
    client when the upstream's head is parsed, and a chunked answer chunk by chunk from
    the upstream's ``data_received``, with no task or await between the two sockets."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.host_header = f"{host}:{port}".encode()
        self.idle: list[_FloorUpstream] = []

    def connection(self) -> _FloorClient:
        return _FloorClient(self)

    def forward(self, request: bytes, client: _FloorClient) -> None:
        while self.idle:
            upstream = self.idle.pop()
            if not upstream.transport.is_closing():
                upstream.send(request, client)
                return
        asyncio.get_running_loop().create_task(self._connect(request, client))

    async def _connect(self, request: bytes, client: _FloorClient) -> None:
        try:
            _, upstream = await asyncio.get_running_loop().create_connection(
                lambda: _FloorUpstream(self), self.host, self.port)
        except OSError:
            client.transport.close()
            return
        upstream.send(request, client)


class _FloorClient(asyncio.Protocol):
    """One client connection: parse a request, hand it to the proxy, one at a time."""

    def __init__(self, proxy: FloorProxy):
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        headers = self.headers
        request = (self.parser.get_method() + b" " + self.url + b" HTTP/1.1\r\nhost: "
                   + self.proxy.host_header + b"\r\ncontent-type: "
                   + headers.get(b"content-type", b"application/json") + b"\r\naccept: "
                   + headers.get(b"accept", b"*/*") + b"\r\ncontent-length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.url, self.headers, self.body = b"", {}, []
        self.proxy.forward(request, self)


class _FloorUpstream(asyncio.Protocol):
    """One keep-alive connection to the upstream, relaying each answer to its client."""

    def __init__(self, proxy: FloorProxy):
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.client: _FloorClient | None = None
        self.headers: list[bytes] = []
        self.chunked = False
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, client: _FloorClient) -> None:
        self.client = client
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client is not None:
            self.client.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"transfer-encoding":
            self.chunked = value.lower() == b"chunked"
        elif name == b"content-type" or name == b"cache-control":
            self.headers.append(name + b": " + value + b"\r\n")

    def on_headers_complete(self) -> None:
        if self.chunked:
            self.client.transport.write(self._head(b"transfer-encoding: chunked\r\n"))

    def _head(self, framing: bytes) -> bytes:
        status = self.parser.get_status_code()
        return b"HTTP/1.1 %d OK\r\n%s%s\r\n" % (status, b"".join(self.headers), framing)

    def on_body(self, body: bytes) -> None:
        if self.chunked:
            self.client.transport.write(_chunk(body))
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        client = self.client
        if self.chunked:
            client.transport.write(b"0\r\n\r\n")
        else:
            body = b"".join(self.body)
            client.transport.write(
                self._head(b"content-length: %d\r\n" % len(body)) + body)
        self.client, self.headers, self.chunked, self.body = None, [], False, []
        if self.parser.should_keep_alive():
            self.proxy.idle.append(self)
        else:
            self.transport.close()


# --- running -------------------------------------------------------------------------------


async def _serve(handler, host: str, port: int) -> None:
    if isinstance(handler, FloorProxy):
        server = await asyncio.get_running_loop().create_server(
            handler.connection, host, port, backlog=1024)
    else:
        server = await asyncio.start_server(handler, host, port, backlog=1024)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/fake_engine.py", description=__doc__.split(
        "\n\n")[0])
    sub = parser.add_subparsers(dest="role", required=True)
    engine = sub.add_parser("engine", help="the fake engine")
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, required=True)
    engine.add_argument("--alias", default="fake", help="the model name it answers with")
    engine.add_argument("--events", type=int, default=64, help="SSE events per stream")
    engine.add_argument("--gap-ms", type=float, default=1.0,
                        help="milliseconds between two events of a stream")
    proxy = sub.add_parser("proxy", help="the floor proxy")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, required=True)
    proxy.add_argument("--upstream", required=True, metavar="HOST:PORT")
    # llmgw's llama.cpp adapter passes llama-server's flags; the engine ignores the rest.
    args, _ = parser.parse_known_args(argv)
    if args.role == "engine":
        handler = FakeEngine(args.alias, max(1, args.events), args.gap_ms / 1e3).serve
    else:
        host, _, port = args.upstream.rpartition(":")
        handler = FloorProxy(host, int(port))
    with contextlib.suppress(KeyboardInterrupt):
        if args.role == "engine":
            asyncio.run(_serve(handler, args.host, args.port))
        else:
            uvloop.run(_serve(handler, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
