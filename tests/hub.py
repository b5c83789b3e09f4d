"""A Hugging Face-shaped hub for tests: a real aiohttp server on 127.0.0.1.

It serves repositories from ``{repo: {path: bytes}}`` the way huggingface.co does:

- ``GET /api/models/ORG/NAME/tree/REV?recursive=true``: a JSON list of files and folders;
  a file's ``oid`` is its git blob id, except for an LFS file (over ``lfs_over`` bytes),
  whose ``oid`` names the LFS pointer and whose ``lfs`` entry holds the content's sha256
  and size. With ``page_size`` the list comes in pages linked by ``Link: <…>; rel="next"``.
- ``GET /ORG/NAME/resolve/REV/PATH``: the file; an LFS file is a 302 to a second origin,
  the "CDN" (``/cdn/SHA256?X-Amz-Signature=…``), as the real hub redirects to its CDN.

Hooks shape failures: ``corrupt`` (serve other bytes than the listing describes),
``listed_size`` (the listing claims another size), ``extra`` (raw listing entries, e.g. a
bad path), ``stall`` and ``drop`` (half a file, then silence or a closed connection),
``token`` (a bearer token required on the hub's origin), ``before_file`` (called as a
file starts), ``chunk_delay``. Every request lands in ``log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web


@dataclass
class Logged:
    """One request, logged as it arrives; ``status`` is 0 until the answer is known."""

    site: str  # "hub" or "cdn"
    method: str
    path: str  # with the query
    authorization: str | None
    status: int


_ENTRY = web.RequestKey("entry", Logged)


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\n"
            f"oid sha256:{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n").encode()


class Hub:
    def __init__(self, repos: dict[str, dict[str, bytes]], *, revisions=("main",),
                 lfs_over: int = 1024, page_size: int | None = None, token: str | None = None,
                 chunk: int = 64 * 1024, chunk_delay: float = 0.0) -> None:
        self.repos = repos
        self.revisions = set(revisions)
        self.lfs_over = lfs_over
        self.page_size = page_size
        self.token = token
        self.chunk = chunk
        self.chunk_delay = chunk_delay
        self.corrupt: dict[str, bytes] = {}
        self.listed_size: dict[str, int] = {}
        self.extra: list[dict] = []
        self.stall: set[str] = set()
        self.drop: set[str] = set()
        self.before_file: Callable[[str], None] | None = None
        self.log: list[Logged] = []
        self.url = self.cdn_url = ""
        self._stop = asyncio.Event()
        self._runner: web.AppRunner | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Hub:
        app = web.Application(middlewares=[self._logged])
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self._tree)
        app.router.add_get("/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)
        app.router.add_get("/cdn/{sha}", self._cdn)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        ports = []
        for _ in ("hub", "cdn"):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(self._runner, sock).start()
            ports.append(sock.getsockname()[1])
        self._hub_port, self._cdn_port = ports
        self.url = f"http://127.0.0.1:{ports[0]}"
        self.cdn_url = f"http://127.0.0.1:{ports[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- what happened -----------------------------------------------------------------------

    def downloads(self, path: str | None = None) -> list[Logged]:
        """Requests that served file content (the hub's small files and the CDN's)."""
        return [e for e in self.log if e.status == 200 and (
            e.site == "cdn" or "/resolve/" in e.path) and (
            path is None or e.path.split("?")[0].endswith("/" + path)
            or e.path.split("?")[0] == f"/cdn/{self._sha(path)}")]

    def _sha(self, path: str) -> str:
        for files in self.repos.values():
            if path in files:
                return hashlib.sha256(files[path]).hexdigest()
        return ""

    # -- handlers ----------------------------------------------------------------------------

    @web.middleware
    async def _logged(self, request: web.Request, handler):
        site = "cdn" if request.transport and \
            request.transport.get_extra_info("sockname")[1] == self._cdn_port else "hub"
        # Logged as it arrives: a client may be done with a response before its handler is.
        entry = Logged(site, request.method, request.path_qs,
                       request.headers.get("Authorization"), 0)
        self.log.append(entry)
        request[_ENTRY] = entry
        try:
            response = await handler(request)
            entry.status = response.status
            return response
        except web.HTTPException as err:
            entry.status = err.status
            raise

    def _refuse(self, request: web.Request) -> None:
        if request[_ENTRY].site != "hub":
            raise web.HTTPNotFound()
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            raise web.HTTPUnauthorized(headers={"X-Error-Code": "GatedRepo"},
                                       text='{"error": "Access to model is restricted."}')

    def _repo(self, request: web.Request) -> dict[str, bytes]:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo not in self.repos:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepositoryNotFound"},
                                   text='{"error": "Repository not found"}')
        if request.match_info["rev"] not in self.revisions:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"},
                                   text='{"error": "Invalid rev id"}')
        return self.repos[repo]

    def _listing(self, files: dict[str, bytes]) -> list[dict]:
        folders: set[str] = set()
        out: list[dict] = []
        for path in sorted(files):
            data = files[path]
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                folders.add("/".join(parts[:i]))
            size = self.listed_size.get(path, len(data))
            entry = {"type": "file", "oid": git_oid(data), "size": size, "path": path}
            if len(data) > self.lfs_over:
                pointer = lfs_pointer(data)
                entry["oid"] = git_oid(pointer)
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": size,
                                "pointerSize": len(pointer)}
            out.append(entry)
        out += [{"type": "directory", "oid": git_oid(f.encode()), "size": 0, "path": f}
                for f in sorted(folders)]
        return sorted(out, key=lambda e: e["path"]) + self.extra

    async def _tree(self, request: web.Request) -> web.Response:
        self._refuse(request)
        entries = self._listing(self._repo(request))
        if not self.page_size:
            return web.json_response(entries)
        cursor = int(request.query.get("cursor", "0"))
        page = entries[cursor:cursor + self.page_size]
        headers = {}
        if cursor + self.page_size < len(entries):
            following = request.url.update_query(cursor=str(cursor + self.page_size))
            headers["Link"] = f'<{following}>; rel="next"'
        return web.json_response(page, headers=headers)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        self._refuse(request)
        files = self._repo(request)
        path = request.match_info["path"]
        if path not in files:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"})
        data = files[path]
        if len(data) > self.lfs_over:
            sha = hashlib.sha256(data).hexdigest()
            raise web.HTTPFound(f"{self.cdn_url}/cdn/{sha}?X-Amz-Signature=abc123")
        return await self._send(request, path, data)

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        for files in self.repos.values():
            for path, data in files.items():
                if hashlib.sha256(data).hexdigest() == request.match_info["sha"]:
                    return await self._send(request, path, data)
        raise web.HTTPNotFound()

    async def _send(self, request: web.Request, path: str, data: bytes) -> web.StreamResponse:
        data = self.corrupt.get(path, data)
        if self.before_file:
            self.before_file(path)
        response = web.StreamResponse()
        response.content_length = len(data)
        response.content_type = "application/octet-stream"
        await response.prepare(request)
        request[_ENTRY].status = response.status
        end = len(data) // 2 if path in self.stall | self.drop else len(data)
        for start in range(0, end, self.chunk):
            await response.write(data[start:min(start + self.chunk, end)])
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
        if path in self.stall:
            await self._stop.wait()
        if path in self.drop:
            request.transport.close()
            return response
        await response.write_eof()
        return response


@contextlib.contextmanager
def hub_in_thread(repos: dict[str, dict[str, bytes]], hub_class: type[Hub] | None = None,
                  **options):
    """The test hub (or ``hub_class``, a subclass) on its own event loop, for tests that
    drive real processes."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    hub = (hub_class or Hub)(repos, **options)
    asyncio.run_coroutine_threadsafe(hub.__aenter__(), loop).result(10)
    try:
        yield hub
    finally:
        asyncio.run_coroutine_threadsafe(hub.__aexit__(None, None, None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
