"""llama.cpp across two nodes over RPC, with two real agents on loopback."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest

from tests.integration.cluster import wait_for

MODEL = "smollm2-rpc"


def test_two_node_replica_over_rpc_answers_through_its_leader(make_cluster, llama_cpp):
    server, weights = llama_cpp
    model = {"name": MODEL, "replicas": 1, "profiles": [
        {"engine": "llama.cpp", "weights": weights, "nodes": 2, "startup_timeout_s": 120,
         "args": ["--threads", "1", "--ctx-size", "2048"]}]}
    cluster = make_cluster(models=[model])
    cluster.start_server()
    # Health checked five times a second: were the worker probed while its leader holds
    # it, the probes would fill its one-deep accept queue within the first second.
    health = {"every_s": 0.2, "unhealthy_after_s": 0.5}
    for node in ("node-a", "node-b"):
        cluster.add_agent(node, fabric="lo", engines={"llama.cpp": {"binary": server}},
                          shard_health=health)
    [replica] = cluster.wait_ready(MODEL, timeout_s=90)
    leader, worker = sorted(replica["shards"], key=lambda s: s["rank"])
    assert leader["node"] != worker["node"], "one shard per node"

    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                           max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is 2+2? Answer with the number."}])
    assert "4" in reply.choices[0].message.content

    # The worker's agent is restarted three times (an upgrade, say): it adopts the worker
    # without probing it, so the probes of earlier agents do not fill its accept queue.
    worker_agent = cluster.agents[worker["node"]]
    for round_ in range(3):
        worker_agent.kill()
        worker_agent.start()
        wait_for(lambda n=round_ + 2: worker_agent.log.read_text().count("registered with")
                 == n, 15, f"the worker's agent to register again (round {round_})")
        wait_for(lambda: cluster.ready_replicas(MODEL), 15, "the replica to be ready")
    assert [r["id"] for r in cluster.ready_replicas(MODEL)] == [replica["id"]]

    # The worker is an RPC server: it takes TCP connections but speaks no HTTP. Serving its
    # leader, it accepts no other client; the kernel still queues one more connection,
    # which it would not were the agent's probes filling the queue.
    with socket.create_connection(("127.0.0.1", worker["port"]), timeout=5):
        pass
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{worker['port']}/health", timeout=1)
    [replica] = cluster.replicas(MODEL)
    assert {s["state"] for s in replica["shards"]} == {"ready"}, replica
    # And the leader really used it: the worker's own log shows the leader's connections.
    agent = cluster.agents[worker["node"]]
    [record] = agent.shard_records()
    log = (agent.state_dir / "shards" / f"{record['unit']}.log").read_text()
    assert "Accepted client connection" in log
    leader_log = cluster.agents[leader["node"]].log.read_text()
    assert f"--rpc 127.0.0.1:{worker['port']}" in leader_log
