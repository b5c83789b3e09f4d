"""The disk holding a node's weights fills while the node fetches weights: that shard fails
saying the disk is full, its partial download is removed, and the node and the replica it
already serves are untouched; once space is freed, the next try fetches and serves.

The agent runs in a mount namespace of its own (``unshare``) with a 2 MiB tmpfs on its
weights directory; its engines, its children, see the same. The weights come from the
test's Hugging Face-shaped hub (tests/hub.py). As the hub starts sending the file, another
writer fills the disk: the test, through the agent's own view of its mounts
(``/proc/PID/root``), as a log or another download on the node would."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import openai

from llmgw.core.weights import directory_name, parse_source, weights_key
from tests.chaos.measure import figure
from tests.hub import hub_in_thread
from tests.integration.cluster import Cluster, cannot, process_alive

SIZE = 1_500_000  # fits the 2 MiB disk alone: the free-space check before the fetch passes
FETCHED = {"name": "sim-fetched", "replicas": 1,
           "profiles": [{"engine": "sim", "source": "hf://org/big"}]}
SERVING = {"name": "sim-small", "replicas": 1, "profiles": [{"engine": "sim"}]}


def ask(c: Cluster, model: str) -> str:
    client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=c.api_key, max_retries=0,
                           timeout=10)
    reply = client.chat.completions.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": "room left?"}])
    return reply.choices[0].message.content


def test_a_disk_that_fills_during_a_weights_fetch_fails_only_that_shard(make_cluster,
                                                                        record_property):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        cannot("a tmpfs in a private mount namespace needs root and unshare (util-linux)")
    with hub_in_thread({"org/big": {"model.safetensors": os.urandom(SIZE)}}) as hub:
        c = make_cluster([SERVING, FETCHED])
        weights = c.root / "w"
        weights.mkdir()
        c.start_server()
        agent = c.add_agent(
            "node-a", weights={"directories": [{"path": str(weights)}], "hub": hub.url},
            prefix=("unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount -t tmpfs -o size=2m,mode=0755 llmgw-chaos "$0" && exec "$@"',
                    str(weights)))
        assert agent.proc is not None
        # The weights directory as the agent sees it: its tmpfs, not the test's directory.
        seen = Path(f"/proc/{agent.proc.pid}/root") / weights.relative_to("/")

        def fill(_path: str) -> None:
            if hub.before_file is None:
                return
            hub.before_file = None  # once: the next tries find the disk full already
            st = os.statvfs(seen)
            (seen / "filler").write_bytes(bytes(st.f_bavail * st.f_frsize - 100_000))

        hub.before_file = fill
        began = time.monotonic()
        [serving] = c.wait_ready("sim-small")
        engines = agent.engine_pids()
        full = c.server_log_line("of sim-fetched failed:", "is full")
        full_s = time.monotonic() - began
        assert (f"fetching sim-fetched: the disk holding {weights} is full: the weights need "
                "1.5 MB and ") in full, full
        assert full.endswith("free space or add a weights directory"), full
        # The next try is refused before it downloads anything: no room.
        refused = c.server_log_line("of sim-fetched failed:", "needs 1.5 MB")
        assert f"fetching sim-fetched needs 1.5 MB; {weights} has " in refused, refused
        assert refused.endswith(" KB free: free space or add a weights directory"), refused
        # The partial download is gone; the node and what it serves are untouched.
        assert sorted(p.name for p in seen.iterdir()) == ["filler"]
        assert c.node_state("node-a") == "ready"
        assert [r["id"] for r in c.ready_replicas("sim-small")] == [serving["id"]]
        assert agent.engine_pids() == engines
        assert all(process_alive(*engine) for engine in engines.values())
        assert ask(c, "sim-small")
        assert len(hub.downloads()) == 1

        # An operator frees space: the next try (after the crash-loop backoff, at most 2 s
        # here) fetches the weights and serves them.
        freed_at = time.monotonic()
        (seen / "filler").unlink()
        c.wait_ready("sim-fetched", timeout_s=30)
        served_s = time.monotonic() - freed_at
        assert ask(c, "sim-fetched")
        key = weights_key(parse_source("hf://org/big"), ())
        assert sorted(p.name for p in seen.iterdir()) == [directory_name(key)]
        assert len(hub.downloads()) == 2
        assert [r["id"] for r in c.ready_replicas("sim-small")] == [serving["id"]]
        assert agent.engine_pids().items() >= engines.items()
        log = (c.root / "server.log").read_text() + agent.log.read_text()
        assert "Traceback" not in log

    figure(record_property, "start_to_disk_full_failure_s", full_s, "s")
    figure(record_property, "space_freed_to_replica_ready_s", served_s, "s")
