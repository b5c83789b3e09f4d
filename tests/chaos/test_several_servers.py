"""Several servers on one PostgreSQL: one leads, every one serves.

Real server processes, a real agent given both servers' addresses, the sim engine and the
real PostgreSQL. One server takes the leader's lease and runs the controller; the other
follows the leader's replica table and routes by it. When the leader is paused (SIGSTOP),
the other takes the lead once the lease runs out, the agent leaves the silent server for
it, and the engine is adopted, not restarted; the follower's /v1 answers all along. When
the old leader is let go on (SIGCONT), it sees the lease is gone and follows.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.integration.cluster import Cluster, wait_for
from tests.integration.load import ChatLoad

MODEL = "sim-small"
LEASE_S = 4.0
CONTROLLER = {"interval_s": 0.5, "restart_backoff_initial_s": 0.5, "restart_backoff_max_s": 2,
              "adoption_grace_s": 5, "lease_s": LEASE_S, "follow_interval_s": 0.5}


def _health(c: Cluster) -> dict:
    return httpx.get(f"{c.base_url}/healthz", timeout=2).json()


@pytest.fixture
def two_servers(make_cluster, postgres_database):
    # Each server with its own admin token (in its state directory).
    settings = {"store": {"url": postgres_database}, "controller": CONTROLLER}
    first, second = make_cluster(**settings), make_cluster(**settings)
    first.start_server()
    wait_for(lambda: _health(first)["leader"], 10, "the first server to lead")
    second.start_server()
    return first, second


def _client(c: Cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=key, max_retries=0, timeout=10)


def _chat(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "who leads?"}])
    return reply.choices[0].message.content


def test_one_server_leads_and_both_route_to_what_it_placed(two_servers):
    first, second = two_servers
    lead, follow = _health(first), _health(second)
    assert lead["leader"] and lead["server"] == f"127.0.0.1:{first.port}"
    assert not follow["leader"] and follow["leader_name"] == lead["server"]

    # The agent knows both; whichever it dials first, it registers with the leader.
    agent = first.add_agent("node-a", servers=[second.base_url, first.base_url])
    [replica] = first.wait_ready(MODEL)
    assert "does not lead the cluster" in agent.log.read_text()
    followed = wait_for(lambda: second.ready_replicas(MODEL), 5,
                        "the follower to read the leader's replica table")
    assert [r["id"] for r in followed] == [replica["id"]]

    # Scaled through the follower: the leader reads the change from the store. How long a
    # change takes to reach the follower's routing: from when the leader has the second
    # replica ready to when the follower routes to it.
    scaled = second.admin("PATCH", f"/api/models/{MODEL}", json={"replicas": 2})
    assert scaled.status_code == 200, scaled.text
    ready_on_leader = wait_for(lambda: len(first.ready_replicas(MODEL)) == 2
                               and time.monotonic(), 20, "a second replica on the leader",
                               every_s=0.02)
    wait_for(lambda: len(second.ready_replicas(MODEL)) == 2, 5,
             "the follower to route to the second replica", every_s=0.02)
    print(f"FIGURE follower_routing_delay = {time.monotonic() - ready_on_leader:.2f} s "
          f"(follow_interval_s {CONTROLLER['follow_interval_s']})")
    node = wait_for(lambda: next((n for n in second.status()["nodes"]
                                  if n["id"] == "node-a"), None), 5,
                    "the follower to show node-a as the leader recorded it")
    assert node["state"] == "ready"

    key = first.admin("POST", "/api/keys", json={"name": "both"}).json()["key"]
    assert _chat(_client(first, key)) and _chat(_client(second, key))

    status = second.status()
    assert status["answered_by"] == follow["server"]
    assert status["leader"]["name"] == lead["server"] and status["leader"]["term"] >= 1
    servers = {s["name"]: s for s in status["servers"]}
    assert set(servers) == {lead["server"], follow["server"]}
    assert servers[lead["server"]]["leader"] and not servers[follow["server"]]["leader"]
    assert all(s["up"] for s in servers.values())


def test_a_paused_leader_is_followed_and_nothing_fails_on_the_follower(two_servers):
    first, second = two_servers
    agent = first.add_agent("node-a", servers=[first.base_url, second.base_url])
    [replica] = first.wait_ready(MODEL)
    engine = agent.engine_pids()
    wait_for(lambda: second.ready_replicas(MODEL), 5, "the follower to route to the replica")
    key = first.admin("POST", "/api/keys", json={"name": "load"}).json()["key"]
    old_term = first.status()["leader"]["term"]

    # Bounded load on the follower for the whole takeover.
    load = ChatLoad(second.base_url, key, MODEL, {"plain": 1, "stream": 1})
    load.start()
    try:
        paused_at = time.monotonic()
        first.server.send_signal(19)  # SIGSTOP: the process only, its socket stays open
        try:
            wait_for(lambda: _health(second)["leader"], 17, "the follower to take the lead")
            took_over_s = time.monotonic() - paused_at
            wait_for(lambda: any(n["id"] == "node-a" and n["state"] == "ready"
                                 for n in second.status()["nodes"]), 25,
                     "node-a to register with the new leader")
            moved_s = time.monotonic() - paused_at
            assert [r["id"] for r in second.ready_replicas(MODEL)] == [replica["id"]]
        finally:
            first.server.send_signal(18)  # SIGCONT
        wait_for(lambda: not _health(first)["leader"], 10, "the old leader to step down")
        stepped_down = time.monotonic()
        wait_for(lambda: load.answered_after(stepped_down) >= 20, 10,
                 "more answers after the takeover")
    finally:
        load.finish()

    failures = load.failures()
    print(f"took the lead after {took_over_s:.1f} s, node moved after {moved_s:.1f} s, "
          f"{len(load.done)} requests, {len(failures)} failed")
    assert failures == [], failures[:3]
    assert agent.engine_pids() == engine  # adopted by the new leader, not restarted
    lead = second.status()["leader"]
    assert lead["name"] == _health(second)["server"] and lead["term"] > old_term
    assert "another server took the lead" in (first.root / "server.log").read_text()
    # Nothing of the old term was applied on the node after the new leader welcomed it.
    assert "refusing to start" not in agent.log.read_text()
    assert [r["id"] for r in first.ready_replicas(MODEL)] == [replica["id"]]
