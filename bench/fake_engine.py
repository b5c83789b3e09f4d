"""The bare asyncio HTTP/1.1 servers that ``bench.gateway`` runs, each in its own process.

- ``engine``: a fake OpenAI-compatible engine. ``POST /v1/chat/completions`` (and
  ``/v1/completions``) answers a fixed small JSON, or, when the body asks for
  ``"stream": true``, ``--events`` SSE events ``--gap-ms`` apart then ``data: [DONE]``;
  ``GET /health`` answers 200. It reads no JSON and answers prepared bytes, so a request
  costs it little more than the event loop's wake-up and the loopback TCP (the issue
  measured about 10 µs; on a busy two-core machine it reads 30 to 50 µs): what a gateway
  adds is then most of what there is to measure.
- ``proxy``: the floor, a bare L7 proxy to one upstream: it parses each request's head and
  body, forwards it over a pooled keep-alive connection, and relays the answer, a
  chunked stream chunk by chunk as it comes. It reads no field of the body (a gateway must
  read ``model`` and ``stream`` to route; with msgspec that is about 1 µs).

Both share the minimal HTTP/1.1 parsing below: keep-alive, ``content-length`` bodies and
chunked answers, nothing else (no pipelining, no ``expect``, no trailers). They use plain
asyncio streams on the default event loop: uvloop and httptools are not installed in this
project's environment, and the bench adds no dependency.

Only the standard library is imported, so the processes start fast and carry no weight a
gateway would not. Run as ``python bench/fake_engine.py engine --host H --port P`` (other
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
    """Every request to one upstream, over a pool of idle keep-alive connections."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.host_header = f"{host}:{port}".encode()
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self.idle:
            reader, writer = self.idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, path, headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
                length = int(headers.get(b"content-length", b"0"))
                body = await reader.readexactly(length) if length else b""
                await self._forward(method, path, headers, body, writer)
                if headers.get(b"connection", b"").lower() == b"close":
                    break
        except _CLOSED:
            pass
        finally:
            writer.close()

    async def _forward(self, method: bytes, path: bytes, headers: dict[bytes, bytes],
                       body: bytes, client: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await self._upstream()
        up_writer.write(
            method + b" " + path + b" HTTP/1.1\r\nhost: " + self.host_header
            + b"\r\ncontent-type: " + headers.get(b"content-type", b"application/json")
            + b"\r\naccept: " + headers.get(b"accept", b"*/*")
            + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = await up_reader.readuntil(b"\r\n\r\n")
        _, _, up_headers = parse_head(head)
        if up_headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            client.write(head)
            while True:
                size_line = await up_reader.readuntil(b"\r\n")
                size = int(size_line[:-2].split(b";", 1)[0], 16)
                data = await up_reader.readexactly(size + 2)
                client.write(size_line + data)
                await client.drain()
                if size == 0:
                    break
        else:
            length = int(up_headers.get(b"content-length", b"0"))
            client.write(head + (await up_reader.readexactly(length) if length else b""))
            await client.drain()
        if up_headers.get(b"connection", b"").lower() == b"close":
            up_writer.close()
        else:
            self.idle.append((up_reader, up_writer))


# --- running -------------------------------------------------------------------------------


async def _serve(handler, host: str, port: int) -> None:
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
        handler = FloorProxy(host, int(port)).serve
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(handler, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
