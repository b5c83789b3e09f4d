"""Four nodes in network namespaces, two fabrics, a 2-node sim replica on each; one worker's
node dies, and its replica is rebuilt on the fabric that can still hold it, never across
fabrics.

Each node is a network namespace joined to a bridge by a veth pair (``netns.py``); the
server listens on the bridge's address, not loopback, so API keys stay required; each agent
runs inside its namespace (``ip netns exec``) with no address configured, and finds its own
as the source of its route to the server. Engines are the agents' children, so they run in
the node's namespace too.

The models: sim-a may run anywhere; sim-b only on nodes labelled pool=b (fab-b's). fab-a's
agents come first, so sim-a is placed there; then fab-b's, and sim-b takes it. Killing
sim-a's worker node leaves fab-a with one node: the only fabric that can hold a new 2-node
replica of sim-a is fab-b, beside sim-b (sim shards need no GPUs).

The Cluster's server runs with a heartbeat every 0.5 s, unreachable after 3 s and (here)
lost after 5 s, a controller pass every 0.5 s; every wait polls against a deadline.
"""

from __future__ import annotations

import os
import re
import signal
import time

import openai
import psutil
import pytest

from tests.integration.cluster import Cluster, process_alive, wait_for
from tests.integration.netns import Lab, Node, lab_for_test

LOST_AFTER_S = 5
# Still well past unreachable_after_s: a busy node that misses heartbeats for a moment is
# unreachable, never lost.
NODES = {"heartbeat_interval_s": 0.5, "unreachable_after_s": 3, "lost_after_s": LOST_AFTER_S}
SLACK_S = 17  # controller passes, a crash-loop backoff, two sim engines and a rendezvous
MOVE_DEADLINE_S = LOST_AFTER_S + SLACK_S

FABRICS = {"node1": "fab-a", "node2": "fab-a", "node3": "fab-b", "node4": "fab-b"}
LABELS = {"fab-a": {"pool": "a"}, "fab-b": {"pool": "b"}}
SIM_A = {"name": "sim-a", "replicas": 1, "profiles": [{"engine": "sim", "nodes": 2}]}
SIM_B = {"name": "sim-b", "replicas": 1, "profiles": [{"engine": "sim", "nodes": 2}],
         "nodes": {"labels": {"pool": "b"}}}
PLACED = re.compile(r"replica (\S+) of (\S+): placed on (\S+) \((\S+)\)")


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def lab():
    with lab_for_test(len(FABRICS)) as made:
        yield made


@pytest.fixture
def cluster(lab: Lab, make_cluster) -> Cluster:
    """Asked for after ``lab``, so its processes are stopped before the network goes."""
    made = make_cluster([SIM_A, SIM_B], nodes=NODES)
    made.listen_host = lab.server_address
    return made


# --- helpers ----------------------------------------------------------------------------------


def node_of(lab: Lab, node_id: str) -> Node:
    return lab.nodes[int(node_id.removeprefix("node")) - 1]


def add_node(cluster: Cluster, lab: Lab, node_id: str) -> None:
    fabric = FABRICS[node_id]
    cluster.add_agent(node_id, prefix=node_of(lab, node_id).exec_prefix, address=None,
                      fabric=fabric, labels=LABELS[fabric], runtime="process")


def fabrics_of(replica: dict) -> set[str]:
    return {FABRICS[s["node"]] for s in replica["shards"]}


def by_rank(replica: dict) -> list[dict]:
    return sorted(replica["shards"], key=lambda s: s["rank"])


def ask(cluster: Cluster, model: str) -> str:
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                           max_retries=0, timeout=10)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "which fabric?"}], max_tokens=4)
    return reply.choices[0].message.content


def engine_record(cluster: Cluster, node_id: str, replica_id: str) -> dict:
    [record] = [r for r in cluster.agents[node_id].shard_records()
                if r.get("replica") == replica_id]
    return record


def check_only_the_leader_listens(cluster: Cluster, lab: Lab, replica: dict) -> None:
    """Rank 0's namespace listens on the shard's port and the group's rendezvous port, at
    its node's address; the worker's engine listens on nothing, and neither does anything
    else in the worker's namespace."""
    leader, worker = by_rank(replica)
    leader_node, worker_node = node_of(lab, leader["node"]), node_of(lab, worker["node"])
    worker_engine = engine_record(cluster, worker["node"], replica["id"])
    argv = psutil.Process(worker_engine["pid"]).cmdline()
    host, _, port = argv[argv.index("--rendezvous") + 1].rpartition(":")
    assert host == leader_node.address, argv
    listening = lab.listening(leader_node)
    assert (leader_node.address, leader["port"]) in listening, listening
    assert (leader_node.address, int(port)) in listening, listening
    assert [c for c in psutil.Process(worker_engine["pid"]).net_connections("inet")
            if c.status == psutil.CONN_LISTEN] == []
    assert lab.listening(worker_node) == set()


def placements(cluster: Cluster) -> list[tuple[str, str, list[str], str]]:
    """(replica, model, nodes, fabric) of every "placed on" line in the server's log."""
    text = (cluster.root / "server.log").read_text(errors="replace")
    return [(m[1], m[2], m[3].split("+"), m[4]) for m in PLACED.finditer(text)]


