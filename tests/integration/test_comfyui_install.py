"""A node installs ComfyUI from its release's source archive and a uv environment, and the
installed engine launches the way the agent launches every ComfyUI shard.

Offline and real: a small ComfyUI-shaped source archive (``main.py`` serving the
``/system_stats`` endpoint the adapter waits on, a ``requirements.txt``) served from
127.0.0.1 with its sha256 pinned as server.yaml would, and two tiny real wheels on a
PyPI-shaped index on 127.0.0.1 (tests/integration/test_pyenv.py's). One of them is named
torch and stands in for it: the import check asks torch to compute on the GPU, and there
is no GPU here, so the stand-in takes the same calls on the CPU. The node's GPU comes from
its facts, as NVML would give them. On a GPU node the real torch runs the same check on the
card.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import sys
import tarfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw import wire
from llmgw.agent.install.archives import MARKER, installed_archive
from llmgw.agent.install.comfyui import install_comfyui
from llmgw.agent.install.manager import EngineInstaller
from llmgw.agent.install.pyenv import REQUIREMENTS, RESOLVED, check_source_requirements
from llmgw.agent.install.pypi import InstallError
from llmgw.agent.runtime import ProcessRuntime
from llmgw.agent.shards import ShardSupervisor
from llmgw.config import AgentConfig
from llmgw.core.builds import NodeFacts, comfyui_archive
from tests.integration.cluster import free_port
from tests.integration.test_pyenv import Index, build_wheel

VERSION = "0.3.60"
ASSET = comfyui_archive(VERSION)
# GitHub dates every member of a tag's archive with the tagged commit's time; the wheels
# on the index were uploaded at 2025-03-01T12:00:00Z.
RELEASED = datetime(2025, 3, 1, 18, 0, tzinfo=UTC)
L4_NODE = NodeFacts("x86_64", gpus=1, gpu_driver="580.82.07", compute_capabilities=((8, 9),),
                    gpu_names=("NVIDIA L4",))
REQUIREMENTS_TXT = "torch\ntiny-b>=0.2  # the rest of ComfyUI's list, in small\n"

FAKE_TORCH = '''"""Stands in for torch where there is no GPU: the check's calls, on the CPU."""


class Tensor:
    def __init__(self, values, device):
        self.values, self.device = values, device

    def add_(self, other):
        self.values = [v + other for v in self.values]
        return self


def ones(n, device="cpu"):
    return Tensor([1.0] * n, device)


def main():
    pass
'''

MAIN_PY = '''"""ComfyUI's main.py, in small: its flags, and the /system_stats it answers."""
import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import tiny_b
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--listen", default="127.0.0.1")
parser.add_argument("--port", type=int, default=8188)
parser.add_argument("--cpu", action="store_true")
args, _ = parser.parse_known_args()
device = "cpu" if args.cpu else "cuda"


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/system_stats":
            self.send_error(404)
            return
        stats = {"system": {"os": sys.platform, "python_version": sys.version,
                            "comfyui_version": "VERSION", "argv": sys.argv,
                            "executable": sys.executable, "tiny_b": tiny_b.VALUE},
                 "devices": [{"name": device, "type": device, "index": None,
                              "ones": torch.ones(2, device=device).add_(1).values}]}
        body = json.dumps(stats).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


