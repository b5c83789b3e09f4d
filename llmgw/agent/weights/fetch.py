"""Fetching from a Hugging Face-style hub: the repository's listing (paged, bounded and
every path checked), downloads hashed as they are written and checked against the
listing, the free-space check before a fetch, and its progress messages."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import json
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from ssl import SSLContext
from urllib.parse import quote

import aiohttp
from yarl import URL

from llmgw.agent.client_errors import describe
from llmgw.agent.weights.manifest import (
    CHUNK,
    MANIFEST,
    ManifestFile,
    WeightsError,
    check_path,
    part_of,
    size_text,
)
from llmgw.core.weights import Source

MAX_FILES = 10_000  # entries in a repository's listing
MAX_LISTING_BYTES = 64 * 2**20
MAX_PAGES = 1_000
MAX_REDIRECTS = 10
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


def fraction(done: int, total: int) -> str:
    """Progress: ``3.1/15.2 GB``, or MB for totals under 1 GB."""
    unit, scale = ("GB", 1e9) if total >= 1e9 else ("MB", 1e6)
    return f"{done / scale:.1f}/{total / scale:.1f} {unit}"


@dataclass(frozen=True, slots=True)
class Remote:
    """A file in a hub's listing, with what its download is checked against."""

    path: str
    size: int
    sha256: str | None
    git_oid: str | None


class Meter:
    """Calls ``progress`` at most every ``interval`` seconds, and once at the end."""

    def __init__(self, label: str, total: int, progress: Callable[[str], None],
                 interval: float) -> None:
        self.label, self.total, self.progress, self.interval = label, total, progress, interval
        self.done = 0
        self._last = float("-inf")

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self.say()

    def say(self) -> None:
        self.progress(f"fetching {self.label}: {fraction(self.done, self.total)}")


class _Sink:
    """One file being written: hashed as it is written, the bytes counted."""

    def __init__(self, path: Path, size: int, git: bool) -> None:
        self.file = open(path, "xb")  # noqa: SIM115 — closed by close()
        self.written = 0
        self.sha256 = hashlib.sha256()
        self.git = hashlib.sha1(b"blob %d\0" % size) if git else None

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.sha256.update(data)
        if self.git:
            self.git.update(data)
        self.written += len(data)

    def close(self) -> None:
        self.file.close()


def _show(url: URL) -> str:
    """A URL for messages: without its query, which may carry a signature."""
    return str(url.with_query(None).with_fragment(None))


