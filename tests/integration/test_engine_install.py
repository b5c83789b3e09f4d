"""A node installs its own llama.cpp from the cluster's mirror, says so on the way, and
serves a model with it.

Offline and real: the test builds a llama.cpp release archive from the llama-server llmgw
builds in its cache (with the shared libraries it loads), serves it as a release mirror
(files and a SHA256SUMS) from an HTTP server on loopback, and starts a server whose
``engine_mirror`` points there and an agent with no engine configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.server
import itertools
import shutil
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

from llmgw import wire
from llmgw.agent.install.manager import EngineInstaller
from llmgw.config import AgentConfig
from llmgw.core.backoff import RetryPolicy
from llmgw.core.builds import NodeFacts
from llmgw.core.digests import parse_digests
from tests.integration.cluster import wait_for
from tests.integration.releases import VERSION, make_release
from tests.integration.releases import asset as release_asset

MODEL = "smollm2-installed"
# The part of a held download sent before the mirror waits to be released.
_HELD_PREFIX = 64 * 1024


class Mirror:
    """A release mirror on loopback: ``<url>/<engine>/<version>/<file>``. A file named in
    ``hold`` is sent only up to its first 64 KiB until ``release()``, so a test can watch
    a node while it downloads."""

    def __init__(self, root: Path, hold: str = ""):
        self.root, self.hold = root, hold
        self.released = threading.Event()
        self.requests: list[str] = []
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                mirror.requests.append(self.path)
                path = (mirror.root / self.path.lstrip("/")).resolve()
                if not path.is_relative_to(mirror.root) or not path.is_file():
                    self.send_error(404)
                    return
                body = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if path.name == mirror.hold:
                    self.wfile.write(body[:_HELD_PREFIX])
                    self.wfile.flush()
                    mirror.released.wait(60)
                    body = body[_HELD_PREFIX:]
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Mirror:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def _engine(cluster, node_id: str, name: str) -> dict | None:
    nodes = {n["id"]: n for n in cluster.admin("GET", "/api/nodes").json()}
    node = nodes.get(node_id)
    return next((e for e in node["engines"] if e["name"] == name), None) if node else None


@contextlib.contextmanager
def _mirror_with_release(tmp_path: Path, server_binary: str) -> Iterator[tuple[Mirror, Path]]:
    asset = release_asset()
    archive = make_release(Path(server_binary), tmp_path / "mirror", asset)
    with Mirror(tmp_path / "mirror", hold=asset) as mirror:
        yield mirror, archive


def test_a_node_installs_llama_cpp_from_the_mirror_reports_it_and_serves(
        make_cluster, llama_cpp, tmp_path):
    server_binary, weights = llama_cpp
    model = {"name": MODEL, "replicas": 1, "profiles": [
        {"engine": "llama.cpp", "weights": weights, "startup_timeout_s": 120,
         "args": ["--threads", "1", "--ctx-size", "1024"]}]}
    with _mirror_with_release(tmp_path, server_binary) as (mirror, archive):
        cluster = make_cluster(models=[model], engines={"llama.cpp": {}},
                               engine_mirror=f"{mirror.url}/")
        cluster.start_server()
        # No engine named: whatever llama-server is on this machine is not the agent's.
        agent = cluster.add_agent("n1", install_os_packages=False)

        installing = wait_for(
            lambda: (e := _engine(cluster, "n1", "llama.cpp")) and e["state"] == "installing"
            and e, 30, "the node to report llama.cpp installing")
        size = archive.stat().st_size / 1e6
        assert installing["version"] == VERSION
        assert installing["detail"].startswith(f"installing: downloading {archive.name} (")
        assert f"{size:.1f} MB" in installing["detail"] or f"{size:.0f} MB" in installing[
            "detail"]
        # Placement turns the node down in its own words while it installs.
        unplaced = wait_for(
            lambda: next(m["unplaced"] for m in cluster.status()["models"]
                         if m["name"] == MODEL), 10, "placement to say why not")
        assert f"n1: installing: downloading {archive.name}" in unplaced

        mirror.released.set()
        installed = wait_for(
            lambda: (e := _engine(cluster, "n1", "llama.cpp")) and e["state"] == "installed"
            and e, 60, "the node to report llama.cpp installed")
        assert installed["version"] == VERSION
        assert installed["detail"] == "cpu build"
        assert f"/llama.cpp/{VERSION}/SHA256SUMS" in mirror.requests

        cluster.wait_ready(MODEL, timeout_s=90)
        reply = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=60,
                           headers={"authorization": f"Bearer {cluster.api_key}"},
                           json={"model": MODEL, "max_tokens": 8,
                                 "messages": [{"role": "user", "content": "Say hi"}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        # The shard runs the installed binary, not the one in llmgw's cache.
        installed_dir = agent.state_dir / "engines" / "llama.cpp" / f"{VERSION}-cpu"
        pids = [pid for pid, _ in agent.engine_pids().values()]
        assert pids and all(Path(psutil.Process(pid).exe()).is_relative_to(
            installed_dir.resolve()) for pid in pids)
    shutil.rmtree(tmp_path / "mirror", ignore_errors=True)


def test_a_binary_missing_a_library_is_reported_failed_and_placement_says_why(
        make_cluster, tmp_path):
    """An archive whose llama-server needs a library it does not carry: refused before it
    is renamed into place, in ldd's words made readable, and shown by placement."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "needed.c").write_text("int needed(void) { return 0; }\n")
    (source / "main.c").write_text(
        '#include <stdio.h>\nint needed(void);\n'
        'int main(void) { puts("version: 1 (test)"); return needed(); }\n')
    subprocess.run(["cc", "-shared", "-fPIC", "-o", source / "libllmgwneeded.so.1",
                    source / "needed.c", "-Wl,-soname,libllmgwneeded.so.1"], check=True,
                   timeout=60)
    subprocess.run(["cc", "-o", source / "llama-server", source / "main.c",
                    "-L", source, "-l:libllmgwneeded.so.1"], check=True, timeout=60)
    asset = release_asset()
    directory = tmp_path / "mirror" / "llama.cpp" / VERSION
    directory.mkdir(parents=True)
    with tarfile.open(directory / asset, "w:gz") as tar:
        tar.add(source / "llama-server", arcname=f"llama-{VERSION}/llama-server")
    digest = hashlib.sha256((directory / asset).read_bytes()).hexdigest()
    (directory / "SHA256SUMS").write_text(f"{digest}  {asset}\n")
    model = {"name": MODEL, "nodes": {"labels": {"pool": "a"}},
             "profiles": [{"engine": "llama.cpp", "weights": "/nowhere.gguf"}]}
    with Mirror(tmp_path / "mirror") as mirror:
        cluster = make_cluster(models=[model], engines={"llama.cpp": {}},
                               engine_mirror=mirror.url)
        cluster.start_server()
        agent = cluster.add_agent("n1", install_os_packages=False, labels={"pool": "a"})
        # A node whose agent.yaml names llama.cpp keeps it: nothing is installed over it.
        named = cluster.add_agent("n2", install_os_packages=False,
                                  engines={"llama.cpp": {"binary": "/opt/own/llama-server"}})
        failed = wait_for(
            lambda: (e := _engine(cluster, "n1", "llama.cpp")) and e["state"] == "failed"
            and e, 30, "the node to report llama.cpp failed")
        assert "libllmgwneeded.so.1 is missing" in failed["detail"]
        assert failed["detail"].startswith("failed: ")
        unplaced = wait_for(
            lambda: next(m["unplaced"] for m in cluster.status()["models"]
                         if m["name"] == MODEL), 10, "placement to say why not")
        assert "n1: llama.cpp failed: " in unplaced and "libllmgwneeded.so.1" in unplaced
        # Nothing that failed its checks was put in place.
        assert not (agent.state_dir / "engines" / "llama.cpp" / f"{VERSION}-cpu").exists()
        own = wait_for(lambda: _engine(cluster, "n2", "llama.cpp"), 30, "n2 to register")
        assert own["state"] == "configured"
        assert own["detail"] == "named in agent.yaml: /opt/own/llama-server"
        assert not (named.state_dir / "engines" / "llama.cpp").exists()


