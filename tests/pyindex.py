"""A Python package index on loopback for tests: tiny real wheels built by ``uv build``,
served PyPI-shaped (PEP 691 JSON with real sha256, sizes and upload times, and each
wheel's METADATA beside it as PEP 714's ``core-metadata``) by an aiohttp server. Nothing
here leaves the machine."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import zipfile
from pathlib import Path

from aiohttp import web
from uv import find_uv_bin

UPLOADED = "2025-03-01T12:00:00Z"


def _project(work: Path, name: str, version: str, body: str, deps, kind: str) -> Path:
    digest = hashlib.sha256(f"{body}{deps}".encode()).hexdigest()[:12]
    src = work / "src" / f"{name}-{version}-{digest}{kind}"
    module = name.replace("-", "_")
    (src / module).mkdir(parents=True)
    (src / module / "__init__.py").write_text(body)
    (src / "pyproject.toml").write_text(
        f"[project]\nname = {json.dumps(name)}\nversion = {json.dumps(version)}\n"
        f"dependencies = {json.dumps(list(deps))}\n"
        f'[project.scripts]\n{name} = "{module}:main"\n'
        '[build-system]\nrequires = ["uv_build"]\nbuild-backend = "uv_build"\n'
        '[tool.uv.build-backend]\nmodule-root = ""\n')
    return src


def _uv_build(work: Path, src: Path, kind: str) -> Path:
    out = work / "dist" / src.name
    subprocess.run([find_uv_bin(), "build", kind, "--no-config", "--offline", "-q",
                    "-o", str(out), str(src)], check=True, timeout=60,
                   env={**os.environ, "UV_CACHE_DIR": str(work / "build-cache")})
    (built,) = out.glob("*.whl" if kind == "--wheel" else "*.tar.gz")
    return built


def build_wheel(work: Path, name: str, version: str, body: str, deps=()) -> Path:
    """A pure wheel of one module ``body``, with a console script ``name`` running its
    ``main``; ``deps`` are PEP 508 requirements, markers and all."""
    return _uv_build(work, _project(work, name, version, body, deps, "-wheel"), "--wheel")


def build_sdist(work: Path, name: str, version: str, body: str, deps=()) -> Path:
    """The same as a source archive only (its metadata is static: uv reads it unbuilt)."""
    return _uv_build(work, _project(work, name, version, body, deps, "-sdist"), "--sdist")


def _metadata(data: bytes, filename: str) -> bytes | None:
    if not filename.endswith(".whl"):
        return None
    with zipfile.ZipFile(io.BytesIO(data)) as wheel:
        (member,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        return wheel.read(member)


class Index:
    """A PEP 691 "simple" index over the files it is given (project -> file), counting
    every request. A file may be served under another name (``serve_as``: the same bytes
    with other tags) or with other bytes than it lists (``tamper``)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = {p.name: (project, p.read_bytes()) for project, p in files.items()}
        self.listed: dict[str, str] = {}  # filename -> a sha256 listed instead of the real
        self.requests: list[str] = []
        self.url = ""

    def serve_instead(self, filename: str, wheel: Path) -> None:
        """Other bytes for ``filename``, listed with their own sha256."""
        project, _ = self.files[filename]
        self.files[filename] = (project, wheel.read_bytes())

    def serve_as(self, project: str, filename: str, wheel: Path) -> None:
        self.files[filename] = (project, wheel.read_bytes())

    def tamper(self, filename: str, wheel: Path) -> None:
        """Serve other bytes for ``filename`` while listing the sha256 of those it had."""
        project, data = self.files[filename]
        self.listed[filename] = hashlib.sha256(data).hexdigest()
        self.files[filename] = (project, wheel.read_bytes())

    def _entry(self, filename: str, data: bytes) -> dict:
        entry = {"filename": filename, "url": f"/files/{filename}", "upload-time": UPLOADED,
                 "size": len(data), "hashes": {
                     "sha256": self.listed.get(filename) or hashlib.sha256(data).hexdigest()}}
        metadata = _metadata(data, filename)
        if metadata is not None:
            entry["core-metadata"] = {"sha256": hashlib.sha256(metadata).hexdigest()}
        return entry

    async def project(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        name = request.match_info["project"]
        files = [self._entry(f, data) for f, (project, data) in sorted(self.files.items())
                 if project == name]
        if not files:
            raise web.HTTPNotFound()
        body = {"meta": {"api-version": "1.1"}, "name": name, "files": files}
        return web.Response(text=json.dumps(body),
                            content_type="application/vnd.pypi.simple.v1+json")

    async def file(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        filename = request.match_info["filename"]
        if filename.endswith(".metadata") and filename[:-len(".metadata")] in self.files:
            _, data = self.files[filename[:-len(".metadata")]]
            metadata = _metadata(data, filename[:-len(".metadata")])
            if metadata is None:
                raise web.HTTPNotFound()
            return web.Response(body=metadata, content_type="application/octet-stream")
        if filename not in self.files:
            raise web.HTTPNotFound()
        _, data = self.files[filename]
        return web.Response(body=data, content_type="application/octet-stream")

    async def __aenter__(self) -> Index:
        app = web.Application()
        app.router.add_get("/simple/{project}/", self.project)
        app.router.add_get("/files/{filename}", self.file)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/simple"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()