def figure(record_property, name: str, seconds: float) -> None:
    record_property(name, f"{seconds:.2f}")
    print(f"FIGURE {name} = {seconds:.2f} s")


# --- the test ---------------------------------------------------------------------------------


def test_a_dead_worker_s_replica_is_rebuilt_on_the_fabric_that_can_hold_it(
        lab: Lab, cluster: Cluster, record_property):
    began = time.monotonic()
    # fab-a first: sim-a (no selector) can only go there; sim-b waits for a pool=b node.
    # Its agents start with the server and dial until it answers, as after a reboot.
    for node_id in ("node1", "node2"):
        add_node(cluster, lab, node_id)
    cluster.start_server()
    [a_before] = cluster.wait_ready("sim-a", timeout_s=30)
    assert fabrics_of(a_before) == {"fab-a"}, a_before
    assert cluster.ready_replicas("sim-b") == []
    [b_model] = [m for m in cluster.status()["models"] if m["name"] == "sim-b"]
    assert "does not match the selector pool=b" in (b_model["unplaced"] or ""), b_model

    for node_id in ("node3", "node4"):
        add_node(cluster, lab, node_id)
    [b_before] = cluster.wait_ready("sim-b", timeout_s=30)
    assert fabrics_of(b_before) == {"fab-b"}, b_before
    assert [r["id"] for r in cluster.replicas("sim-a")] == [a_before["id"]]
    setup_s = time.monotonic() - began

    # The server sees each node at its own address: the one its namespace routes from.
    nodes = {n["id"]: n for n in cluster.status()["nodes"]}
    assert {n: (nodes[n]["address"], nodes[n]["fabric"], nodes[n]["state"]) for n in FABRICS} \
        == {n: (node_of(lab, n).address, f, "ready") for n, f in FABRICS.items()}

    for replica in (a_before, b_before):
        check_only_the_leader_listens(cluster, lab, replica)
    assert ask(cluster, "sim-a") and ask(cluster, "sim-b")

    # The worker of sim-a dies with its node, as in a power cut: its link goes down, then
    # its agent and engines are killed (nothing they send on the way out gets through).
    leader, worker = by_rank(a_before)
    dead = worker["node"]
    assert FABRICS[dead] == "fab-a"
    engines = list(cluster.agents[dead].engine_pids().values())
    assert engines, "the worker's agent has no engine on record"
    killed_at = time.monotonic()
    lab.unplug(node_of(lab, dead))
    cluster.agents[dead].kill(group=True)
    for pid, started_at in engines:
        if process_alive(pid, started_at):
            os.kill(pid, signal.SIGKILL)

    seen: dict[str, set[str]] = {}  # every replica of sim-a seen, and its nodes' fabrics

    def rebuilt() -> dict | None:
        replicas = cluster.replicas("sim-a")
        for r in replicas:
            seen.setdefault(r["id"], set()).update(fabrics_of(r))
        ready = [r for r in replicas if r["state"] == "ready" and r["id"] != a_before["id"]]
        return ready[0] if ready else None

    a_after = wait_for(rebuilt, MOVE_DEADLINE_S, "sim-a to be ready again, elsewhere",
                       every_s=0.05)
    rebuilt_s = time.monotonic() - killed_at
    wait_for(lambda: cluster.node_state(dead) == "lost",
             MOVE_DEADLINE_S - (time.monotonic() - killed_at), f"{dead} to be lost")
    lost_s = time.monotonic() - killed_at

    # Rebuilt on fab-b, both shards; never one node per fabric, in any state, at any poll.
    assert fabrics_of(a_after) == {"fab-b"} and len(a_after["shards"]) == 2, a_after
    assert {s["node"] for s in a_after["shards"]} == {"node3", "node4"}
    assert a_after["epoch"] > a_before["epoch"]
    assert all(len(fabrics) == 1 for fabrics in seen.values()), seen
    for replica_id, model, placed_on, fabric in placements(cluster):
        assert {FABRICS[n] for n in placed_on} == {fabric}, (replica_id, model, placed_on)
    assert [r["id"] for r in cluster.replicas("sim-a")] == [a_after["id"]]
    server_log = (cluster.root / "server.log").read_text(errors="replace")
    # Moved off the lost node, not counted as a crash of the model.
    assert f"replica {a_before['id']} of sim-a is placed again: node " in server_log
    assert f"replica {a_before['id']} of sim-a failed" not in server_log

    # sim-b was not touched; both models answer; only the new leader listens.
    assert [(r["id"], r["state"]) for r in cluster.replicas("sim-b")] == [
        (b_before["id"], "ready")]
    check_only_the_leader_listens(cluster, lab, a_after)
    assert ask(cluster, "sim-a") and ask(cluster, "sim-b")
    # The dead node's namespace holds no process any more; the survivor of fab-a stopped
    # its half of the failed replica.
    assert lab.pids(node_of(lab, dead)) == []
    wait_for(lambda: cluster.agents[leader["node"]].shard_records() == [], 10,
             f"{leader['node']} to stop the leader of the failed replica")

    figure(record_property, "setup_to_two_ready_replicas_s", setup_s)
    figure(record_property, "worker_killed_to_replica_rebuilt_s", rebuilt_s)
    figure(record_property, "worker_killed_to_node_lost_s", lost_s)
    figure(record_property, "test_wall_s", time.monotonic() - began)
