"""A node cut off from the control plane, and the cut healed, twice: first only its control
path (its agent's stream; its engine still answers the gateway), then its whole link. Two
nodes in network namespaces on a bridge (tests/integration/netns.py), one replica of a sim
model, chat requests flowing throughout.

The server listens on a second address of the bridge, the *control address*; the gateway's
own connections to engines leave from the bridge's first one. So a node can be cut from
the control plane alone: in its namespace a blackhole route to the control address drops
what the agent sends, and strict reverse-path filtering drops what the server sends it,
while the gateway and the engine go on talking. The whole link is cut by taking the node's
veth down. (netem is not in every kernel that runs these tests; a route and a link are.)

The server runs with a heartbeat every 0.5 s, unreachable after 3 s of silence, lost after
5 s, a controller pass every 0.5 s, and short gateway timeouts (connect 1 s, first byte and
idle 5 s) so that a request caught by the cut link fails within seconds, not minutes.
"""

from __future__ import annotations

import re
import subprocess
import time

import openai
import pytest

from tests.chaos.measure import figure, timed_lines
from tests.integration.cluster import Cluster, process_alive, wait_for
from tests.integration.load import ChatLoad
from tests.integration.netns import Lab, Node, ip, lab_for_test

LOST_AFTER_S = 5
# Still well past unreachable_after_s: a busy node that misses heartbeats for a moment is
# unreachable, never lost.
NODES = {"heartbeat_interval_s": 0.5, "unreachable_after_s": 3, "lost_after_s": LOST_AFTER_S}
# Controller passes, the gateway's probe and a sim engine's start, on a loaded machine.
SLACK_S = 12
HEAL_S = 60  # the bound: one copy per replica within a minute of the heal
SIM_A = {"name": "sim-a", "replicas": 1, "profiles": [{"engine": "sim"}]}
GATEWAY = {"connect_timeout_s": 1, "first_byte_timeout_s": 5, "idle_timeout_s": 5}
STARTED = re.compile(r"started llmgw-shard-(\S+)-e(\d+)-\d+ \(pid")


@pytest.fixture
def lab():
    with lab_for_test(2) as made:
        yield made


@pytest.fixture
def cluster(lab: Lab, make_cluster) -> Cluster:
    """Asked for after ``lab``, so its processes are stopped before the network goes. The
    control address goes with the bridge."""
    assert lab.subnet is not None
    control = str(lab.subnet.network_address + 254)
    ip("addr", "add", f"{control}/{lab.subnet.prefixlen}", "dev", lab.bridge)
    made = make_cluster([SIM_A], gateway=GATEWAY, nodes=NODES)
    made.listen_host = control
    return made


# --- the cuts ---------------------------------------------------------------------------------


def cut_control(cluster: Cluster, node: Node) -> None:
    ip("-n", node.namespace, "route", "add", "blackhole", f"{cluster.listen_host}/32")
    subprocess.run([*node.exec_prefix, "sh", "-c",
                    "echo 1 > /proc/sys/net/ipv4/conf/all/rp_filter && "
                    "echo 1 > /proc/sys/net/ipv4/conf/eth0/rp_filter"], check=True, timeout=20)


def heal_control(cluster: Cluster, node: Node) -> None:
    ip("-n", node.namespace, "route", "del", "blackhole", f"{cluster.listen_host}/32")


def plug(node: Node) -> None:
    ip("link", "set", node.veth, "up")


# --- helpers ----------------------------------------------------------------------------------


def node_id(node: Node) -> str:
    return f"node{node.index}"


def home(replica: dict) -> str:
    [shard] = replica["shards"]
    return shard["node"]


def engine_of(cluster: Cluster, replica_id: str) -> tuple[int, float]:
    [found] = [(r["pid"], r["started_at"]) for agent in cluster.agents.values()
               for r in agent.shard_records() if r.get("replica") == replica_id]
    return found


def ask(cluster: Cluster) -> str:
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                           max_retries=0, timeout=10)
    reply = client.chat.completions.create(
        model="sim-a", max_tokens=4, messages=[{"role": "user", "content": "who serves?"}])
    return reply.choices[0].message.content


def replaced(cluster: Cluster, old: dict, on: str) -> dict | None:
    ready = [r for r in cluster.ready_replicas("sim-a") if r["id"] != old["id"]
             and home(r) == on]
    return ready[0] if ready else None


