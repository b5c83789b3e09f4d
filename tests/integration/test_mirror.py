"""The control plane serves its imported bundle to its nodes, and they install and fetch
from it.

Real and offline: bundles are made in the test from local files (a llama.cpp release
archive built from the llama-server in llmgw's cache, the SmolLM2 GGUF), signed with a
new Ed25519 key, imported into the server's mirror as `llmgw bundle import` does, and
served by a real server to a real agent that has no hub and no engine configured.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import ssl
from pathlib import Path

import httpx
import pytest

from llmgw.agent.control_plane import client_context
from llmgw.agent.weights import read_manifest
from llmgw.bundle import manifest as mf
from llmgw.bundle.mirror import BUNDLES, current_manifest, import_bundle
from llmgw.cli.main import main
from llmgw.config import AgentTls, EngineRelease, ServerConfig, load
from tests.integration.bundles import Made, Signer, make_bundle
from tests.integration.cluster import ClusterCa, free_port, wait_for
from tests.integration.releases import VERSION, release_archive
from tests.integration.releases import asset as release_asset

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
COMMIT = "4f1e2d3c4b5a69788796a5b4c3d2e1f0a1b2c3d4"
MODEL = "smollm2-mirrored"


def _engine(cluster, node_id: str, name: str) -> dict | None:
    nodes = {n["id"]: n for n in cluster.admin("GET", "/api/nodes").json()}
    node = nodes.get(node_id)
    return next((e for e in node["engines"] if e["name"] == name), None) if node else None


def _pinned(made: Made, path: str) -> str:
    return next(f.sha256 for f in made.manifest.files if f.path == path)


def _bundle_settings(signer: Signer, mirror: Path) -> dict:
    return {"trusted_keys": [signer.line], "mirror_dir": str(mirror)}


def test_a_node_installs_llama_cpp_and_fetches_smollm2_from_the_mirror_and_serves_them(
        make_cluster, llama_cpp, tmp_path):
    server_binary, gguf = llama_cpp
    asset = release_asset()
    archive = release_archive(Path(server_binary), tmp_path / "parts" / asset)
    signer = Signer.new()
    made = make_bundle(tmp_path / "bundle", signer,
                       engines={("llama.cpp", VERSION): {asset: archive}},
                       models={MODEL: (REPO, COMMIT, {Path(gguf).name: Path(gguf)})})
    mirror = tmp_path / "mirror"
    import_bundle(made.root, mirror, [signer.line], sha256=made.sha256)

    # `main`, as a profile names a repository, is the commit the bundle pinned.
    model = {"name": MODEL, "replicas": 1, "profiles": [{
        "engine": "llama.cpp", "source": f"hf://{REPO}", "files": [Path(gguf).name],
        "startup_timeout_s": 120, "args": ["--threads", "1", "--ctx-size", "1024"]}]}
    cluster = make_cluster(models=[model], engines={"llama.cpp": {}},
                           bundle=_bundle_settings(signer, mirror))
    cluster.start_server()
    # No hub, no engine: both come from the control plane.
    agent = cluster.add_agent("n1", install_os_packages=False)
    cluster.wait_ready(MODEL, timeout_s=150)
    reply = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=60,
                       headers={"authorization": f"Bearer {cluster.api_key}"},
                       json={"model": MODEL, "max_tokens": 8,
                             "messages": [{"role": "user", "content": "Say hi"}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]

    installed = _engine(cluster, "n1", "llama.cpp")
    assert (installed["state"], installed["version"], installed["detail"]) == (
        "installed", VERSION, "cpu build")
    # From the server the agent dialled, checked against the manifest's sha256.
    marker = json.loads((agent.state_dir / "engines" / "llama.cpp" / f"{VERSION}-cpu"
                         / ".llmgw-installed.json").read_text())
    path = mf.engine_path("llama.cpp", VERSION, asset)
    assert marker["url"] == f"{cluster.base_url}/mirror/files/{path}"
    assert marker["sha256"] == _pinned(made, path)
    # The weights: fetched from the mirror's hub, each file checked against the manifest.
    [fetched] = [d for d in (agent.state_dir / "weights").iterdir()
                 if (d / "llmgw-manifest.json").exists()]
    weights = read_manifest(fetched)
    assert weights.key == f"{REPO}@main[{Path(gguf).name}]"
    assert [(f.path, f.sha256) for f in weights.files] == [
        (Path(gguf).name, _pinned(made, mf.model_path(REPO, COMMIT, Path(gguf).name)))]
    agent_log = (cluster.root / "agent-n1.log").read_text()
    assert f"weights come from {cluster.base_url}/mirror/hub" in agent_log


def test_a_flipped_byte_in_the_mirrors_archive_fails_the_install_against_the_manifests_pin(
        make_cluster, tmp_path):
    asset = release_asset()
    part = tmp_path / "parts" / asset
    part.parent.mkdir()
    part.write_bytes(os.urandom(64 * 1024))
    signer = Signer.new()
    made = make_bundle(tmp_path / "bundle", signer,
                       engines={("llama.cpp", VERSION): {asset: part}})
    mirror = tmp_path / "mirror"
    imported = import_bundle(made.root, mirror, [signer.line])
    path = mf.engine_path("llama.cpp", VERSION, asset)
    served = mirror / BUNDLES / imported.bundle_id / mf.FILES / path
    data = bytearray(served.read_bytes())
    data[1000] ^= 0x01  # same size: only its digest tells
    served.write_bytes(data)

    cluster = make_cluster(engines={"llama.cpp": {}}, bundle=_bundle_settings(signer, mirror))
    cluster.start_server()
    agent = cluster.add_agent("n1", install_os_packages=False)
    failed = wait_for(lambda: (e := _engine(cluster, "n1", "llama.cpp"))
                      and e["state"] == "failed" and e, 30, "llama.cpp to fail to install")
    got, pinned = hashlib.sha256(data).hexdigest(), _pinned(made, path)
    assert failed["detail"] == (
        f"failed: {cluster.base_url}/mirror/files/{path} has sha256 {got}, but {pinned} was "
        "expected: the file is corrupt, or not the one that was published")
    assert not (agent.state_dir / "engines" / "llama.cpp" / f"{VERSION}-cpu").exists()


def _raw_get(port: int, path: str) -> tuple[int, str]:
    """GET ``path`` exactly as written: httpx would resolve the dots first."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def test_the_mirror_serves_the_bundle_it_imports_and_nothing_else(make_cluster, tmp_path):
    mirror = tmp_path / "mirror"
    signer = Signer.new()
    cluster = make_cluster(bundle=_bundle_settings(signer, mirror))
    cluster.start_server()
    base = f"{cluster.base_url}/mirror"

    # Before any import: the words say how to get one.
    for path in (f"/files/{mf.model_path(REPO, COMMIT, 'model.gguf')}",
                 f"/hub/api/models/{REPO}/tree/main"):
        nothing = httpx.get(base + path)
        assert nothing.status_code == 404
        assert nothing.json()["error"]["message"] == (
            "this control plane serves no bundle: import one with `llmgw bundle import "
            "BUNDLE --config server.yaml` (docs/offline.md)")

    parts = tmp_path / "parts"
    (parts / "nested").mkdir(parents=True)
    (parts / "model.gguf").write_bytes(os.urandom(3000))
    (parts / "nested" / "config.json").write_text('{"architectures": ["Llama"]}')
    made = make_bundle(tmp_path / "bundle", signer, models={"m": (REPO, COMMIT, {
        "model.gguf": parts / "model.gguf", "nested/config.json": parts / "nested" /
        "config.json"})})
    # Imported while the server runs: the next request sees it.
    import_bundle(made.root, mirror, [signer.line])

    def sha(name: str) -> str:
        return _pinned(made, mf.model_path(REPO, COMMIT, name))

    expected = [
        {"type": "file", "path": "model.gguf", "size": 3000,
         "lfs": {"oid": sha("model.gguf"), "size": 3000}},
        {"type": "directory", "path": "nested", "size": 0},
        {"type": "file", "path": "nested/config.json", "size": 28,
         "lfs": {"oid": sha("nested/config.json"), "size": 28}},
    ]
    for revision in ("main", COMMIT):
        listing = httpx.get(f"{base}/hub/api/models/{REPO}/tree/{revision}?recursive=true")
        assert listing.status_code == 200, listing.text
        assert listing.json() == expected
    resolved = httpx.get(f"{base}/hub/{REPO}/resolve/main/nested/config.json")
    assert resolved.content == (parts / "nested" / "config.json").read_bytes()
    assert resolved.headers["content-length"] == "28"
    direct = httpx.get(f"{base}/files/{mf.model_path(REPO, COMMIT, 'model.gguf')}")
    assert direct.content == (parts / "model.gguf").read_bytes()

    other = httpx.get(f"{base}/hub/api/models/{REPO}/tree/v2")
    assert other.status_code == 404
    assert f"holds {REPO} at {COMMIT}, not at v2" in other.json()["error"]["message"]
    unknown = httpx.get(f"{base}/hub/api/models/org/other/tree/main")
    assert "holds no model org/other" in unknown.json()["error"]["message"]
    # What the manifest does not list is not served, though it lies beside the files.
    assert httpx.get(f"{base}/manifest.json").status_code == 404
    assert httpx.get(f"{base}/files/models").status_code == 404

    token = (cluster.server_state / "secrets" / "admin-token").read_text().strip()
    for path, element in [
            ("/mirror/files/../../secrets/admin-token", ".."),
            ("/mirror/files/%2e%2e/%2e%2e/secrets/admin-token", ".."),
            (f"/mirror/files/models/{REPO}/.{COMMIT}/model.gguf", f".{COMMIT}"),
            ("/mirror/hub/api/models/../x/tree/main", ".."),
            (f"/mirror/hub/{REPO}/resolve/main/./model.gguf", ".")]:
        status, body = _raw_get(cluster.port, path)
        assert status == 400, (path, status, body)
        assert f"the element {element!r} is not one plain path element" in body, body
        assert token not in body