ThreadingHTTPServer((args.listen, args.port), Handler).serve_forever()
'''.replace("VERSION", VERSION)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("wheels")
    return {"torch": build_wheel(work, "torch", "2.99.0", FAKE_TORCH),
            "tiny-b": build_wheel(work, "tiny-b", "0.2.0", "VALUE = 42\n\ndef main(): pass\n"),
            # What PyTorch's own CUDA 12.9 index serves under the same name.
            "torch-cu129": build_wheel(work, "torch", "2.99.0+cu129", FAKE_TORCH)}


@pytest.fixture
async def index(wheels):
    async with Index({"torch": wheels["torch"], "tiny-b": wheels["tiny-b"]}) as served:
        yield served


def source_archive(directory: Path, *, requirements: str = REQUIREMENTS_TXT,
                   released: datetime = RELEASED) -> str:
    """GitHub's archive of the tag, in small: ``ComfyUI-<version>/`` with main.py,
    requirements.txt and a package beside them; returns its sha256."""
    directory.mkdir(parents=True, exist_ok=True)
    top = f"ComfyUI-{VERSION}"
    files = {"main.py": MAIN_PY, "requirements.txt": requirements,
             "comfy/__init__.py": "", "custom_nodes/example/main.py": "raise SystemExit(1)\n"}
    with tarfile.open(directory / ASSET, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            data = text.encode()
            info.size, info.mtime, info.mode = len(data), released.timestamp(), 0o644
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256((directory / ASSET).read_bytes()).hexdigest()


class Files:
    """Static files from a directory on 127.0.0.1, every request path kept."""

    def __init__(self, root: Path) -> None:
        self.root, self.requests, self.url = root, [], ""

    async def serve(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.path)
        path = (self.root / request.match_info["path"]).resolve()
        if not path.is_relative_to(self.root.resolve()) or not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    async def __aenter__(self) -> Files:
        app = web.Application()
        app.router.add_get("/{path:.+}", self.serve)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


async def until(changed: asyncio.Event, check, timeout_s: float, what: str):
    """Wait, woken by each change, until ``check()`` gives something; bounded."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        changed.clear()
        if not (found := check()):
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                continue
    return found


def installer_for(tmp_path: Path, supervisor_binary, changed: asyncio.Event
                  ) -> EngineInstaller:
    config = AgentConfig(servers=["http://127.0.0.1:9"], state_dir=str(tmp_path / "agent"),
                         install_os_packages=False)
    return EngineInstaller(config, set_binary=supervisor_binary, changed=changed.set,
                           facts=lambda: L4_NODE, python=sys.executable)


def wanted(files: Files, index: Index, sha256: dict[str, str]) -> wire.InstallEngines:
    """What the control plane sends for server.yaml's ``engines.comfyui`` (mirror set)."""
    return wire.InstallEngines(engines=[wire.EngineWanted(
        name="comfyui", version=VERSION, release_url=f"{files.url}/comfyui", sha256=sha256,
        index_url=index.url)])


def comfyui_state(installer: EngineInstaller, state: str) -> wire.Engine | None:
    return next((e for e in installer.reported() if e.name == "comfyui" and e.state == state),
                None)


async def test_comfyui_is_installed_from_its_pinned_archive_reported_and_launched(
        tmp_path, index):
    digest = source_archive(tmp_path / "mirror" / "comfyui")
    changed, shards = asyncio.Event(), []

    def shard_report(status: wire.ShardStatus) -> None:
        shards.append(status)
        changed.set()

    supervisor = ShardSupervisor(ProcessRuntime(tmp_path / "agent"), "127.0.0.1", {},
                                 shard_report)
    installer = installer_for(tmp_path, supervisor.set_binary, changed)
    seen: list[str] = []
    async with Files(tmp_path / "mirror") as files, supervisor, installer:
        installer.want(wanted(files, index, {ASSET: digest}))

        def installed():
            seen.extend(e.detail for e in installer.reported() if e.detail not in seen)
            return comfyui_state(installer, "installed")

        done = await until(changed, installed, 90, "ComfyUI to be reported installed")
        assert (done.version, done.detail) == (VERSION, "cu130 build")
        assert f"/comfyui/{ASSET}" in files.requests
        # The node said how far it got, in its own words.
        assert any(s.startswith(f"installing: downloading {ASSET} (") for s in seen), seen
        assert ("installing: resolving 2 requirements of ComfyUI 0.3.60 as of "
                "2025-03-02T18:00:00Z") in seen

        path = tmp_path / "agent" / "engines" / "comfyui" / f"{VERSION}-cu130"
        assert installed_archive(tmp_path / "agent" / "engines", "comfyui",
                                 f"{VERSION}-cu130") == path
        marker = json.loads((path / MARKER).read_text())
        assert (marker["sha256"], marker["exclude_newer"], marker["binary"]) == (
            digest, "2025-03-02T18:00:00Z", "main.py")
        pinned = (path / "venv" / REQUIREMENTS).read_text()
        for name, wheel in index.files.items():
            assert hashlib.sha256(wheel[1]).hexdigest() in pinned, name
        # No scratch directory is left: only uv's cache and the list asked for beside it.
        assert sorted(os.listdir(path.parent.parent)) == [".uv-cache", "comfyui", "wanted.json"]

        # Launched as the agent launches a placed ComfyUI shard: main.py on venv's Python.
        port = free_port()
        supervisor.start(wire.StartShard(
            replica="img-e1", rank=0, world_size=1, epoch=1, model="img",
            profile=wire.ShardProfile(name="cpu", engine="comfyui", startup_timeout_s=30),
            port=port))
        ready = await until(changed, lambda: next(
            (s for s in shards if s.state in ("ready", "failed")), None), 40,
            "the ComfyUI shard to be ready")
        assert ready.state == "ready", ready
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{port}/system_stats") as resp:
            stats = await resp.json()
        assert stats["system"]["executable"] == str(path / "venv" / "bin" / "python")
        assert stats["system"]["argv"][0] == str(path / "main.py")
        assert (stats["system"]["tiny_b"], stats["devices"][0]["ones"]) == (42, [2.0, 2.0])
        await supervisor.stop_all()


async def test_a_version_without_a_pinned_sha256_is_refused_and_nothing_is_fetched(
        tmp_path, index):
    source_archive(tmp_path / "mirror" / "comfyui")
    changed = asyncio.Event()
    installer = installer_for(tmp_path, lambda *_: None, changed)
    async with Files(tmp_path / "mirror") as files, installer:
        installer.want(wanted(files, index, {}))
        failed = await until(changed, lambda: comfyui_state(installer, "failed"), 20,
                             "ComfyUI to be reported failed")
    assert failed.detail == (
        f"failed: ComfyUI {VERSION} is refused: GitHub publishes no digest for a tag's "
        f"source archive, so {ASSET} cannot be checked without one; pin its sha256 in "
        f"server.yaml under engines.comfyui.sha256 (\"{ASSET}\": <64 hex digits>)")
    assert files.requests == [] and index.requests == []


async def install(tmp_path: Path, files: Files, index: Index, digest: str, *,
                  build: str = "cu130", extra_index_urls: tuple[str, ...] = ()) -> Path:
    async with aiohttp.ClientSession() as http:
        return await asyncio.wait_for(install_comfyui(
            http, root=tmp_path / "engines", version=VERSION, directory=f"{VERSION}-{build}",
            url=f"{files.url}/comfyui/{ASSET}", sha256=digest, index_url=index.url,
            extra_index_urls=extra_index_urls, exclude_newer="", python=sys.executable,
            import_check="import torch", status=lambda _: None, min_free_bytes=0), 60)


async def test_the_cu129_build_takes_torch_from_the_extra_index_it_is_given(
        tmp_path, index, wheels):
    """The CUDA 12.9 build: torch from PyTorch's index (core.builds names it; here a second
    index on 127.0.0.1), everything else from the cluster's."""
    digest = source_archive(tmp_path / "mirror" / "comfyui")
    async with Files(tmp_path / "mirror") as files, \
            Index({"torch": wheels["torch-cu129"]}) as pytorch:
        path = await install(tmp_path, files, index, digest, build="cu129",
                             extra_index_urls=(pytorch.url,))
    resolved = (path / "venv" / RESOLVED).read_text().split()
    assert resolved == ["tiny-b==0.2.0", "torch==2.99.0+cu129"]
    assert json.loads((path / MARKER).read_text())["extra_index_urls"] == [pytorch.url]


async def test_a_requirements_file_naming_anything_but_index_packages_is_refused(
        tmp_path, index):
    line = "git+https://github.com/example/nodes.git@main#egg=nodes"
    digest = source_archive(tmp_path / "mirror" / "comfyui",
                            requirements=f"torch\n{line}\n")
    async with Files(tmp_path / "mirror") as files:
        with pytest.raises(InstallError) as err:
            await install(tmp_path, files, index, digest)
    assert str(err.value) == (f"ComfyUI {VERSION}'s requirements.txt line 2 ({line}) names "
                              "a URL; only packages from the index are taken")
    assert index.requests == [] and os.listdir(tmp_path / "engines") == []


async def test_packages_newer_than_a_day_after_the_release_are_not_taken(tmp_path, index):
    # Released a month before the wheels were uploaded: nothing on the index existed yet.
    digest = source_archive(tmp_path / "mirror" / "comfyui",
                            released=datetime(2025, 2, 1, tzinfo=UTC))
    async with Files(tmp_path / "mirror") as files:
        with pytest.raises(InstallError) as err:
            await install(tmp_path, files, index, digest)
    assert str(err.value).startswith(
        f"resolving ComfyUI {VERSION}'s requirements.txt failed: ")
    # uv's own words name the cutoff a day after the archive's date.
    assert ("`torch` was filtered by `exclude-newer` to only include packages uploaded before "
            "2025-02-02T00:00:00Z") in str(err.value)
    assert installed_archive(tmp_path / "engines", "comfyui", f"{VERSION}-cu130") is None
    assert [p for p in os.listdir(tmp_path / "engines") if p != ".uv-cache"] == []


async def test_an_archive_that_is_not_the_pinned_one_is_refused(tmp_path, index):
    source_archive(tmp_path / "mirror" / "comfyui")
    async with Files(tmp_path / "mirror") as files:
        with pytest.raises(InstallError, match="was expected: the file is corrupt, or not "
                                               "the one that was published"):
            await install(tmp_path, files, index, "ab" * 32)
    assert index.requests == [] and os.listdir(tmp_path / "engines") == []


def test_comfyui_style_requirements_are_read_as_index_packages():
    text = ("comfyui-frontend-package==1.28.8\ntorch\nnumpy>=1.25.0\n"
            "transformers>=4.37.2, <5 ; python_version >= '3.9'\n\n#non essential:\n"
            "pydantic~=2.0\nkornia[x]>=0.7.1\n")
    assert check_source_requirements(text, "requirements.txt") == [
        "comfyui-frontend-package==1.28.8", "torch", "numpy>=1.25.0",
        "transformers>=4.37.2, <5 ; python_version >= '3.9'", "pydantic~=2.0",
        "kornia[x]>=0.7.1"]


@pytest.mark.parametrize("line, why", [
    ("nodes @ file:nodes.whl", "is a direct reference (name @ URL); only "
     "packages from the index are taken"),
    ("-e .", "is an editable install; only packages from the index are taken"),
    ("--extra-index-url http://127.0.0.1:1/simple",
     "names an index or a place to find packages; the index is llmgw's to choose"),
    ("./wheels/nodes-1.0-py3-none-any.whl", "is a path; only packages from the index are "
     "taken"),
    ("torch --index-url http://127.0.0.1:1/simple",
     "has the option --index-url; only package names are taken"),
    ("torch=>2", "is not a package name with version specifiers"),
])
def test_anything_else_in_a_source_requirements_file_is_refused(line, why):
    with pytest.raises(InstallError) as err:
        check_source_requirements(f"torch\n{line}\n", "requirements.txt")
    assert str(err.value) == f"requirements.txt line 2 ({line}) {why}"