def check_space(root: Path, total: int, label: str) -> int:
    """Create ``root`` if need be and return the bytes free on it; WeightsError when
    ``total`` bytes would not fit."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(root)
    except OSError as err:
        raise WeightsError(f"fetching {label}: cannot use {root}: {err.strerror}") from None
    free = st.f_bavail * st.f_frsize
    if total > free:
        raise WeightsError(f"fetching {label} needs {size_text(total)}; {root} has "
                           f"{size_text(free)} free: free space or add a weights directory")
    return free


class Hub:
    """A Hugging Face-style hub over one HTTP session: a repository's listing and its
    files. ``hub`` is the configured hub, the only origin ``token`` is sent to. ``mirror``:
    the hub is the control plane's mirror, reached with ``ssl`` (the node's TLS), whose
    refusals say why in their body."""

    def __init__(self, http: aiohttp.ClientSession, hub: str, token: str | None, *,
                 mirror: bool = False, ssl: SSLContext | bool = True) -> None:
        self.http, self.hub, self.token = http, hub, token
        self.mirror, self.ssl = mirror, ssl

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, hub: str, token: str | None, connect_timeout_s: float,
                      read_timeout_s: float, *, mirror: bool = False,
                      ssl: SSLContext | bool = True) -> AsyncIterator[Hub]:
        """A Hub on a new session: no limit on the whole (weights are large), only on
        connecting and on each read."""
        timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                        sock_connect=connect_timeout_s,
                                        sock_read=read_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            yield cls(http, hub, token, mirror=mirror, ssl=ssl)

    @contextlib.asynccontextmanager
    async def _get(self, url: URL, label: str) -> AsyncIterator[aiohttp.ClientResponse]:
        """GET following redirects. The token goes to the configured hub's origin only:
        never to its CDN, nor to another host a profile's source names; so does ``ssl``."""
        for _ in range(MAX_REDIRECTS + 1):
            headers = {}
            own = url.origin() == URL(self.hub).origin()
            if self.token and own:
                headers["Authorization"] = f"Bearer {self.token}"
            try:
                resp = await self.http.get(url, headers=headers, allow_redirects=False,
                                           ssl=self.ssl if own else True)
            except (aiohttp.ClientError, TimeoutError) as err:
                raise WeightsError(f"fetching {label}: GET {_show(url)}: {describe(err)}") from None
            if resp.status in _REDIRECTS and "Location" in resp.headers:
                location = resp.headers["Location"]
                resp.release()
                url = url.join(URL(location))
                if url.scheme not in ("http", "https"):
                    raise WeightsError(f"fetching {label}: redirected to {_show(url)}")
                continue
            try:
                if resp.status != 200:
                    words = await _mirror_words(resp) if self.mirror and own else ""
                    raise WeightsError(
                        f"fetching {label}: GET {_show(url)} answered {resp.status}: {words}"
                        if words else self._http_error(label, url, resp.status))
                yield resp
            finally:
                resp.release()
            return
        raise WeightsError(f"fetching {label}: more than {MAX_REDIRECTS} redirects from "
                           f"{_show(url)}")

    def _http_error(self, label: str, url: URL, status: int) -> str:
        hint = ""
        if status in (401, 403):
            if url.origin() != URL(self.hub).origin():
                hint = (f"gated or private: the token in weights.token_file goes only to "
                        f"weights.hub ({self.hub})")
            elif self.token:
                hint = "gated or private, and the token in weights.token_file was refused"
            else:
                hint = "gated or private: set weights.token_file to a token that may read it"
        elif status == 404:
            hint = "no such repository or revision"
        elif status == 429 or status >= 500:
            hint = "the hub is unavailable; the fetch is tried again later"
        return f"fetching {label}: GET {_show(url)} answered {status}" + (
            f": {hint}" if hint else "")

    async def listing(self, endpoint: URL, src: Source, patterns: list[str],
                      label: str) -> list[Remote]:
        """The files of ``src`` that ``patterns`` select (all when there are none)."""
        url: URL | None = URL(f"{str(endpoint).rstrip('/')}/api/models/{src.repo}/tree/"
                              f"{quote(src.revision, safe='')}?recursive=true", encoded=True)
        entries: list = []
        pages = 0
        while url is not None:
            pages += 1
            if pages > MAX_PAGES:
                raise WeightsError(f"fetching {label}: the listing of {src.repo} runs past "
                                   f"{MAX_PAGES} pages")
            async with self._get(url, label) as resp:
                body = bytearray()
                try:
                    async for chunk in resp.content.iter_chunked(CHUNK):
                        body += chunk
                        if len(body) > MAX_LISTING_BYTES:
                            raise WeightsError(f"fetching {label}: the listing of {src.repo} "
                                               f"is larger than {size_text(MAX_LISTING_BYTES)}")
                except (aiohttp.ClientError, TimeoutError) as err:
                    raise WeightsError(f"fetching {label}: GET {_show(url)}: {describe(err)}") \
                        from None
                following = resp.links.get("next")
            try:
                page = json.loads(body)
            except ValueError:
                page = None
            if not isinstance(page, list):
                raise WeightsError(f"fetching {label}: GET {_show(url)} did not answer a file "
                                   "listing (a JSON list); is the hub a Hugging Face-style hub?")
            entries.extend(page)
            if len(entries) > MAX_FILES:
                raise WeightsError(f"fetching {label}: {src.repo} lists more than {MAX_FILES} "
                                   "files and folders; llmgw refuses a repository that large")
            url = URL(following["url"]) if following else None
        files = _parse_listing(entries, f"fetching {label}: the listing of {src.repo}")
        chosen = [f for f in files if not patterns or any(
            fnmatch.fnmatchcase(f.path, p + "*" if p.endswith("/") else p) for p in patterns)]
        if not chosen:
            have = ", ".join(f.path for f in files[:8]) + (", …" if len(files) > 8 else "")
            raise WeightsError(f"fetching {label}: no file of {src.repo}@{src.revision} matches "
                               f"{', '.join(patterns) or 'anything'}; it has: {have or 'nothing'}")
        return chosen

    async def download(self, endpoint: URL, src: Source, f: Remote, partial: Path,
                       meter: Meter, label: str) -> ManifestFile:
        """Download ``f`` into ``partial``, checked against its size and digests."""
        url = URL(f"{str(endpoint).rstrip('/')}/{src.repo}/resolve/"
                  f"{quote(src.revision, safe='')}/{quote(f.path)}", encoded=True)
        dest = partial / f.path
        await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
        sink = await asyncio.to_thread(_Sink, dest, f.size, f.git_oid is not None)
        try:
            async with self._get(url, label) as resp:
                buffer = bytearray()
                try:
                    async for chunk in resp.content.iter_chunked(CHUNK):
                        if sink.written + len(buffer) + len(chunk) > f.size:
                            raise WeightsError(f"fetching {label}: {f.path} is larger than the "
                                               f"{f.size} bytes the listing says")
                        buffer += chunk
                        meter.add(len(chunk))
                        if len(buffer) >= CHUNK:
                            await asyncio.to_thread(sink.write, bytes(buffer))
                            buffer.clear()
                except (aiohttp.ClientError, TimeoutError) as err:
                    raise WeightsError(
                        f"fetching {label}: GET {_show(resp.url)} broke off after "
                        f"{part_of(sink.written + len(buffer), f.size)}: {describe(err)}") from None
                if buffer:
                    await asyncio.to_thread(sink.write, bytes(buffer))
        finally:
            sink.close()
        if sink.written != f.size:
            raise WeightsError(f"fetching {label}: {f.path} is {sink.written} bytes, the listing "
                               f"says {f.size}")
        sha256 = sink.sha256.hexdigest()
        checks = [("sha256", f.sha256, sha256)]
        if sink.git:
            checks.append(("git oid", f.git_oid, sink.git.hexdigest()))
        for what, expected, got in checks:
            if expected and got != expected:
                raise WeightsError(f"fetching {label}: {f.path}: {what} mismatch: expected "
                                   f"{expected}, got {got}")
        return ManifestFile(path=f.path, size=f.size, sha256=sha256, git_oid=f.git_oid)