def test_with_tls_the_mirror_is_served_to_nodes_with_a_certificate_on_their_listener(
        make_cluster, tmp_path, monkeypatch):
    ca = ClusterCa.make(tmp_path / "ca")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca_file))
    signer = Signer.new()
    (tmp_path / "x.bin").write_bytes(b"engine bytes")
    made = make_bundle(tmp_path / "bundle", signer,
                       engines={("llama.cpp", VERSION): {"x.bin": tmp_path / "x.bin"}})
    mirror = tmp_path / "mirror"
    import_bundle(made.root, mirror, [signer.line])
    agent_port = free_port()
    cluster = make_cluster(tls=ca.server_tls(agent_port),
                           bundle=_bundle_settings(signer, mirror))
    cluster.start_server()
    tls = ca.node_tls("n1", cluster.server_state / "llmgw.db")
    path = f"/mirror/files/{mf.engine_path('llama.cpp', VERSION, 'x.bin')}"

    # The TLS the agent reads its mirror with.
    node = httpx.get(f"https://127.0.0.1:{agent_port}{path}",
                     verify=client_context(AgentTls(**tls)))
    assert (node.status_code, node.content) == (200, b"engine bytes")
    anonymous = httpx.get(f"https://127.0.0.1:{agent_port}{path}",
                          verify=ssl.create_default_context(cafile=str(ca.ca_file)))
    assert anonymous.status_code == 401
    assert anonymous.text.startswith("no client certificate: this listener takes agents")
    # The main listener serves clients, not nodes.
    main_listener = httpx.get(f"{cluster.base_url}{path}")
    assert main_listener.status_code == 403
    assert main_listener.json()["error"]["message"].startswith(
        "the mirror is served to the peers that may open the agent stream: this server "
        f"takes agents only on its mTLS listener, wss://127.0.0.1:{agent_port}")


