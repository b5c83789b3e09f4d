"""A Python engine's environment from a bundle's wheel set on the control plane's mirror
(pyenv.build_from_bundle): the wheels and their requirements.txt fetched at the mirror's
URLs, each checked against the sha256 the control plane pinned, installed with no index.

Two tiny real wheels built by ``uv build`` stand for vLLM and its dependencies, served by
an aiohttp server the test starts at 127.0.0.1, shaped as the mirror serves a bundle's
files: a path per file, nothing else (no listing, no index).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw import wire
from llmgw.agent.control_plane import ControlPlane
from llmgw.agent.install.archives import MARKER
from llmgw.agent.install.manager import EngineInstaller
from llmgw.agent.install.pyenv import BUNDLE_REQUIREMENTS, BUNDLED, build_from_bundle
from llmgw.agent.install.pypi import InstallError
from llmgw.config import AgentConfig
from tests.integration.test_comfyui_install import FAKE_TORCH, L4_NODE, until
from tests.integration.test_pyenv import build_wheel, requirements


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("wheels")
    return {
        "tiny-a": build_wheel(work, "tiny-a", "0.1.0",
                              "import tiny_b\n\ndef main():\n    print('a', tiny_b.VALUE)\n",
                              deps=["tiny-b==0.2.0"]),
        "tiny-b": build_wheel(work, "tiny-b", "0.2.0", "VALUE = 42\n\ndef main(): pass\n"),
    }


class Mirror:
    """Files at <prefix>/<name>, as the control plane's mirror serves a bundle's."""

    def __init__(self, files: dict[str, bytes], prefix: str = "/files") -> None:
        self.files = files
        self.prefix = prefix
        self.requests: list[str] = []

    async def file(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        name = request.match_info["name"]
        if name not in self.files:
            raise web.HTTPNotFound()
        return web.Response(body=self.files[name], content_type="application/octet-stream")

    async def __aenter__(self) -> Mirror:
        app = web.Application()
        app.router.add_get(self.prefix + "/{name}", self.file)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base = f"http://127.0.0.1:{port}"
        self.url = self.base + self.prefix
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def _bundle(wheels: dict[str, Path]) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in wheels.values()}
    files[BUNDLE_REQUIREMENTS] = requirements(wheels).encode()
    return files


async def _build(root: Path, mirror: Mirror, pins: dict[str, str], status=None) -> Path:
    async with aiohttp.ClientSession() as session:
        return await asyncio.wait_for(build_from_bundle(
            session, base_url=mirror.url, pins=pins, root=root, name="vllm",
            version="0.11.0", python=sys.executable,
            import_check="import tiny_a; assert tiny_a.tiny_b.VALUE == 42",
            status=status if status is not None else (lambda _: None), min_free_bytes=0), 90)


async def test_the_environment_is_built_from_the_pinned_wheels_with_no_index(tmp_path, wheels):
    files = _bundle(wheels)
    pins = {name: _sha256(data) for name, data in files.items()}
    root = tmp_path / "engines"
    said: list[str] = []
    async with Mirror(files) as mirror:
        path = await _build(root, mirror, pins, said.append)
    assert path == root / "vllm" / "0.11.0"
    marker = json.loads((path / MARKER).read_text())
    assert (marker["index_url"], marker["packages"]) == (BUNDLED, 2)
    assert "downloading 2 wheels of vllm 0.11.0 from the control plane" in said
    # Each pinned file once; nothing else was asked for (no index, no listing).
    assert sorted(mirror.requests) == sorted(f"/files/{name}" for name in files)
    assert sorted(os.listdir(root)) == [".uv-cache", "vllm"]  # the downloads are gone


async def test_a_file_changed_on_the_mirror_is_refused_and_nothing_is_left(tmp_path, wheels):
    files = _bundle(wheels)
    pins = {name: _sha256(data) for name, data in files.items()}
    changed = wheels["tiny-b"].name
    files[changed] = files[changed][:-1] + bytes([files[changed][-1] ^ 1])
    root = tmp_path / "engines"
    async with Mirror(files) as mirror:
        with pytest.raises(InstallError) as refused:
            await _build(root, mirror, pins)
    assert f"{changed} has sha256 {_sha256(files[changed])}, but {pins[changed]} was " \
           "expected" in str(refused.value)
    assert not (root / "vllm").exists()
    assert not [n for n in os.listdir(root) if n.startswith(".wheels@")]


async def test_a_bundle_without_a_wheel_for_this_node_or_its_requirements_says_so(
        tmp_path, wheels):
    pins = {"torch-2.8.0-cp312-cp312-win_amd64.whl": "0" * 64, BUNDLE_REQUIREMENTS: "1" * 64}
    async with Mirror({}) as mirror:
        with pytest.raises(InstallError, match=r"holds no wheel of vllm 0\.11\.0 for .* \(it "
                           r"holds torch-2\.8\.0-cp312-cp312-win_amd64\.whl\)"):
            await _build(tmp_path / "engines", mirror, pins)
        with pytest.raises(InstallError, match=r"without its requirements\.txt"):
            await _build(tmp_path / "engines", mirror, {"tiny_b-0.2.0-py3-none-any.whl":
                                                        "2" * 64})
        assert mirror.requests == []


async def test_a_gpu_node_installs_vllm_from_the_control_planes_bundle_and_reports_it(
        tmp_path, tmp_path_factory):
    """The node's side whole: the control plane's InstallEngines for a vLLM the bundle
    holds (every file pinned, on the mirror), the build this GPU node picks, the wheels
    fetched from the server it dialled, the import check run, the engine reported."""
    work = tmp_path_factory.mktemp("vllm-wheels")
    wheels = {
        "vllm": build_wheel(work, "vllm", "0.11.0", "import torch\n\ndef main(): pass\n",
                            deps=["torch==2.9.0"]),
        "torch": build_wheel(work, "torch", "2.9.0", FAKE_TORCH),
    }
    files = {p.name: p.read_bytes() for p in wheels.values()}
    files[BUNDLE_REQUIREMENTS] = "".join(
        f"{name}=={version} \\\n    --hash=sha256:{_sha256(files[p.name])}\n"
        for name, version, p in (("torch", "2.9.0", wheels["torch"]),
                                 ("vllm", "0.11.0", wheels["vllm"]))).encode()
    pins = {name: _sha256(data) for name, data in files.items()}
    config = AgentConfig(servers=["http://127.0.0.1:9"], state_dir=str(tmp_path / "agent"),
                         install_os_packages=False)
    changed = asyncio.Event()
    installer = EngineInstaller(config, set_binary=lambda *_: None, changed=changed.set,
                                facts=lambda: L4_NODE, python=sys.executable)
    async with Mirror(files, prefix="/mirror/files/engines/vllm/0.11.0") as mirror, installer:
        installer.control_plane = ControlPlane(mirror.base)
        installer.want(wire.InstallEngines(engines=[wire.EngineWanted(
            name="vllm", version="0.11.0", release_url=wire.MIRROR_ENGINES_URL + "/vllm",
            sha256=pins)]))
        done = await until(changed, lambda: next(
            (e for e in installer.reported() if e.name == "vllm"
             and e.state in ("installed", "failed")), None), 90, "vllm to be installed")
    assert done.state == "installed", done.detail
    assert sorted(mirror.requests) == sorted(f"{mirror.prefix}/{name}" for name in files)
    [path] = (tmp_path / "agent" / "engines" / "vllm").iterdir()
    assert path.name.startswith("0.11.0")
    assert json.loads((path / MARKER).read_text())["index_url"] == BUNDLED
