"""A node's weights, end to end: real agents look in their weights directories, fetch
what they lack from a Hugging Face-shaped hub the test serves, and the control plane
places by it and shows it per fabric."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.hub import hub_in_thread
from tests.integration.cluster import wait_for

HELD = "sim-held"


def _llmgw(*args: str) -> subprocess.CompletedProcess:
    # Wide enough that rich does not wrap a path inside a table cell.
    return subprocess.run([sys.executable, "-m", "llmgw", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})


def _weights_of(cluster, model: str) -> list[dict]:
    return next(m["weights"] for m in cluster.status()["models"] if m["name"] == model)


def test_weights_copied_in_by_hand_are_seen_shown_per_fabric_and_preferred(make_cluster):
    c = make_cluster(models=[{"name": HELD, "replicas": 1, "profiles": [{"engine": "sim"}]}])
    c.start_server()
    fast = {"probe_interval_s": 0.3}
    c.add_agent("node-a", fabric="ib-a", **fast)
    [first] = c.wait_ready(HELD)
    assert first["shards"][0]["node"] == "node-a"
    node_b = c.add_agent("node-b", fabric="ib-b", **fast)
    wait_for(lambda: c.node_state("node-b") == "ready", 15, "node-b to be ready")
    assert _weights_of(c, HELD) == []

    # An operator copies weights in by hand; half a copy is not weights.
    copied = node_b.state_dir / "weights" / "sim-held-by-hand"
    copied.mkdir(parents=True)
    (copied / "model.safetensors").write_bytes(os.urandom(4096))
    (copied / "config.json").write_text('{"architectures": ["Sim"]}')
    wrote = _llmgw("weights", "manifest", str(copied), "--key", HELD)
    assert wrote.returncode == 0, wrote.stderr
    (copied / "model.safetensors").write_bytes(os.urandom(100))  # truncated after all
    listed = _llmgw("weights", "list", "--config", str(node_b.config_path), "--json")
    assert listed.returncode == 1, listed.stdout  # a directory with a problem
    assert "model.safetensors" in listed.stdout
    assert _weights_of(c, HELD) == []

    assert _llmgw("weights", "manifest", str(copied), "--key", HELD).returncode == 0
    held = wait_for(lambda: _weights_of(c, HELD), 15, "node-b's weights to reach the server")
    assert held == [{"fabric": "ib-b", "nodes": ["node-b"], "shared": []}]
    server_log = (c.root / "server.log").read_text()
    assert f"node node-b changed: weights +{HELD}" in server_log

    # The replica on node-a fails; both nodes are empty then, and the replacement goes
    # where the weights are (without them, binpack's tie-break by name picks node-a).
    [record] = c.agents["node-a"].shard_records()
    os.kill(record["pid"], signal.SIGKILL)

    def moved():
        ready = c.ready_replicas(HELD)
        return ready and ready[0]["id"] != first["id"] and ready[0]
    again = wait_for(moved, 30, "a replacement replica")
    assert again["shards"][0]["node"] == "node-b"


def test_a_shared_filer_counts_once_for_its_fabric_and_each_directory_reports_its_space(
        make_cluster, tmp_path):
    filer = tmp_path / "filer"  # a mounted filer; the agent creates only local directories
    c = make_cluster(models=[{"name": HELD, "replicas": 0, "profiles": [{"engine": "sim"}]}])
    c.start_server()
    weights = filer / "sim-held"
    weights.mkdir(parents=True)
    (weights / "model.bin").write_bytes(b"w" * 2048)
    assert _llmgw("weights", "manifest", str(weights), "--key", HELD).returncode == 0
    local = {node: tmp_path / f"local-{node}" for node in ("node-a", "node-b")}
    for node in ("node-a", "node-b"):
        c.add_agent(node, fabric="ib-a", weights={"directories": [
            {"path": str(local[node])}, {"path": str(filer), "shared": True}]})
    wait_for(lambda: len(c.status()["nodes"]) == 2, 15, "two nodes")

    assert _weights_of(c, HELD) == [{"fabric": "ib-a", "nodes": [], "shared": [str(filer)]}]
    ctl = _llmgw("ctl", "status", "--server", c.base_url, "--token", c.admin_token)
    assert ctl.returncode == 0, ctl.stderr
    assert f"ib-a: shared {filer}" in ctl.stdout

    # Each node reports each of its directories, with its disk's space.
    listed = _llmgw("ctl", "nodes", "list", "--json", "--server", c.base_url,
                    "--token", c.admin_token)
    assert listed.returncode == 0, listed.stderr
    nodes = {n["id"]: n for n in json.loads(listed.stdout)}
    assert sorted(nodes) == ["node-a", "node-b"]
    for node_id, node in nodes.items():
        dirs = node["weights_dirs"]
        assert [(d["path"], d["shared"]) for d in dirs] == [(str(local[node_id]), False),
                                                            (str(filer), True)]
        # Created at start, so the first heartbeat already reports their disk.
        assert local[node_id].is_dir()
        assert all(d["free_mib"] > 0 and d["total_mib"] > 0 for d in dirs), dirs


@pytest.fixture
def smollm2_repo(llama_cpp) -> dict[str, dict[str, bytes]]:
    _, gguf = llama_cpp
    return {"HuggingFaceTB/SmolLM2-135M-Instruct-GGUF": {
        Path(gguf).name: Path(gguf).read_bytes(),
        "README.md": b"# SmolLM2-135M-Instruct, Q4_1\n",
        "other-quant.Q8_0.gguf": os.urandom(2048)}}


def test_a_node_fetches_the_weights_it_lacks_and_llama_cpp_serves_them(make_cluster, llama_cpp,
                                                                     smollm2_repo):
    server_binary, gguf = llama_cpp
    with hub_in_thread(smollm2_repo, chunk=1 << 20) as hub:
        model = {"name": "smollm2-fetched", "replicas": 1, "profiles": [{
            "engine": "llama.cpp", "source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
            "files": [Path(gguf).name], "startup_timeout_s": 120,
            "args": ["--threads", "1", "--ctx-size", "1024"]}]}
        c = make_cluster(models=[model])
        c.start_server()
        agent = c.add_agent("node-a", engines={"llama.cpp": {"binary": server_binary}},
                            weights={"directories": [{"path": str(c.root / "w")}],
                                     "hub": hub.url})
        c.wait_ready("smollm2-fetched", timeout_s=120)

        key = f"HuggingFaceTB/SmolLM2-135M-Instruct-GGUF@main[{Path(gguf).name}]"
        # Only the file the profile names was fetched, once.
        assert len(hub.downloads(Path(gguf).name)) == 1
        assert hub.downloads("other-quant.Q8_0.gguf") == hub.downloads("README.md") == []
        assert (f"fetching {key} from hf://HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
                in agent.log.read_text())
        held = wait_for(lambda: _weights_of(c, "smollm2-fetched"), 15, "the fetched weights")
        assert held == [{"fabric": None, "nodes": ["node-a"], "shared": []}]
        node = next(n for n in c.status()["nodes"] if n["id"] == "node-a")
        assert key in node["weights"]

        client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=c.api_key,
                               max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="smollm2-fetched", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Say hi."}])
        assert reply.choices[0].message.content


def test_a_fetch_that_fails_fails_the_shard_with_the_reason(make_cluster):
    repo = {"org/sim-weights": {"model.bin": os.urandom(4096)}}
    with hub_in_thread(repo) as hub:
        hub.corrupt = {"model.bin": b"x" * 4096}
        model = {"name": "sim-fetched", "replicas": 1, "profiles": [{
            "engine": "sim", "source": "hf://org/sim-weights"}]}
        c = make_cluster(models=[model])
        c.start_server()
        c.add_agent("node-a", weights={"directories": [{"path": str(c.root / "w")}],
                                       "hub": hub.url})

        # The control plane hears why: the shard failed with the agent's words.
        line = c.server_log_line("-> failed", "model.bin")
        assert "sha256 mismatch" in line and "fetching sim-fetched" in line
        assert not any(p.name.startswith(".partial-") for p in (c.root / "w").iterdir())


def test_a_fetch_survives_a_control_plane_restart_and_is_not_started_twice(make_cluster):
    # 2 MiB served in 64 KiB chunks 0.1 s apart: a fetch of about three seconds.
    repo = {"org/slow-weights": {"model.bin": os.urandom(2 * 2**20)}}
    with hub_in_thread(repo, chunk=64 * 1024, chunk_delay=0.1) as hub:
        model = {"name": "sim-slow-fetch", "replicas": 1, "profiles": [{
            "engine": "sim", "source": "hf://org/slow-weights"}]}
        c = make_cluster(models=[model])
        c.start_server()
        c.add_agent("node-a", weights={"directories": [{"path": str(c.root / "w")}],
                                       "hub": hub.url})

        def fetching():
            for r in c.replicas("sim-slow-fetch"):
                if r["shards"] and r["shards"][0]["state"] == "fetching":
                    return r
            return None
        first = wait_for(fetching, 15, "the shard to report fetching")
        assert "fetching sim-slow-fetch:" in first["shards"][0]["detail"]

        c.restart_server()  # the agent reconnects mid-fetch and reports the shard

        [ready] = c.wait_ready("sim-slow-fetch", timeout_s=30)
        assert ready["id"] == first["id"]  # adopted, not placed again
        assert len(hub.downloads("model.bin")) == 1
