"""What ``llmgw bundle create`` downloads, on the connected machine: engine archives
checked against their publisher's digests, and model files from a Hugging Face-style hub
pinned to the commit the hub names for a revision. Every download is hashed as it is
written and bounded by the size it was announced with.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import aiohttp
from yarl import URL

from llmgw.bundle.manifest import BundleError

CHUNK = 2**20
MAX_JSON_BYTES = 64 * 2**20
MAX_LISTING_PAGES = 1_000
MAX_LISTED_FILES = 10_000
MAX_REDIRECTS = 10
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def shown(url: URL | str) -> str:
    """A URL for messages: without its query, which may carry a signature."""
    return str(URL(url).with_query(None).with_fragment(None))


def _url(url: str | URL) -> URL:
    return URL(url) if isinstance(url, str) else url


@dataclass(frozen=True, slots=True)
class Listed:
    """A file in a hub's listing: its size, and its sha256 where the hub gives one (LFS
    files) or its git blob id (small files)."""

    path: str
    size: int
    sha256: str | None
    git_oid: str | None


class Fetcher:
    """One HTTP session. ``token`` goes to ``hub``'s origin only, never to a CDN it
    redirects to, nor to a release server."""

    def __init__(self, http: aiohttp.ClientSession, hub: str = "",
                 token: str | None = None) -> None:
        self.http, self.hub, self.token = http, hub.rstrip("/"), token

    async def _response(self, url: URL, raw: bool) -> aiohttp.ClientResponse:
        """GET, following redirects; ``raw``: the bytes as published, never inflated (a
        server may label a .tar.gz gzip-encoded)."""
        for _ in range(MAX_REDIRECTS + 1):
            headers = {}
            if self.token and self.hub and url.origin() == URL(self.hub).origin():
                headers["Authorization"] = f"Bearer {self.token}"
            try:
                resp = await self.http.get(url, headers=headers, allow_redirects=False,
                                           auto_decompress=not raw)
            except (aiohttp.ClientError, TimeoutError) as err:
                raise BundleError(f"GET {shown(url)}: {err or type(err).__name__}") from None
            if resp.status in _REDIRECTS and "Location" in resp.headers:
                resp.release()
                url = url.join(URL(resp.headers["Location"]))
                if url.scheme not in ("http", "https"):
                    raise BundleError(f"redirected to {shown(url)}")
                continue
            if resp.status != 200:
                resp.release()
                hint = {401: ": it needs a token (--hub-token-file)",
                        403: ": it needs a token that may read it (--hub-token-file)",
                        404: ": no such file, release, repository or revision"}
                raise BundleError(f"GET {shown(url)} answered {resp.status}"
                                  + hint.get(resp.status, ""))
            return resp
        raise BundleError(f"more than {MAX_REDIRECTS} redirects from {shown(url)}")

    async def text(self, url: str | URL, limit: int = MAX_JSON_BYTES
                   ) -> tuple[str, URL | None]:
        """The body at ``url`` (bounded) and the URL of the next page, if it links one."""
        resp = await self._response(_url(url), raw=False)
        body = bytearray()
        try:
            async for chunk in resp.content.iter_chunked(CHUNK):
                body += chunk
                if len(body) > limit:
                    break
            following = resp.links.get("next")
        except (aiohttp.ClientError, TimeoutError) as err:
            raise BundleError(f"GET {shown(url)}: {err or type(err).__name__}") from None
        finally:
            resp.release()
        if len(body) > limit:
            raise BundleError(f"{shown(url)} is larger than {limit} bytes")
        return bytes(body).decode(errors="replace"), (
            URL(str(following["url"])) if following else None)

    async def download(self, url: str | URL, dest: Path, max_bytes: int) -> tuple[int, str]:
        """Write the body at ``url`` to ``dest``; (its size, its sha256). A body past
        ``max_bytes``, or not as long as the server announced, is refused."""
        resp = await self._response(_url(url), raw=True)
        hasher = hashlib.sha256()
        done = 0
        try:
            if resp.content_length is not None and resp.content_length > max_bytes:
                raise BundleError(f"{shown(url)} is {resp.content_length} bytes, more than "
                                  f"the {max_bytes} expected")
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "xb") as out:
                async for chunk in resp.content.iter_chunked(CHUNK):
                    done += len(chunk)
                    if done > max_bytes:
                        raise BundleError(f"{shown(url)} runs past the {max_bytes} bytes "
                                          "expected")
                    hasher.update(chunk)
                    out.write(chunk)
        except (aiohttp.ClientError, TimeoutError) as err:
            raise BundleError(f"GET {shown(url)} broke off after {done} bytes: "
                              f"{err or type(err).__name__}") from None
        finally:
            resp.release()
        if resp.content_length is not None and done != resp.content_length:
            raise BundleError(f"GET {shown(url)} ended after {done} of "
                              f"{resp.content_length} bytes")
        return done, hasher.hexdigest()

    # -- a Hugging Face-style hub ----------------------------------------------------------

    async def commit(self, repo: str, revision: str) -> str:
        """The commit ``revision`` (a branch, tag or commit) names on the hub now."""
        url = URL(f"{self.hub}/api/models/{repo}/revision/{quote(revision, safe='')}",
                  encoded=True)
        body, _ = await self.text(url)
        try:
            sha = json.loads(body).get("sha")
        except (ValueError, AttributeError):
            sha = None
        if not isinstance(sha, str) or not _COMMIT.fullmatch(sha):
            raise BundleError(f"{shown(url)} names no commit (a 40-hex \"sha\") for "
                              f"{repo}@{revision}")
        return sha

    async def listing(self, repo: str, commit: str) -> list[Listed]:
        """Every file of ``repo`` at ``commit``, paged as the hub pages it."""
        url: URL | None = URL(f"{self.hub}/api/models/{repo}/tree/{commit}?recursive=true",
                              encoded=True)
        entries: list = []
        for _ in range(MAX_LISTING_PAGES):
            if url is None:
                break
            body, url = await self.text(url)
            try:
                page = json.loads(body)
            except ValueError:
                page = None
            if not isinstance(page, list):
                raise BundleError(f"the hub's listing of {repo}@{commit} is not a JSON list; "
                                  "is --hub a Hugging Face-style hub?")
            entries += page
            if len(entries) > MAX_LISTED_FILES:
                raise BundleError(f"{repo} lists more than {MAX_LISTED_FILES} entries")
        else:
            raise BundleError(f"the listing of {repo} runs past {MAX_LISTING_PAGES} pages")
        return _parse_listing(entries, f"the listing of {repo}@{commit}")

    def file_url(self, repo: str, commit: str, path: str) -> URL:
        return URL(f"{self.hub}/{repo}/resolve/{commit}/{quote(path)}", encoded=True)


def _parse_listing(entries: list, where: str) -> list[Listed]:
    files = []
    for e in entries:
        if not isinstance(e, dict) or e.get("type") not in ("file", "directory"):
            raise BundleError(f"{where} has an entry that is neither file nor directory: "
                              f"{str(e)[:200]}")
        if e["type"] != "file":
            continue
        path = e.get("path")
        lfs = e.get("lfs") if isinstance(e.get("lfs"), dict) else None
        size = lfs.get("size", e.get("size")) if lfs else e.get("size")
        if not isinstance(path, str) or not isinstance(size, int) or isinstance(size, bool) \
                or size < 0:
            raise BundleError(f"{where} gives {path!r} no valid size")
        sha256 = lfs.get("oid") if lfs else None
        if sha256 is not None and not _SHA256.fullmatch(str(sha256)):
            raise BundleError(f"{where} gives {path} the sha256 {sha256!r}")
        oid = None if lfs else e.get("oid")
        files.append(Listed(path, size, sha256,
                            oid if isinstance(oid, str) and re.fullmatch(r"[0-9a-f]{40}", oid)
                            else None))
    return sorted(files, key=lambda f: f.path)


def git_oid(path: Path, size: int) -> str:
    """A file's git blob id, to check a small file the hub lists without a sha256."""
    hasher = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()
