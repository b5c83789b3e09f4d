"""granian as the HTTP server (llmgw.server.serve_granian), in process on loopback: what
test_http_server.py checks of uvicorn's, where granian offers it (TLS 1.3 only, forwarding
headers not trusted, a bounded head, the two-step stop), and a granian that ends on its
own is an error, not a clean stop. The gateway's contract on granian, through real
processes: test_openai_client.py, test_gateway.py, test_socket_activation.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from llmgw.config import Listen
from llmgw.server.listen import listening_socket
from llmgw.server.serve_granian import GranianServer, GranianStopped
from llmgw.transport.server import MAX_HEAD_BYTES


async def _lifespan(receive, send) -> None:
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


class _Echo:
    """Answers what the server told it of the client; ``/slow/N`` answers after N seconds."""

    def __init__(self) -> None:
        self.slow_started = 0
        self.slow_changed = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["path"].startswith("/slow/"):
            self.slow_started += 1
            self.slow_changed.set()
            await asyncio.sleep(float(scope["path"].removeprefix("/slow/")))
        body = json.dumps({"client": scope["client"][0], "scheme": scope["scheme"]}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def until_slow_started(self, count: int) -> None:
        while self.slow_started < count:
            self.slow_changed.clear()
            await asyncio.wait_for(self.slow_changed.wait(), 10)


@contextlib.asynccontextmanager
async def _serving(app=None, tls: tuple[Path, Path] | None = None
                   ) -> AsyncIterator[tuple[GranianServer, int, asyncio.Task]]:
    # Bound before granian starts: a request sent at once waits in the socket's queue.
    sock, _ = listening_socket(Listen(host="127.0.0.1", port=0))
    port = sock.getsockname()[1]
    server = GranianServer(app or _Echo(), sock, tls)
    task = asyncio.create_task(server.serve())
    try:
        yield server, port, task
    finally:
        if not task.done():
            server.stop()
            server.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 15)


async def test_tls_13_is_served_and_tls_12_refused(server_cert):
    ca, cert, key = server_cert
    async with _serving(tls=(cert, key)) as (_, port, _), aiohttp.ClientSession() as http:
        modern = ssl.create_default_context(cafile=ca)
        async with http.get(f"https://127.0.0.1:{port}/", ssl=modern) as resp:
            assert resp.status == 200
            assert (await resp.json())["scheme"] == "https"
        old = ssl.create_default_context(cafile=ca)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(aiohttp.ClientConnectorError):
            async with http.get(f"https://127.0.0.1:{port}/", ssl=old):
                pass


async def test_forwarding_headers_are_not_trusted():
    headers = {"x-forwarded-for": "203.0.113.9", "x-forwarded-proto": "https"}
    async with (_serving() as (_, port, _), aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{port}/", headers=headers) as resp):
        assert resp.status == 200
        # The peer's address, not the header's: metrics and login throttling key on it.
        assert await resp.json() == {"client": "127.0.0.1", "scheme": "http"}


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer


async def test_a_head_far_over_the_limit_is_refused():
    # granian stops reading a head once its buffer (MAX_HEAD_BYTES) is full after a read,
    # so the bound is not exact: a head up to about twice it may pass.
    huge = b"x-big: " + b"a" * (3 * MAX_HEAD_BYTES) + b"\r\n"
    async with _serving() as (_, port, _):
        answer = await asyncio.to_thread(
            _raw, port, b"GET / HTTP/1.1\r\nhost: x\r\n" + huge + b"connection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


async def test_stop_lets_a_request_finish_and_a_second_stop_ends_the_rest():
    app = _Echo()
    async with _serving(app) as (server, port, task), aiohttp.ClientSession() as http:
        quick = asyncio.create_task(http.get(f"http://127.0.0.1:{port}/slow/0.5"))
        slow = asyncio.create_task(http.get(f"http://127.0.0.1:{port}/slow/60"))
        await app.until_slow_started(2)
        server.stop()
        resp = await asyncio.wait_for(quick, 10)
        assert resp.status == 200  # finished although the server was stopping
        await resp.release()
        assert not task.done()  # the slow one holds the stop
        server.stop()
        await asyncio.wait_for(task, 5)  # ended at once, not after GRACEFUL_STOP_S
        slow.cancel()


async def _startup_fails(scope, receive, send) -> None:
    assert scope["type"] == "lifespan"
    await receive()
    await send({"type": "lifespan.startup.failed", "message": "no store"})


async def test_granian_ending_on_its_own_is_an_error():
    async with _serving(_startup_fails) as (_, _, task):
        with pytest.raises(GranianStopped, match="ASGI lifespan startup failed"):
            await asyncio.wait_for(task, 10)