def test_server_init_sets_a_fresh_control_plane_up_from_a_bundle(tmp_path, capsys):
    signer = Signer.new()
    parts = tmp_path / "parts"
    parts.mkdir()
    for name in ("archive.tar.gz", "smollm2.Q8_0.gguf", "README.md", "model.safetensors"):
        (parts / name).write_bytes(os.urandom(256))
    made = make_bundle(tmp_path / "bundle", signer,
                       engines={("llama.cpp", "b12000"): {"archive.tar.gz":
                                                          parts / "archive.tar.gz"}},
                       models={"smollm2": (REPO, COMMIT, {
                           "smollm2.Q8_0.gguf": parts / "smollm2.Q8_0.gguf",
                           "README.md": parts / "README.md"}),
                           "embedder": ("org/embedder", COMMIT, {
                               "model.safetensors": parts / "model.safetensors"})})

    # A bundle from a key it was not told to trust: nothing of a cluster is written.
    refused = tmp_path / "refused"
    assert main(["server", "init", "--dir", str(refused), "--address", "127.0.0.1",
                 "--bundle", str(made.root), "--trusted-key", Signer.new().line]) == 2
    err = capsys.readouterr().err
    assert f"the bundle is signed by key {signer.key_id}" in err
    assert not (refused / "server.yaml").exists() and not (refused / "secrets").exists()
    assert current_manifest(refused / "mirror") is None

    directory = tmp_path / "cp"
    assert main(["server", "init", "--dir", str(directory), "--address", "127.0.0.1",
                 "--bundle", str(made.root), "--sha256", made.sha256,
                 "--trusted-key", signer.line]) == 0
    out, err = capsys.readouterr()
    assert "engines llama.cpp b12000; models embedder (org/embedder@" in out
    assert "model embedder runs on vllm, which the bundle does not hold" in err
    assert current_manifest(directory / "mirror") == made.manifest

    config = load(directory / "server.yaml", ServerConfig)
    assert config.bundle.trusted_keys == [signer.line]
    assert config.bundle.mirror_dir == ""  # <state_dir>/mirror, where it was imported
    assert config.engines == {"llama.cpp": EngineRelease(version="b12000")}
    models = {m.name: m for m in config.models}
    assert sorted(models) == ["embedder", "smollm2"]
    assert all(m.replicas == 1 for m in models.values())
    [gguf] = models["smollm2"].profiles
    assert (gguf.engine, gguf.source, gguf.files) == (
        "llama.cpp", f"hf://{REPO}@{COMMIT}", ["README.md", "smollm2.Q8_0.gguf"])
    [safetensors] = models["embedder"].profiles
    assert (safetensors.engine, safetensors.source) == ("vllm", f"hf://org/embedder@{COMMIT}")
    assert config.tls is not None and config.state_dir == str(directory.resolve())


@pytest.mark.parametrize("flag", ["--sha256", "--trusted-key"])
def test_server_init_names_a_bundle_it_cannot_check(tmp_path, capsys, flag):
    signer = Signer.new()
    (tmp_path / "x").write_bytes(b"x")
    made = make_bundle(tmp_path / "bundle", signer,
                       engines={("llama.cpp", VERSION): {"x": tmp_path / "x"}})
    args = {"--sha256": ["--trusted-key", signer.line, "--sha256", "ab" * 32],
            "--trusted-key": []}[flag]
    assert main(["server", "init", "--dir", str(tmp_path / "cp"), "--address", "127.0.0.1",
                 "--bundle", str(made.root), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmgw server init: ")
    assert ("sha256" in err) if flag == "--sha256" else ("--bundle needs --trusted-key" in err)
    assert not (tmp_path / "cp" / "server.yaml").exists()
