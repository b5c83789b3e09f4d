"""A lean HTTP/1.1 client for the one thing the gateway does upstream: POST a body to an
engine and read its answer, whole or chunk by chunk.

aiohttp's client, measured on the gateway's hot path, cost more CPU per proxied request
than everything else llmgw does for it (request objects, header multidicts, timeouts as
context managers, a task per read). This client keeps one ``asyncio.Protocol`` per
keep-alive connection with httptools (llhttp) parsing the answer, and writes each request
as one buffer. It does no redirects, cookies, proxies, decompression or pipelining:
engines are plain HTTP on the cluster's network. A server someone else runs (a static
endpoint) is a ``target.Target``: its path prefix, Host, Authorization header and TLS,
made once; a request to an engine pays nothing for them.

Timeouts are timer handles on the exchange, not ``asyncio.timeout`` scopes: the idle timer
is re-armed lazily (at most once per idle period), so a stream of thousands of chunks costs
a handful of timers.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from typing import TYPE_CHECKING

from llmgw.core.names import url_host
from llmgw.transport.answer import Answer
from llmgw.transport.connection import Connection
from llmgw.transport.errors import ConnectError, Undelivered, UpstreamError

if TYPE_CHECKING:
    from llmgw.transport.target import Target

log = logging.getLogger(__name__)

# What a request body is unless told otherwise, and what an answer without a type is.
JSON_TYPE = b"application/json"
# Idle keep-alive connections kept per engine address.
_MAX_IDLE = 64


@functools.lru_cache(maxsize=1024)
def host_header(host: str, port: int) -> bytes:
    """``host:port`` as the Host header has it (IPv6 in brackets), once per engine address:
    the idna codec is pure Python and would cost more than the rest of the request head."""
    return url_host(host).encode("idna") + b":" + str(port).encode()


def request_bytes(host: str, port: int, path: str, body: bytes, accept: bytes,
                  content_type: bytes = JSON_TYPE) -> bytes:
    """A POST of ``body`` to the engine at ``host:port``, head and body in one buffer."""
    return b"".join((b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\nhost: ",
                     host_header(host, port),
                     b"\r\ncontent-type: ", content_type, b"\r\naccept: ", accept,
                     b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n\r\n", body))


class Pool:
    """Keep-alive connections per engine address (and per ``Target``), for every upstream
    request of a server process."""

    def __init__(self, connect_timeout_s: float):
        self.connect_timeout_s = connect_timeout_s
        # By (host, port) of an engine, or a Target's ``address``.
        self._idle: dict[tuple, collections.deque[Connection]] = {}
        self._closed = False

    async def post(self, host: str, port: int, path: str, body: bytes, accept: bytes,
                   *, first_byte_timeout_s: float, idle_timeout_s: float | None,
                   content_type: bytes = JSON_TYPE, target: Target | None = None) -> Answer:
        """Send the request and wait for the answer's status and headers (under
        ``first_byte_timeout_s``); the body is read from the returned Answer, its first
        byte still under ``first_byte_timeout_s``, each wait for more after that under
        ``idle_timeout_s`` when given. The request is sent a second time only when it went
        on a kept-alive connection that the engine had closed before the request reached
        it (``Undelivered``), and then on a new connection; an error of that one is
        raised as it is. With a ``target``, the request goes to it as it says (its
        ``host`` and ``port`` are then the ones given)."""
        payload = request_bytes(host, port, path, body, accept, content_type) \
            if target is None else target.request(path, body, accept, content_type)
        for attempt in range(2):
            conn, reused = await self._connection(host, port, attempt > 0, target)
            answer = Answer(conn, first_byte_timeout_s, idle_timeout_s)
            conn.start(answer, payload)
            try:
                await answer.headers_done()
                return answer
            except UpstreamError as err:
                conn.abort()
                # A pooled connection the engine had closed before the request reached it
                # (its TCP never acknowledged it): once more, on a new connection, never
                # another pooled one. Anything else that broke after the request was
                # written is not sent again: the engine may have been working on it. A
                # new connection is never tried twice.
                if reused and isinstance(err, Undelivered):
                    continue
                raise
            except BaseException:
                conn.abort()  # cancelled while waiting: the engine must see us go
                raise
        raise AssertionError("unreachable")

    def send_now(self, host: str, port: int, payload: bytes, first_byte_timeout_s: float,
                 idle_timeout_s: float | None) -> Answer | None:
        """``payload`` (``request_bytes``) sent at once on an idle kept-alive connection to
        the engine, without waiting: its Answer, whose head comes later (``Answer.watch``
        says when), under the same limits as ``post``. None when no idle connection is
        there (``post`` makes one)."""
        conn = self._idle_connection((host, port))
        if conn is None:
            return None
        answer = Answer(conn, first_byte_timeout_s, idle_timeout_s)
        conn.start(answer, payload)
        answer._arm_head()
        return answer

    def _idle_connection(self, address: tuple) -> Connection | None:
        idle = self._idle.get(address)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
        return None

    async def _connection(self, host: str, port: int, fresh: bool = False,
                          target: Target | None = None) -> tuple[Connection, bool]:
        """A connection to the engine (or ``target``), and whether it was kept alive from
        an earlier request: an idle one from the pool unless ``fresh``, else a new one."""
        address = (host, port) if target is None else target.address
        if not fresh:
            conn = self._idle_connection(address)
            if conn is not None:
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if target is None:
                    _, conn = await loop.create_connection(
                        lambda: Connection(self, address), host, port)
                else:  # its TLS handshake within the same limit
                    _, conn = await loop.create_connection(
                        lambda: Connection(self, address), host, port, ssl=target.tls,
                        server_hostname=target.server_hostname)
        except TimeoutError:
            raise ConnectError(f"no connection to {host}:{port} within "
                               f"{self.connect_timeout_s:g} s", timed_out=True) from None
        except OSError as err:
            raise ConnectError(f"cannot connect to {host}:{port}: "
                               f"{err.strerror or err}") from None
        return conn, False

    def _put_back(self, conn: Connection) -> None:
        if self._closed:
            conn.abort()
            return
        idle = self._idle.get(conn.address)
        if idle is None:
            self._idle[conn.address] = collections.deque((conn,))
        elif len(idle) >= _MAX_IDLE:
            conn.abort()
        else:
            idle.append(conn)

    def _forget(self, conn: Connection) -> None:
        idle = self._idle.get(conn.address)
        if idle is None:
            return
        if conn in idle:
            idle.remove(conn)
        if not idle:
            # Replicas come and go on new ports: keep no entry for an address with no
            # connection left.
            del self._idle[conn.address]

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().abort()


