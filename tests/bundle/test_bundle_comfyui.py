"""ComfyUI in a bundle (``bundle create --engine comfyui@VERSION``): its source archive,
checked against the operator's pin, and the wheels its requirements.txt resolves to, one
per package with a requirements.txt pinning them; after the import, a GPU node builds
ComfyUI's environment from the control plane's mirror with no index.

All local and real: a ComfyUI-shaped tag archive (tests/integration/test_comfyui_install's:
main.py and a requirements.txt naming torch and tiny-b) on a release server on loopback,
two tiny real wheels (a CPU stand-in for torch, tiny-b) on a PyPI-shaped index
(tests/pyindex.py), the mirror served by the server's own handler (server/mirror.py), the
engines the control plane sends worked out by core.desired_engines, and the agent's
installer. Nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import platform
import sys
import tarfile
from pathlib import Path

import pytest
from aiohttp import web

from llmgw import config, wire
from llmgw.agent.control_plane import ControlPlane
from llmgw.agent.install.archives import MARKER
from llmgw.agent.install.manager import EngineInstaller
from llmgw.agent.install.pyenv import BUNDLED, RESOLVED
from llmgw.bundle import create, mirror, signing, verify, wheelsets
from llmgw.bundle.manifest import BundleError
from llmgw.bundle.settings import offline_settings
from llmgw.cli.main import main as llmgw
from llmgw.core.desired_engines import desired_engines, settings_problems
from llmgw.server.mirror import AIOHTTP_ROUTE, aiohttp_response, mirror_engines
from tests.bundle.conftest import static_server
from tests.hub import hub_in_thread
from tests.integration.test_comfyui_install import (
    ASSET,
    FAKE_TORCH,
    L4_NODE,
    VERSION,
    source_archive,
    until,
)
from tests.pyindex import Index, build_wheel

PYTHON = f"3.{sys.version_info.minor}"
PLATFORM = f"{platform.machine()}-manylinux_2_28"
FOLDER = f"engines/comfyui/{VERSION}"
# A day after the archive's file dates (2025-03-01T18:00:00Z), as a node resolves it.
CUTOFF = "2025-03-02T18:00:00Z"

pytestmark = pytest.mark.skipif(platform.machine() not in wheelsets.ARCHES,
                                reason=f"bundles are made for {wheelsets.ARCHES} nodes")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("wheels")
    return {"torch": build_wheel(work, "torch", "2.99.0", FAKE_TORCH),
            "tiny-b": build_wheel(work, "tiny-b", "0.2.0", "VALUE = 42\n\ndef main(): pass\n")}


@pytest.fixture(scope="module")
def index(wheels):
    with hub_in_thread(dict(wheels), Index) as served:
        yield served


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """ComfyUI's tag archive at <url>/v0.3.60.tar.gz (as engines.comfyui.release_url), and
    its sha256."""
    root = tmp_path_factory.mktemp("releases")
    digest = source_archive(root)
    with static_server(root) as url:
        yield url, digest


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("key") / "signing.pem"
    return path, signing.keygen(path)


@pytest.fixture(scope="module")
def made(index, releases, key, tmp_path_factory) -> tuple[Path, str]:
    """A bundle of ComfyUI, made through the CLI as an operator would; its stderr."""
    url, digest = releases
    out = tmp_path_factory.mktemp("made") / "bundle"
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = llmgw(["bundle", "create", str(out), "--key", str(key[0]),
                      "--engine", f"comfyui@{VERSION}", "--engine-sha256", f"{ASSET}={digest}",
                      "--release-url", url, "--index-url", index.url, "--python", PYTHON,
                      "--python-platform", PLATFORM, "--llmgw-version", "0.9.0"])
    assert code == 0, err.getvalue()
    return out, err.getvalue()


def test_a_bundle_holds_comfyuis_archive_and_the_wheels_its_requirements_resolve_to(
        made, key, releases, wheels, index):
    out, said = made
    checked = verify.verify_bundle(out, [key[1]])
    torch, tiny_b = wheels["torch"], wheels["tiny-b"]
    text = (f"tiny-b==0.2.0 \\\n    --hash=sha256:{_sha256(tiny_b.read_bytes())}\n"
            f"torch==2.99.0 \\\n    --hash=sha256:{_sha256(torch.read_bytes())}\n")
    [engine] = checked.manifest.engines
    assert (engine.name, engine.version, engine.files) == (
        "comfyui", VERSION, [f"{FOLDER}/{ASSET}", f"{FOLDER}/{tiny_b.name}",
                             f"{FOLDER}/{torch.name}", f"{FOLDER}/requirements.txt"])
    listed = {f.path: f.sha256 for f in checked.manifest.files}
    assert listed == {f"{FOLDER}/{ASSET}": releases[1],
                      f"{FOLDER}/{tiny_b.name}": _sha256(tiny_b.read_bytes()),
                      f"{FOLDER}/{torch.name}": _sha256(torch.read_bytes()),
                      f"{FOLDER}/requirements.txt": _sha256(text.encode())}
    assert (out / "files" / FOLDER / "requirements.txt").read_text() == text
    assert (f"resolving ComfyUI {VERSION}'s requirements.txt (2 requirements) for CPython "
            f"{PYTHON} on {PLATFORM} from {index.url} as it stood at {CUTOFF}\n") in said
    # server.yaml written from it pins the archive, so the server finds nothing unpinned.
    settings, _ = offline_settings(checked.manifest, [key[1]])
    assert settings["engines"]["comfyui"].sha256 == {ASSET: releases[1]}
    assert settings_problems(config.ServerConfig(engines=settings["engines"])) == []


class ServedMirror:
    """The control plane's mirror of ``directory``, served by the server's own handler
    (as its agents' listener serves it), every path asked for kept."""

    def __init__(self, directory: Path) -> None:
        # An index no one serves: nothing may be resolved from one.
        engines = {"comfyui": {"version": VERSION, "index_url": "http://127.0.0.1:9/simple"}}
        self.config = config.parse({"bundle": {"mirror_dir": str(directory)},
                                    "engines": engines}, config.ServerConfig)
        self.requests: list[str] = []

    async def serve(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.path)
        return await aiohttp_response(self.config, request, "127.0.0.1")

    async def __aenter__(self) -> ServedMirror:
        app = web.Application()
        app.router.add_get(AIOHTTP_ROUTE, self.serve)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def imported(made, key, tmp_path: Path) -> Path:
    folder = tmp_path / "mirror"
    mirror.import_bundle(made[0], folder, [key[1]])
    return folder


async def install_from(served: ServedMirror, tmp_path: Path) -> wire.Engine:
    """What a GPU node does with what the control plane sends it for server.yaml's
    engines.comfyui while its mirror holds the bundle: the engine as the node reports it."""
    node = wire.Register(node_id="gpu1", address="127.0.0.1",
                         inventory=wire.Inventory(hostname="gpu1"),
                         installable_engines=["comfyui"], features=[wire.FEATURE_MIRROR])
    [wanted] = desired_engines(served.config, node, mirror_engines(served.config))
    assert wanted.release_url == f"{wire.MIRROR_ENGINES_URL}/comfyui/{VERSION}"
    changed = asyncio.Event()
    installer = EngineInstaller(
        config.AgentConfig(servers=[served.base], state_dir=str(tmp_path / "agent"),
                           install_os_packages=False),
        set_binary=lambda *_: None, changed=changed.set, facts=lambda: L4_NODE,
        python=sys.executable)
    async with installer:
        installer.control_plane = ControlPlane(served.base)
        installer.want(wire.InstallEngines(engines=[wanted]))
        return await until(changed, lambda: next(
            (e for e in installer.reported() if e.name == "comfyui"
             and e.state in ("installed", "failed")), None), 60, "ComfyUI to install or fail")


async def test_a_node_builds_comfyuis_environment_from_the_mirror_with_no_index(
        made, key, index, wheels, tmp_path):
    asked_before = len(index.requests)
    async with ServedMirror(imported(made, key, tmp_path)) as served:
        done = await install_from(served, tmp_path)
    assert (done.state, done.detail) == ("installed", "cu130 build"), done.detail
    assert index.requests[asked_before:] == []  # no index was read
    files = [ASSET, "requirements.txt", *(p.name for p in wheels.values())]
    assert sorted(served.requests) == sorted(f"/mirror/files/{FOLDER}/{f}" for f in files)
    path = tmp_path / "agent" / "engines" / "comfyui" / f"{VERSION}-cu130"
    marker = json.loads((path / MARKER).read_text())
    assert (marker["index_url"], marker["binary"]) == (BUNDLED, "main.py")
    assert (path / "venv" / RESOLVED).read_text().split() == ["tiny-b==0.2.0",
                                                             "torch==2.99.0"]
    assert (path / "main.py").is_file()
    assert sorted(os.listdir(path.parent.parent)) == [".uv-cache", "comfyui", "wanted.json"]


async def test_a_wheel_changed_in_the_mirror_fails_the_install_naming_it(
        made, key, wheels, tmp_path):
    folder = imported(made, key, tmp_path)
    name = wheels["tiny-b"].name
    changed = mirror.file_path(folder, f"{FOLDER}/{name}")
    data = changed.read_bytes()
    changed.chmod(0o644)
    changed.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    async with ServedMirror(folder) as served:
        done = await install_from(served, tmp_path)
    assert done.state == "failed"
    assert (f"{name} has sha256 {_sha256(changed.read_bytes())}, but {_sha256(data)} was "
            "expected") in done.detail
    engines = tmp_path / "agent" / "engines"
    assert not (engines / "comfyui").exists()
    assert [n for n in os.listdir(engines) if n.startswith(".") and n != ".uv-cache"] == []


# --- refused before anything is bundled ----------------------------------------------------


def _refused(key, out: Path, **changes) -> str:
    out.parent.mkdir(exist_ok=True)
    request = create.Request(out=out, key_file=key[0], llmgw_version="0.9.0", **changes)
    with pytest.raises(BundleError) as err:
        asyncio.run(create.create_bundle(request))
    assert list(out.parent.iterdir()) == [], "a refused bundle leaves nothing"
    return str(err.value)


def _comfyui(url: str, digest: str, **changes) -> dict:
    """A request for ComfyUI's archive at ``url`` pinned to ``digest``; no index is up."""
    return {"engines": [create.EngineWant("comfyui", VERSION)], "release_url": url,
            "engine_sha256": {ASSET: digest},
            "python_target": wheelsets.Target(PYTHON, PLATFORM, "http://127.0.0.1:9/simple"),
            **changes}


def test_an_archive_that_is_not_the_pinned_one_is_refused(key, releases, tmp_path):
    url, digest = releases
    said = _refused(key, tmp_path / "a" / "bundle", **_comfyui(url, "ab" * 32))
    assert said == (f"{url}/{ASSET} has sha256 {digest}, but --engine-sha256 pins "
                    f"{'ab' * 32}: the file is corrupt, or not the one published")


def test_an_archive_whose_requirements_nodes_would_refuse_is_refused(key, tmp_path):
    line = "git+https://github.com/example/nodes.git@main#egg=nodes"
    digest = source_archive(tmp_path / "rel", requirements=f"torch\n{line}\n")
    with static_server(tmp_path / "rel") as url:
        said = _refused(key, tmp_path / "a" / "bundle", **_comfyui(url, digest))
        assert said == (f"ComfyUI {VERSION}'s requirements.txt line 2 ({line}) names a URL; "
                        "only packages from the index are taken; nodes could not install "
                        "this ComfyUI either")
        # Not a ComfyUI release: no main.py at its top.
        with tarfile.open(tmp_path / "rel" / ASSET, "w:gz") as tar:
            tar.addfile(tarfile.TarInfo("ComfyUI/app/main.py"), io.BytesIO(b""))
        digest = _sha256((tmp_path / "rel" / ASSET).read_bytes())
        said = _refused(key, tmp_path / "b" / "bundle", **_comfyui(url, digest))
    assert said == f"{ASSET} has no main.py at its top; it is not a ComfyUI release"


def test_an_unpinned_archive_or_a_pin_nothing_asks_for_is_refused_before_downloading(
        key, tmp_path):
    unpinned = _refused(key, tmp_path / "a" / "bundle",
                        **_comfyui("http://127.0.0.1:9", "", engine_sha256={}))
    assert unpinned == (
        f"--engine comfyui@{VERSION}: GitHub publishes no digest for ComfyUI's tag archive "
        f"{ASSET}, so it cannot be checked without one: give --engine-sha256 {ASSET}=SHA256, "
        "the sha256 server.yaml pins under engines.comfyui.sha256")
    stray = _refused(key, tmp_path / "b" / "bundle", **_comfyui(
        "http://127.0.0.1:9", "", engine_sha256={ASSET: "ab" * 32, "v0.3.6.tar.gz": "cd" * 32}))
    assert stray == ("--engine-sha256 v0.3.6.tar.gz: no --engine asks for that file (ComfyUI "
                     "VERSION's archive is vVERSION.tar.gz)")
    with pytest.raises(BundleError, match=r"--engine-sha256 'v0\.3\.60\.tar\.gz': write "
                                          "FILE=SHA256"):
        create.parse_engine_sha256(ASSET)
    assert create.parse_engine_sha256(f"{ASSET}={'AB' * 32}") == (ASSET, "ab" * 32)