async def _mirror_words(resp: aiohttp.ClientResponse) -> str:
    """The reason in the control plane's error envelope; "" when there is none."""
    try:
        body = json.loads(await resp.content.read(8192))
        return str(body["error"]["message"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        return ""


def _parse_listing(entries: list, where: str) -> list[Remote]:
    """The files of a Hugging Face tree listing, every path checked. For an LFS file the
    entry's ``oid`` names the pointer, so its content is checked by ``lfs.oid`` (sha256)."""
    files: dict[str, Remote] = {}
    for e in entries:
        if not isinstance(e, dict) or e.get("type") not in ("file", "directory"):
            raise WeightsError(f"{where} has an entry that is neither file nor directory: "
                               f"{str(e)[:200]}")
        path = e.get("path")
        try:
            check_path(path)
        except WeightsError:
            raise WeightsError(f"{where} names {path!r}, which is not a safe relative path; "
                               "nothing was fetched") from None
        if e["type"] != "file":
            continue
        if path == MANIFEST:
            raise WeightsError(f"{where} holds a file named {MANIFEST}, which is llmgw's own")
        lfs = e.get("lfs") if isinstance(e.get("lfs"), dict) else None
        size = lfs.get("size", e.get("size")) if lfs else e.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise WeightsError(f"{where} gives {path} no valid size")
        sha256 = lfs.get("oid") if lfs else None
        git_oid = None if lfs else e.get("oid")
        if sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", str(sha256)):
            raise WeightsError(f"{where} gives {path} the sha256 {sha256!r}")
        if git_oid is not None and not re.fullmatch(r"[0-9a-f]{40}", str(git_oid)):
            git_oid = None  # not a git blob id: rely on size (and sha256 where there is one)
        if path in files:
            raise WeightsError(f"{where} names {path} twice")
        files[path] = Remote(path, size, sha256, git_oid)
    for path in files:
        parent = path.rpartition("/")[0]
        while parent:
            if parent in files:
                raise WeightsError(f"{where} names {parent} as a file and as a folder")
            parent = parent.rpartition("/")[0]
    return sorted(files.values(), key=lambda f: f.path)