def one_copy(cluster: Cluster, survivor: dict, gone: tuple[int, float]) -> bool:
    """Exactly one replica of sim-a, the survivor, ready; one engine on record, its own;
    the engine of the copy it replaced exited."""
    replicas = cluster.replicas("sim-a")
    records = [r for agent in cluster.agents.values() for r in agent.shard_records()]
    return ([(r["id"], r["state"]) for r in replicas] == [(survivor["id"], "ready")]
            and [r["replica"] for r in records] == [survivor["id"]]
            and not process_alive(*gone))


def starts(cluster: Cluster) -> list[tuple[float, str, int]]:
    """(time, node, epoch) of every shard an agent started, in the order they started."""
    found = []
    for node, agent in cluster.agents.items():
        for t, line in timed_lines(agent.log, "started llmgw-shard-"):
            match = STARTED.search(line)
            assert match, line
            found.append((t, node, int(match[2])))
    return sorted(found)


def check_nothing_stale(cluster: Cluster, healed: str, healed_at_wall: float,
                        survivor: dict, replaced_id: str) -> None:
    """No command from an older epoch was acted on: every shard started has a newer
    epoch than every one started before it; the healed node started nothing after the
    heal, and stopped only the copy that was replaced; every shard on record is of the
    surviving replica's epoch. No command came from an older leader's term (one server
    leads here, in one term, so none is refused either)."""
    epochs = [epoch for _, _, epoch in starts(cluster)]
    assert epochs == sorted(set(epochs)), starts(cluster)
    assert [s for s in starts(cluster) if s[1] == healed and s[0] >= healed_at_wall] == []
    stops = [line for t, line in timed_lines(cluster.agents[healed].log, "stopping llmgw-shard-")
             if t >= healed_at_wall]
    assert stops and all(f"llmgw-shard-{replaced_id}-0 (epoch " in s
                         and s.endswith("): replaced while its node was lost")
                         for s in stops), stops
    for agent in cluster.agents.values():
        assert {r["epoch"] for r in agent.shard_records()} <= {survivor["epoch"]}
        text = agent.log.read_text()
        assert "sent in term" not in text
        # Welcomes, starts and stops all name the one term.
        assert len(set(re.findall(r"leader's term (\d+)", text))) == 1, text[-2000:]


# --- the test ---------------------------------------------------------------------------------


