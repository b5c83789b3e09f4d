"""Bundles made here from local parts, nothing from the internet: llama.cpp-shaped release
archives (real tar.gz, with a SHA256SUMS) served over loopback, a SmolLM2-shaped model
repository on the test hub, and a folder of small real wheels. One bundle is made per
session (``made``) and copied by the tests that damage it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.server
import io
import os
import re
import shutil
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from aiohttp import web

from llmgw.bundle import create, mirror, signing
from llmgw.core.builds import NodeFacts, candidate_builds
from tests.hub import Hub, hub_in_thread

VERSION = "b11434"
LLMGW_VERSION = "0.9.0"
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
COMMIT = "4f1e2d3c4b5a69788796a5b4c3d2e1f0a1b2c3d4"
GGUF = "smollm2-135m-instruct-q8_0.gguf"
# The builds bundled: the CPU one and the Vulkan one, for x86_64.
BUILDS = ("cpu", "vulkan")


class PinnedHub(Hub):
    """The test hub, also answering ``/api/models/ORG/NAME/revision/REV`` with the commit
    a branch names, as huggingface.co does (``sha``)."""

    def __init__(self, repos, *, commit: str, **options) -> None:
        super().__init__(repos, revisions=("main", commit), **options)
        self.commit = commit

    @web.middleware
    async def _logged(self, request: web.Request, handler):
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", request.path)
        if match and match[1] in self.repos and match[2] in self.revisions:
            return web.json_response({"id": match[1], "sha": self.commit})
        return await super()._logged(request, handler)


@contextlib.contextmanager
def pinned_hub(repos: dict[str, dict[str, bytes]], commit: str = COMMIT) -> Iterator[PinnedHub]:
    with hub_in_thread(repos, PinnedHub, commit=commit) as hub:
        yield hub


@contextlib.contextmanager
def static_server(root: Path) -> Iterator[str]:
    """Files under ``root`` over HTTP on loopback, as a release server serves them."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            path = (root / self.path.lstrip("/")).resolve()
            if not path.is_relative_to(root) or not path.is_file():
                self.send_error(404)
                return
            body = path.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def assets() -> list[str]:
    """The llama.cpp archives core.builds names for an x86_64 node, CPU and Vulkan."""
    cpu = candidate_builds("llama.cpp", VERSION, NodeFacts("x86_64"))
    gpu = candidate_builds("llama.cpp", VERSION, NodeFacts("x86_64", gpus=1, gpu_driver="999"))
    return [b.asset for b in [*cpu, *gpu] if b.name in BUILDS]  # type: ignore[misc]


def release_archive(asset: str) -> bytes:
    """A llama.cpp-shaped release archive: llama-<version>/llama-server."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        script = f"#!/bin/sh\necho 'version: {VERSION} ({asset})'\n".encode()
        info = tarfile.TarInfo(f"llama-{VERSION}/llama-server")
        info.size, info.mode = len(script), 0o755
        tar.addfile(info, io.BytesIO(script))
    return buf.getvalue()


def wheel(name: str, version: str, platform: str = "any") -> tuple[str, bytes]:
    """A small real wheel: a module, METADATA, WHEEL and a RECORD of their hashes."""
    import base64

    dist = f"{name}-{version}.dist-info"
    members = {
        f"{name}/__init__.py": f'__version__ = "{version}"\n'.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-{platform}\n"
                         .encode(),
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
        f"{len(data)}\n" for path, data in members.items()) + f"{dist}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in {**members, f"{dist}/RECORD": record.encode()}.items():
            z.writestr(path, data)
    return f"{name}-{version}-py3-none-{platform}.whl", buf.getvalue()


@dataclass
class Parts:
    """What a bundle is made from, and the key that signs it."""

    key: Path
    trusted: str  # the key's public line
    other_key: Path
    release_url: str
    hub: PinnedHub
    wheels: Path
    model_files: dict[str, bytes]
    archives: dict[str, bytes]

    def request(self, out: Path, **changes) -> create.Request:
        fields = dict(
            out=out, key_file=self.key,
            engines=[create.EngineWant("llama.cpp", VERSION, ("x86_64",), BUILDS)],
            models=[create.ModelWant("smollm2", REPO, "main", ("*.gguf", "*.json", "*.md"))],
            wheels=self.wheels, llmgw_version=LLMGW_VERSION, release_url=self.release_url,
            hub=self.hub.url)
        fields.update(changes)
        return create.Request(**fields)

    def make(self, out: Path, **changes) -> create.Created:
        return asyncio.run(create.create_bundle(self.request(out, **changes)))

    def make_small(self, out: Path, created: datetime, **changes) -> create.Created:
        """A bundle of wheels only (nothing downloaded), made at ``created``."""
        return self.make(out, engines=[], models=[], now=created, **changes)


@pytest.fixture(scope="session")
def parts(tmp_path_factory) -> Iterator[Parts]:
    root = tmp_path_factory.mktemp("parts")
    key, other = root / "signing.pem", root / "other.pem"
    trusted = signing.keygen(key)
    signing.keygen(other)
    releases = root / "releases"
    (releases / VERSION).mkdir(parents=True)
    archives = {a: release_archive(a) for a in assets()}
    for name, data in archives.items():
        (releases / VERSION / name).write_bytes(data)
    (releases / VERSION / "SHA256SUMS").write_text("".join(
        f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in archives.items()))
    wheels = root / "wheels"
    wheels.mkdir()
    for name, data in (wheel("llmgw", LLMGW_VERSION),
                       wheel("msgspec", "0.19.0", "manylinux_2_17_x86_64")):
        (wheels / name).write_bytes(data)
    model_files = {
        GGUF: b"GGUF" + os.urandom(6000),  # over the hub's LFS size: served from its CDN
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
        "README.md": b"# SmolLM2 135M Instruct\n",
        ".gitattributes": b"*.gguf filter=lfs diff=lfs merge=lfs -text\n",
    }
    with static_server(releases) as release_url, pinned_hub({REPO: model_files}) as hub:
        yield Parts(key, trusted, other, release_url, hub, wheels, model_files, archives)


@pytest.fixture(scope="session")
def made(parts, tmp_path_factory) -> create.Created:
    """One full bundle (engine archives, model files, wheels), as a folder."""
    return parts.make(tmp_path_factory.mktemp("made") / "bundle")


@pytest.fixture
def bundle(made, tmp_path) -> Path:
    """A copy of the made bundle, for a test to damage."""
    return Path(shutil.copytree(made.path, tmp_path / "bundle"))


@dataclass
class Snapshot:
    current: str
    bundles: list[str]
    staging: list[str]


def snapshot(folder: Path) -> Snapshot:
    """What an import may change: where ``current`` points, the bundles kept, and any
    staging left behind."""
    return Snapshot(os.readlink(folder / mirror.CURRENT), mirror.bundles(folder),
                    sorted(p.name for p in folder.glob(mirror.STAGING_PREFIX + "*")))


@pytest.fixture
def mirror_dir(parts, made, tmp_path) -> Path:
    """A mirror that holds one imported bundle: a small one made a week before ``made``."""
    folder = tmp_path / "mirror"
    first = parts.make_small(tmp_path / "first", made.manifest.created_at - timedelta(days=7))
    mirror.import_bundle(first.path, folder, [parts.trusted])
    return folder

