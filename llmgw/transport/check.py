"""One plain HTTP GET for its status code: the gateway's own health check of an engine.

A connection per check, closed after the status line: the check runs about once a second
per engine it covers, and must not hold one of the pool's connections, whose answers
relay client requests.
"""

from __future__ import annotations

import asyncio
import contextlib

from llmgw.transport.pool import host_header


async def get_status(host: str, port: int, path: str, timeout_s: float) -> int | None:
    """The status code ``GET path`` answers with, or None when there is no answer in
    ``timeout_s`` (refused, reset, silent, not HTTP)."""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: "
                         + host_header(host, port) + b"\r\nConnection: close\r\n\r\n")
            line = await reader.readline()
    except (OSError, TimeoutError):
        return None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        return None
    return int(parts[1])
