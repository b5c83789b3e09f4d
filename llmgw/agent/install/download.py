"""Downloading one file that is checked against a sha256 given in advance.

The bytes go to a dotted scratch name beside the destination, are hashed and counted as
they arrive, and are renamed into place only when their number and digest are right: a
download that is cut off, too large or not the file the publisher described never takes
the destination's name.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

import aiohttp
from yarl import URL

from llmgw.agent.client_errors import describe
from llmgw.agent.install.pypi import InstallError

CHUNK = 2**20
_SHA256 = re.compile(r"[0-9a-f]{64}")

Progress = Callable[[int, int | None], None]  # (bytes so far, total when the server says)


def check_sha256(sha256: str) -> str:
    """``sha256`` in lowercase hex; InstallError when it is not 64 hex digits."""
    digest = sha256.strip().lower()
    if not _SHA256.fullmatch(digest):
        raise InstallError(f"{sha256!r} is not a sha256 digest (64 hex digits)")
    return digest


def shown(url: str | URL) -> str:
    """A URL for messages: without its query, which may carry a signature."""
    return str(URL(url).with_query(None).with_fragment(None))


async def download(session: aiohttp.ClientSession, url: str, dest: Path, *, sha256: str,
                   max_bytes: int, progress: Progress | None = None) -> None:
    """Fetch ``url`` into ``dest``. ``progress(done, total)`` is called once the answer's
    headers arrive (``done`` 0) and after every chunk. Raises InstallError naming what
    went wrong: the HTTP status, a body over ``max_bytes``, a cut-off body, or a digest
    that is not ``sha256`` (both digests named)."""
    expected = check_sha256(sha256)
    part = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.part")
    try:
        got = await _fetch(session, url, part, max_bytes, progress)
        if got != expected:
            raise InstallError(f"{shown(url)} has sha256 {got}, but {expected} was expected: "
                               "the file is corrupt, or not the one that was published")
        await asyncio.to_thread(os.replace, part, dest)
    except OSError as err:
        raise InstallError(f"downloading {shown(url)} to {dest}: "
                           f"{err.strerror or err}") from None
    finally:
        part.unlink(missing_ok=True)


async def _fetch(session: aiohttp.ClientSession, url: str, part: Path, max_bytes: int,
                 progress: Progress | None) -> str:
    """Write the body at ``url`` to ``part``; its sha256."""
    hasher = hashlib.sha256()
    done = 0
    buffer = bytearray()
    out = await asyncio.to_thread(open, part, "xb")
    try:
        # The bytes as published: a server that labels a .tar.gz gzip-encoded must not
        # have it inflated before it is hashed.
        async with session.get(url, auto_decompress=False) as resp:
            if resp.status != 200:
                via = (f" (redirected to {shown(resp.url)})"
                       if shown(resp.url) != shown(url) else "")
                raise InstallError(f"GET {shown(url)}{via} answered {resp.status} "
                                   f"{resp.reason}")
            total = resp.content_length
            if total is not None and total > max_bytes:
                raise InstallError(f"{shown(url)} is {total} bytes, more than the "
                                   f"{max_bytes} an engine archive may be")
            if progress:
                progress(0, total)
            try:
                async for chunk in resp.content.iter_chunked(CHUNK):
                    done += len(chunk)
                    if done > max_bytes:
                        raise InstallError(f"{shown(url)} runs past {max_bytes} bytes, "
                                           "more than an engine archive may be")
                    hasher.update(chunk)
                    buffer += chunk
                    if len(buffer) >= CHUNK:
                        await asyncio.to_thread(out.write, bytes(buffer))
                        buffer.clear()
                    if progress:
                        progress(done, total)
            except (aiohttp.ClientError, TimeoutError) as err:
                of = f" of {total}" if total is not None else ""
                raise InstallError(f"GET {shown(url)} broke off after {done}{of} bytes: "
                                   f"{describe(err)}") from None
            if total is not None and done != total:
                raise InstallError(f"GET {shown(url)} ended after {done} of {total} bytes: "
                                   "the download is truncated")
        await asyncio.to_thread(out.write, bytes(buffer))
    except (aiohttp.ClientError, TimeoutError) as err:
        raise InstallError(f"GET {shown(url)}: {describe(err)}") from None
    finally:
        await asyncio.to_thread(out.close)
    return hasher.hexdigest()