def test_digests_are_read_from_sha256sums_and_from_githubs_release_json():
    sums = f"{'a' * 64}  other.tar.gz\n{'B' * 64} *llama-b1-bin-ubuntu-x64.tar.gz\n"
    assert parse_digests(sums, "llama-b1-bin-ubuntu-x64.tar.gz") == "b" * 64
    release = ('{"assets": [{"name": "llama-b1-bin-ubuntu-x64.tar.gz", '
               f'"digest": "sha256:{"c" * 64}"}}]}}')
    assert parse_digests(release, "llama-b1-bin-ubuntu-x64.tar.gz") == "c" * 64
    assert parse_digests(release, "llama-b1-bin-ubuntu-arm64.tar.gz") is None
    assert parse_digests("not a list", "x.tar.gz") is None


async def test_a_failed_pass_is_retried_backing_off_to_the_cap_and_a_success_starts_over(
        tmp_path):
    """The installer's own loop under core.backoff, with a policy in fractions of a second
    (the node's is a minute backing off to ten). An engine that cannot install (ComfyUI
    with no sha256 pinned: refused before anything is fetched) fails every pass."""
    policy = RetryPolicy(first_s=0.25, max_s=1.0)
    passes: list[float] = []
    counted = asyncio.Event()
    loop = asyncio.get_running_loop()

    def facts() -> NodeFacts:  # read once per pass, in a worker thread
        passes.append(time.monotonic())
        loop.call_soon_threadsafe(counted.set)
        return NodeFacts("x86_64", gpus=1, gpu_driver="580.82.07",
                         compute_capabilities=((8, 9),))

    async def until_passes(n: int) -> list[float]:
        deadline = time.monotonic() + 15
        while len(passes) < n:
            counted.clear()
            if len(passes) < n:
                await asyncio.wait_for(counted.wait(), max(0.01, deadline - time.monotonic()))
        return [b - a for a, b in itertools.pairwise(passes)]

    unpinned = wire.InstallEngines(engines=[wire.EngineWanted(
        name="comfyui", version="0.3.60", release_url="http://127.0.0.1:9/comfyui")])
    config = AgentConfig(servers=["http://127.0.0.1:9"], state_dir=str(tmp_path),
                         install_os_packages=False)
    installer = EngineInstaller(config, set_binary=lambda *_: None, changed=lambda: None,
                                facts=facts, retry_policy=policy)
    async with installer:
        installer.want(unpinned)
        gaps = await until_passes(5)
        [failed] = installer.reported()
        assert failed.state == "failed" and "pin its sha256" in failed.detail
        # After 0.25, 0.5, then 1.0 and 1.0: capped (doubling on would wait 2.0).
        assert all(gap >= wait for gap, wait in zip(gaps, (0.25, 0.5, 1.0, 1.0), strict=True))
        assert gaps[-1] < 1.8, gaps
        # A pass that succeeds (nothing asked for) forgets the failures: the next failure is
        # retried after the first delay again, not the cap.
        installer.want(wire.InstallEngines(engines=[]))
        await until_passes(6)
        installer.want(unpinned)
        gaps = await until_passes(8)
        assert policy.first_s <= gaps[-1] < policy.max_s - 0.2, gaps
