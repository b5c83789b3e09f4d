"""One plain HTTP GET for its status code: the gateway's own health check of an engine, and
of a server someone else runs (a ``target.Target``).

A connection per check, closed after the status line: the check runs every second or few
per upstream it covers, and must not hold one of the pool's connections, whose answers
relay client requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from llmgw.transport.pool import host_header


async def get_status(host: str, port: int, path: str, timeout_s: float) -> int | None:
    """The status code ``GET path`` answers with, or None when there is no answer in
    ``timeout_s`` (refused, reset, silent, not HTTP)."""
    request = (b"GET " + path.encode() + b" HTTP/1.1\r\nHost: " + host_header(host, port)
               + b"\r\nConnection: close\r\n\r\n")
    answer = await ask_status(host, port, request, timeout_s)
    return answer if isinstance(answer, int) else None


async def ask_status(host: str, port: int, request: bytes, timeout_s: float, *,
                     tls: ssl.SSLContext | None = None,
                     server_hostname: str | None = None) -> int | str:
    """The status code the upstream at ``host:port`` answers ``request`` (a whole GET)
    with, over TLS with ``tls``; or, when there is no answer in ``timeout_s``, why not in
    words an operator can act on ("connection refused", "no answer within 2 s", "TLS:
    certificate verify failed: …")."""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=tls, server_hostname=server_hostname if tls else None)
            writer.write(request)
            line = await reader.readline()
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except ssl.SSLCertVerificationError as err:
        return f"TLS: certificate verify failed: {err.verify_message}"
    except ssl.SSLError as err:
        return f"TLS: {err.reason or err}"
    except OSError as err:
        return (err.strerror or str(err) or type(err).__name__).lower()
    finally:
        if writer is not None:
            if tls is not None:
                writer.transport.abort()  # no TLS shutdown to wait out (up to 30 s)
            else:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        return "its answer is not HTTP" if line else "it closed the connection unanswered"
    return int(parts[1])
