"""Forwarding one request to an engine, and writing its answer to the client, stream or not.

The client's body is forwarded exactly as sent; only ``model`` and ``stream`` were read
to route it. The answer is written straight to the ASGI ``send`` of the client's request:
a streamed answer chunk by chunk as the engine writes it, never buffered. Cancelling the
task that forwards (the route does when the client goes away) closes the upstream
connection, so the engine stops generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec

from llmgw.config import Gateway
from llmgw.core.usage import StreamUsage, Usage, usage_from_body
from llmgw.server.errors import ApiError
from llmgw.server.openai.router import Lease

log = logging.getLogger(__name__)

Send = Callable[[dict], Awaitable[None]]

# Passed on from the engine's answer; everything else (hop-by-hop, lengths) is ours.
_KEEP_HEADERS = frozenset({"content-type", "cache-control"})
_JSON = b"application/json"


def stream_error(message: str, code: str) -> bytes:
    """An OpenAI-shaped error as the stream's last event: a client reading SSE sees why."""
    body = msgspec.json.encode({"error": {"message": message, "type": "server_error",
                                          "code": code}})
    return b"data: " + body + b"\n\n"


def client_session(gateway: Gateway) -> aiohttp.ClientSession:
    """One pooled session for every upstream request of this server process."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=gateway.connect_timeout_s),
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
        auto_decompress=False,
    )


class Retryable(Exception):
    """The engine refused before answering anything; another replica may take it."""


def _headers(upstream: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in upstream.headers.items()
            if k.lower() in _KEEP_HEADERS]


UsageSink = Callable[[Usage | None], None]


async def forward(http: aiohttp.ClientSession, lease: Lease, path: str, body: bytes,
                  stream: bool, gateway: Gateway, send: Send,
                  usage: UsageSink | None = None) -> None:
    """Forward one request on ``lease`` and write the answer with ``send``. Raises
    ``Retryable`` or ``ApiError`` only before anything was sent to the client; the lease is
    released however this ends. ``usage``, when given, is called once with the tokens the
    engine reported for a successful answer (None when it reported none)."""
    try:
        try:
            async with asyncio.timeout(gateway.first_byte_timeout_s):
                upstream = await http.post(
                    lease.base_url + path, data=body,
                    headers={"content-type": "application/json",
                             "accept": "text/event-stream" if stream else "application/json"},
                    # A stream's reads time out when idle; a non-streamed answer is waited
                    # for as a whole, under the first-byte limit above.
                    timeout=aiohttp.ClientTimeout(
                        total=None, sock_connect=gateway.connect_timeout_s,
                        sock_read=gateway.idle_timeout_s if stream else None),
                )
        except aiohttp.ConnectionTimeoutError:
            # Nothing was sent: another replica may take it.
            raise Retryable(f"{lease.replica}: no connection within "
                            f"{gateway.connect_timeout_s:g} s") from None
        except aiohttp.SocketTimeoutError:
            # A stream's first event is held to the idle limit too.
            raise ApiError(504, f"{lease.replica} sent nothing for "
                           f"{gateway.idle_timeout_s:g} s (gateway.idle_timeout_s)",
                           code="upstream_timeout") from None
        except TimeoutError:
            # Not retried: the engine may still be working on it, and another replica
            # would start the same work again.
            raise ApiError(504, f"{lease.replica} sent nothing for "
                           f"{gateway.first_byte_timeout_s:g} s "
                           "(gateway.first_byte_timeout_s)", code="upstream_timeout") from None
        except aiohttp.ClientConnectionError as err:
            raise Retryable(f"{lease.replica}: {err}") from None
        try:
            if upstream.status == 503:
                raise Retryable(f"{lease.replica} answered 503")
            media_type = upstream.headers.get("content-type", "application/json")
            if stream and upstream.status == 200 and media_type.startswith("text/event-stream"):
                await _relay(upstream, lease.replica, gateway.idle_timeout_s, send, usage)
            else:
                await _answer(upstream, lease.replica, gateway.idle_timeout_s, send, usage)
        finally:
            # Closing (not releasing) drops the connection where the answer was cut short,
            # which is how the engine learns that nobody is listening any more.
            if upstream.content.is_eof():
                upstream.release()
            else:
                upstream.close()
    finally:
        lease.release()


async def _answer(upstream: aiohttp.ClientResponse, replica: str, idle_timeout_s: float,
                  send: Send, usage: UsageSink | None) -> None:
    try:
        async with asyncio.timeout(idle_timeout_s):
            content = await upstream.read()
    except TimeoutError:
        raise ApiError(504, f"{replica} stopped sending its answer for {idle_timeout_s:g} s "
                       "(gateway.idle_timeout_s)", code="upstream_timeout") from None
    except aiohttp.ClientError as err:
        raise ApiError(502, f"the engine of {replica} broke off its answer: {err}",
                       code="upstream_error") from None
    headers = _headers(upstream)
    if not any(k == b"content-type" for k, _ in headers):
        headers.append((b"content-type", _JSON))
    headers.append((b"content-length", str(len(content)).encode()))
    await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
    await send({"type": "http.response.body", "body": content})
    if usage is not None and 200 <= upstream.status < 300:
        usage(usage_from_body(content))


async def _relay(upstream: aiohttp.ClientResponse, replica: str, idle_timeout_s: float,
                 send: Send, usage: UsageSink | None) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [*_headers(upstream), (b"x-accel-buffering", b"no")]})
    tail = b""
    reader = StreamUsage() if usage is not None else None
    try:
        try:
            async for chunk in upstream.content.iter_any():
                if reader is not None:
                    reader.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except TimeoutError:
            log.warning("%s sent nothing for %g s mid-stream; ending the stream", replica,
                        idle_timeout_s)
            tail = stream_error(f"{replica} sent nothing for {idle_timeout_s:g} s "
                                "(gateway.idle_timeout_s)", "upstream_timeout")
        except aiohttp.ClientError as err:
            log.warning("%s broke off its stream: %s", replica, err)
            tail = stream_error(f"the engine of {replica} broke off the stream",
                                "upstream_error")
        await send({"type": "http.response.body", "body": tail, "more_body": False})
    finally:
        if reader is not None:
            # Counted however the stream ended (broken off, or the client left): the
            # tokens were spent. An engine reports usage only at the end, so a stream cut
            # short counts as a request without tokens.
            usage(reader.end())
