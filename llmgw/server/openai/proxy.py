"""Forwarding one request to an engine, and its answer back, stream or not.

The client's body is forwarded exactly as sent; only ``model`` and ``stream`` were read
to route it. A streamed answer is relayed chunk by chunk as the engine writes it, never
buffered. The upstream request is closed as soon as the client goes away, so the engine
stops generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import msgspec
from litestar import Response
from litestar.response import Stream

from llmgw.config import Gateway
from llmgw.server.errors import ApiError
from llmgw.server.openai.router import Lease

log = logging.getLogger(__name__)

def _stream_error(message: str, code: str) -> bytes:
    """An OpenAI-shaped error as the stream's last event: a client reading SSE sees why."""
    body = msgspec.json.encode({"error": {"message": message, "type": "server_error",
                                          "code": code}})
    return b"data: " + body + b"\n\n"

# Passed on from the engine's answer; everything else (hop-by-hop, lengths) is ours.
_KEEP_HEADERS = ("content-type", "cache-control")


def client_session(gateway: Gateway) -> aiohttp.ClientSession:
    """One pooled session for every upstream request of this server process."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=gateway.connect_timeout_s),
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
        auto_decompress=False,
    )


class Retryable(Exception):
    """The engine refused before answering anything; another replica may take it."""


class ClientGone(Exception):
    """The client went away before its answer was ready; the upstream request is closed."""


async def until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return when the ASGI server says the client has gone (after the body was read,
    the next message is ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def forward(http: aiohttp.ClientSession, endpoint: Lease, path: str, body: bytes,
                  stream: bool, gateway: Gateway,
                  receive: Callable[[], Awaitable[dict]] | None = None) -> Response:
    """Forward one request. ``receive`` (the ASGI receive of the client's request) lets a
    client that leaves before the answer starts close the upstream request at once."""
    if receive is None:
        return await _forward(http, endpoint, path, body, stream, gateway)
    # One watcher task, which cancels this one if the client goes: cheaper per request
    # than racing two tasks.
    handler = asyncio.current_task()
    waiting = True
    gone = False

    def on_disconnect(watcher: asyncio.Task) -> None:
        nonlocal gone
        if waiting and not watcher.cancelled() and watcher.exception() is None:
            gone = True
            handler.cancel()

    watcher = asyncio.get_running_loop().create_task(until_disconnect(receive))
    watcher.add_done_callback(on_disconnect)
    try:
        return await _forward(http, endpoint, path, body, stream, gateway)
    except asyncio.CancelledError:
        if gone and handler.uncancel() == 0:
            # Cancelling closed the upstream connection: the engine stops generating.
            raise ClientGone(endpoint.replica) from None
        raise
    finally:
        waiting = False
        watcher.cancel()


async def _forward(http: aiohttp.ClientSession, endpoint: Lease, path: str, body: bytes,
                   stream: bool, gateway: Gateway) -> Response:
    # Released when the answer is done, or at once when this raises.
    release = endpoint.release
    try:
        async with asyncio.timeout(gateway.first_byte_timeout_s):
            upstream = await http.post(
                endpoint.base_url + path, data=body,
                headers={"content-type": "application/json",
                         "accept": "text/event-stream" if stream else "application/json"},
                # A stream's reads time out when idle; a non-streamed answer is waited for
                # as a whole, under the first-byte limit above.
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=gateway.connect_timeout_s,
                    sock_read=gateway.idle_timeout_s if stream else None),
            )
    except TimeoutError:
        release()
        # Not retried: the engine may still be working on it, and another replica would
        # start the same work again.
        raise ApiError(504, f"{endpoint.replica} sent nothing for "
                       f"{gateway.first_byte_timeout_s:g} s (gateway.first_byte_timeout_s)",
                       code="upstream_timeout") from None
    except aiohttp.ClientConnectionError as err:
        release()
        raise Retryable(f"{endpoint.replica}: {err}") from None
    except BaseException:
        release()
        raise
    if upstream.status == 503:
        upstream.close()
        release()
        raise Retryable(f"{endpoint.replica} answered 503")
    headers = {k: v for k, v in upstream.headers.items() if k.lower() in _KEEP_HEADERS}
    media_type = upstream.headers.get("content-type", "application/json")
    if stream and upstream.status == 200 and media_type.startswith("text/event-stream"):
        return Stream(_relay(upstream, release, endpoint.replica, gateway.idle_timeout_s),
                      status_code=200, media_type=media_type,
                      headers={**headers, "x-accel-buffering": "no"})
    try:
        async with asyncio.timeout(gateway.idle_timeout_s):
            content = await upstream.read()
    except TimeoutError:
        upstream.close()
        raise ApiError(504, f"{endpoint.replica} stopped sending its answer for "
                       f"{gateway.idle_timeout_s:g} s (gateway.idle_timeout_s)",
                       code="upstream_timeout") from None
    except aiohttp.ClientError as err:
        raise ApiError(502, f"the engine of {endpoint.replica} broke off its answer: {err}",
                       code="upstream_error") from None
    finally:
        upstream.release()
        release()
    return Response(content, status_code=upstream.status, media_type=media_type,
                    headers={k: v for k, v in headers.items() if k.lower() != "content-type"})


async def _relay(upstream: aiohttp.ClientResponse, release, replica: str,
                 idle_timeout_s: float) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.content.iter_any():
            yield chunk
    except TimeoutError:
        log.warning("%s sent nothing for %g s mid-stream; ending the stream", replica,
                    idle_timeout_s)
        yield _stream_error(f"{replica} sent nothing for {idle_timeout_s:g} s "
                            "(gateway.idle_timeout_s)", "upstream_timeout")
    except aiohttp.ClientError as err:
        log.warning("%s broke off its stream: %s", replica, err)
        yield _stream_error(f"the engine of {replica} broke off the stream",
                            "upstream_error")
    finally:
        # Closing (not releasing) drops the connection, which is how the engine learns that
        # nobody is listening any more.
        upstream.close()
        release()