def test_a_partitioned_node_is_replaced_in_time_and_healing_leaves_one_copy(
        lab: Lab, cluster: Cluster, record_property):
    began = time.monotonic()
    cluster.start_server()
    for node in lab.nodes:
        cluster.add_agent(node_id(node), prefix=node.exec_prefix, address=None)
    wait_for(lambda: all(cluster.node_state(node_id(n)) == "ready" for n in lab.nodes), 30,
             "both nodes to be ready")
    [first] = cluster.wait_ready("sim-a")
    x = home(first)
    [y] = [node_id(n) for n in lab.nodes if node_id(n) != x]
    node_x, node_y = (next(n for n in lab.nodes if node_id(n) == i) for i in (x, y))
    first_engine = engine_of(cluster, first["id"])
    figure(record_property, "setup_s", time.monotonic() - began, "s")

    # 1. The control path of x is cut; its engine answers the gateway all along. --------------
    load = ChatLoad(cluster.base_url, cluster.api_key, "sim-a", {"plain": 1, "stream": 1},
                    max_requests=3000, max_s=90)
    load.start()
    try:
        wait_for(lambda: load.answered_after(0) >= 3, 15, "requests to be answered")
        cut_at = time.monotonic()
        cut_control(cluster, node_x)
        wait_for(lambda: cluster.node_state(x) == "lost", LOST_AFTER_S + SLACK_S,
                 f"{x} to be lost")
        lost_s = time.monotonic() - cut_at
        second = wait_for(lambda: replaced(cluster, first, y),
                          LOST_AFTER_S + SLACK_S - (time.monotonic() - cut_at),
                          f"a replacement to be ready on {y}")
        moved_s = time.monotonic() - cut_at
        # Behind the cut the first engine still runs, and was routed to until the
        # replacement served.
        assert process_alive(*first_engine)
        second_engine = engine_of(cluster, second["id"])
        healed_at, healed_wall = time.monotonic(), time.time()
        heal_control(cluster, node_x)
        wait_for(lambda: one_copy(cluster, second, first_engine), HEAL_S,
                 "one copy of sim-a after the heal")
        one_copy_s = time.monotonic() - healed_at
        wait_for(lambda: cluster.node_state(x) == "ready", 15, f"{x} to be ready again")
        done = time.monotonic()
        wait_for(lambda: load.answered_after(done) >= 3, 15, "answers after the heal")
    finally:
        load.finish()
    failures = load.failures()
    figure(record_property, "control_cut_to_node_lost_s", lost_s, "s")
    figure(record_property, "control_cut_to_replacement_ready_s", moved_s, "s")
    figure(record_property, "control_heal_to_one_copy_s", one_copy_s, "s")
    figure(record_property, "control_cut_requests_answered", load.answered_after(cut_at, done))
    figure(record_property, "control_cut_requests_failed", len(failures))
    assert LOST_AFTER_S - 1 <= lost_s <= LOST_AFTER_S + SLACK_S
    assert failures == [], f"{len(failures)} failed: {failures[:5]}"
    assert load.answered_after(cut_at, healed_at) >= 20
    check_nothing_stale(cluster, x, healed_wall, second, first["id"])
    assert f"stopping {first['id']} on {x}: replaced while its node was lost" in \
        (cluster.root / "server.log").read_text()

    # 2. The whole link of y, which now serves, goes down. ------------------------------------
    load = ChatLoad(cluster.base_url, cluster.api_key, "sim-a", {"plain": 1, "stream": 1},
                    max_requests=3000, max_s=90)
    load.start()
    try:
        wait_for(lambda: load.answered_after(0) >= 3, 15, "requests to be answered")
        down_at = time.monotonic()
        lab.unplug(node_y)
        wait_for(lambda: cluster.node_state(y) == "lost", LOST_AFTER_S + SLACK_S,
                 f"{y} to be lost")
        lost_s = time.monotonic() - down_at
        third = wait_for(lambda: replaced(cluster, second, x),
                         LOST_AFTER_S + SLACK_S - (time.monotonic() - down_at),
                         f"a replacement to be ready on {x}")
        ready_at = time.monotonic()
        # The engine behind the cut runs on; nothing reaches it.
        assert process_alive(*second_engine)
        healed_at, healed_wall = time.monotonic(), time.time()
        plug(node_y)
        wait_for(lambda: one_copy(cluster, third, second_engine), HEAL_S,
                 "one copy of sim-a after the link is back")
        one_copy_s = time.monotonic() - healed_at
        wait_for(lambda: cluster.node_state(y) == "ready", 15, f"{y} to be ready again")
        done = time.monotonic()
        wait_for(lambda: load.answered_after(done) >= 3, 15, "answers after the heal")
    finally:
        load.finish()
    # While the only ready replica's engine cannot be reached, requests fail: those in
    # flight at the cut wait out the gateway's 5 s timeouts (504, or a stream's error
    # event); then, the node being unreachable and the engine not answering the gateway's
    # check, 503 until the replacement serves. Measured and shown; none may fail outside
    # that window.
    failed = [(began_, end, outcome) for _, began_, end, outcome in load.done
              if outcome != "ok"]
    kinds = sorted({type(o).__name__ + (f" {o.status_code}" if hasattr(o, "status_code")
                                        else "") for _, _, o in failed})
    figure(record_property, "link_down_to_node_lost_s", lost_s, "s")
    figure(record_property, "link_down_to_replacement_ready_s", ready_at - down_at, "s")
    figure(record_property, "link_heal_to_one_copy_s", one_copy_s, "s")
    figure(record_property, "link_down_requests_answered", load.answered_after(down_at, done))
    figure(record_property, "link_down_requests_failed", len(failed))
    figure(record_property, "link_down_failure_kinds", ", ".join(kinds) or "none")
    if failed:
        figure(record_property, "link_down_failures_from_s", min(b for b, _, _ in failed)
               - down_at, "s")
        figure(record_property, "link_down_failures_until_s", max(e for _, e, _ in failed)
               - down_at, "s")
    assert LOST_AFTER_S - 1 <= lost_s <= LOST_AFTER_S + SLACK_S
    # Each failed request was in flight at the cut or sent after it, and sent before the
    # replacement was ready.
    assert all(down_at <= e and b <= ready_at for b, e, _ in failed), \
        [(round(b - down_at, 2), round(e - down_at, 2), repr(o)) for b, e, o in failed][:10]
    assert load.answered_after(ready_at) >= 3
    check_nothing_stale(cluster, y, healed_wall, third, second["id"])
    assert ask(cluster)
    figure(record_property, "test_wall_s", time.monotonic() - began, "s")
