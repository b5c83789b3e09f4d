"""Forwarding one request to an engine, and its answer back, stream or not.

The client's body is forwarded exactly as sent; only ``model`` and ``stream`` were read
to route it. A streamed answer is relayed chunk by chunk as the engine writes it, never
buffered. The upstream request is closed as soon as the client goes away, so the engine
stops generating for nobody.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
from litestar import Response
from litestar.response import Stream

from llmgw.server.errors import ApiError
from llmgw.server.openai.router import Endpoint

log = logging.getLogger(__name__)

_BROKEN_STREAM = (
    b'data: {"error":{"message":"the engine broke off the stream",'
    b'"type":"server_error","code":"upstream_error"}}\n\n'
)
# Passed on from the engine's answer; everything else (hop-by-hop, lengths) is ours.
_KEEP_HEADERS = ("content-type", "cache-control")


def client_session() -> aiohttp.ClientSession:
    """One pooled session for every upstream request of this server process."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
        auto_decompress=False,
    )


class Retryable(Exception):
    """The engine refused before answering anything; another replica may take it."""


async def forward(http: aiohttp.ClientSession, endpoint: Endpoint, path: str, body: bytes,
                  stream: bool) -> Response:
    endpoint.in_flight += 1
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            endpoint.in_flight -= 1

    try:
        upstream = await http.post(
            endpoint.base_url + path, data=body,
            headers={"content-type": "application/json",
                     "accept": "text/event-stream" if stream else "application/json"},
        )
    except (aiohttp.ClientConnectionError, TimeoutError) as err:
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
        return Stream(_relay(upstream, release), status_code=200, media_type=media_type,
                      headers={**headers, "x-accel-buffering": "no"})
    try:
        content = await upstream.read()
    except aiohttp.ClientError as err:
        raise ApiError(502, f"the engine of {endpoint.replica} broke off its answer: {err}",
                       code="upstream_error") from None
    finally:
        upstream.release()
        release()
    return Response(content, status_code=upstream.status, media_type=media_type,
                    headers={k: v for k, v in headers.items() if k.lower() != "content-type"})


async def _relay(upstream: aiohttp.ClientResponse, release) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.content.iter_any():
            yield chunk
    except aiohttp.ClientError as err:
        log.warning("engine stream broke off: %s", err)
        yield _BROKEN_STREAM
    finally:
        # Closing (not releasing) drops the connection, which is how the engine learns that
        # nobody is listening any more.
        upstream.close()
        release()
