"""The cluster over time: an agent dies, the server restarts, a partition heals, a node is
drained, a node is full. Real processes on loopback and the sim engine.

The Cluster's server runs with a heartbeat every 0.5 s, unreachable after 3 s of silence,
lost after 8 s (5 s in the tests that wait for a node to be lost), and a controller pass
every 0.5 s. Every deadline below is one of those plus slack for a busy two-core machine;
every wait polls (``wait_for``) until it holds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import openai

from tests.integration.cluster import Cluster, free_port_block, process_alive, wait_for
from tests.integration.load import ChatLoad

UNREACHABLE_AFTER_S = 3
# For the tests that wait for a node to be lost: still well past unreachable_after_s, so a
# busy node that misses a few heartbeats is unreachable for a moment, never lost.
LOST_AFTER_S = 5
SOON_LOST = {"nodes": {"heartbeat_interval_s": 0.5, "unreachable_after_s": UNREACHABLE_AFTER_S,
                       "lost_after_s": LOST_AFTER_S}}
# Several controller passes, a crash-loop backoff of 0.5 s and a sim engine's start, on a
# loaded machine.
SLACK_S = 17
MOVE_DEADLINE_S = LOST_AFTER_S + SLACK_S

SIM_A = {"name": "sim-a", "profiles": [{"engine": "sim"}], "replicas": 1}
SIM_B = {"name": "sim-b", "profiles": [{"engine": "sim"}], "replicas": 1}
NODES = ("node-a", "node-b")


# --- helpers ---------------------------------------------------------------------------------


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                         max_retries=0, timeout=10)


def ask(cluster: Cluster, model: str = "sim-a") -> str:
    reply = client(cluster).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "still there?"}], max_tokens=4)
    return reply.choices[0].message.content


def two_nodes(make_cluster, models: list[dict], **overrides) -> Cluster:
    cluster = make_cluster(models, **overrides)
    cluster.start_server()
    for node in NODES:
        cluster.add_agent(node)
    wait_for(lambda: all(cluster.node_state(n) == "ready" for n in NODES), 20,
             "both nodes to be ready")
    return cluster


def home(replica: dict) -> str:
    [shard] = replica["shards"]
    return shard["node"]


def other(node: str) -> str:
    [rest] = [n for n in NODES if n != node]
    return rest


def engine_of(cluster: Cluster, replica_id: str) -> tuple[int, float]:
    """The (pid, start time) of a single-shard replica's engine, from its agent's records."""
    found = [(r["pid"], r["started_at"]) for agent in cluster.agents.values()
             for r in agent.shard_records() if r.get("replica") == replica_id]
    assert len(found) == 1, (replica_id, found)
    return found[0]


def all_engines(cluster: Cluster) -> dict[str, dict[str, tuple[int, float]]]:
    return {node: agent.engine_pids() for node, agent in sorted(cluster.agents.items())}


def server_log(cluster: Cluster) -> str:
    return (cluster.root / "server.log").read_text(errors="replace")


def figure(record_property, name: str, seconds: float) -> None:
    record_property(name, f"{seconds:.2f}")
    print(f"FIGURE {name} = {seconds:.2f} s")


class Traffic:
    """Chat completions one after another on a thread, each outcome kept with the time its
    request was sent: "ok", "connection" (nothing listening), or the HTTP status and code."""

    def __init__(self, cluster: Cluster, model: str = "sim-a"):
        self.cluster = cluster
        self.model = model
        self.results: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(20)

    def _run(self) -> None:
        c = client(self.cluster)
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                c.chat.completions.create(
                    model=self.model, max_tokens=3,
                    messages=[{"role": "user", "content": "anyone?"}])
                outcome = "ok"
            except openai.APITimeoutError:
                outcome = "timeout"
            except openai.APIConnectionError:
                outcome = "connection"
            except openai.APIStatusError as err:
                code = (err.body or {}).get("code") if isinstance(err.body, dict) else None
                outcome = f"{err.status_code} {code}"
            self.results.append((sent, outcome))
            self._stop.wait(0.05)  # pacing, so two cores are left for the cluster

    def served_since(self, since: float, count: int = 1) -> float | None:
        """When the ``count``-th request sent at or after ``since`` that was answered
        went out, or None."""
        oks = [t for t, outcome in list(self.results) if t >= since and outcome == "ok"]
        return oks[count - 1] if len(oks) >= count else None

    def failures(self, start: float = 0.0, end: float = float("inf")) -> list[tuple[float, str]]:
        return [(t, o) for t, o in list(self.results) if start <= t < end and o != "ok"]


# --- 1. an agent dies --------------------------------------------------------------------------


def test_a_killed_agent_s_replica_moves_to_the_other_node(make_cluster, record_property):
    cluster = two_nodes(make_cluster, [SIM_A], **SOON_LOST)
    [before] = cluster.wait_ready("sim-a")
    x = home(before)
    y = other(x)
    assert ask(cluster)

    killed_at = time.monotonic()
    cluster.agents[x].kill()
    # Its stream drops with it, so the node is unreachable at once, and lost after 5 s.
    wait_for(lambda: cluster.node_state(x) == "unreachable", UNREACHABLE_AFTER_S + 7,
             f"{x} to be unreachable")
    wait_for(lambda: cluster.node_state(x) == "lost", MOVE_DEADLINE_S,
             f"{x} to be lost")
    lost_s = time.monotonic() - killed_at

    def moved() -> dict | None:
        on_y = [r for r in cluster.ready_replicas("sim-a") if home(r) == y]
        return on_y[0] if on_y else None

    after = wait_for(moved, MOVE_DEADLINE_S - (time.monotonic() - killed_at),
                     f"a replica of sim-a to be ready on {y}", every_s=0.05)
    move_s = time.monotonic() - killed_at
    assert move_s < MOVE_DEADLINE_S
    assert after["id"] != before["id"] and after["epoch"] > before["epoch"]
    # The lost node's replica was forgotten: one replica, the new one, placed again as a
    # move, not a crash: no crash-loop backoff before it.
    assert [r["id"] for r in cluster.replicas("sim-a")] == [after["id"]]
    log = server_log(cluster)
    assert f"replica {before['id']} of sim-a is placed again: node {x} is lost" in log
    assert "restarting after" not in log and f"replica {before['id']} of sim-a failed" not in log
    assert ask(cluster)

    figure(record_property, "agent_killed_to_node_lost_s", lost_s)
    figure(record_property, "agent_killed_to_replica_ready_elsewhere_s", move_s)


# --- 2. the server restarts --------------------------------------------------------------------


def test_a_restarted_server_adopts_every_shard_and_restarts_no_engine(make_cluster,
                                                                       record_property):
    # One node: the server cannot place anything before the node that runs it all is back
    # (see the next test for two).
    cluster = make_cluster([SIM_A, SIM_B])
    cluster.start_server()
    cluster.add_agent("node-a")
    cluster.wait_ready("sim-a")
    cluster.wait_ready("sim-b")
    ready_before = sorted(r["id"] for r in cluster.status()["replicas"] if r["state"] == "ready")
    engines_before = all_engines(cluster)
    assert len(engines_before["node-a"]) == 2, engines_before
    port, api_key, admin_token = cluster.port, cluster.api_key, cluster.admin_token
    config_before = (cluster.root / "server.yaml").read_text()
    log_before = len(server_log(cluster))

    with Traffic(cluster) as traffic:
        wait_for(lambda: traffic.served_since(0, 3), 15, "requests to be served before")
        stopping_at = time.monotonic()
        exit_status = cluster.stop_server()
        stopped_at = time.monotonic()
        cluster.start_server()
        back_at = time.monotonic()
        first_served = wait_for(lambda: traffic.served_since(back_at), 15,
                                "a request to be served after the restart", every_s=0.02)

        def all_adopted() -> bool:
            ready = [r["id"] for r in cluster.status()["replicas"] if r["state"] == "ready"]
            return sorted(ready) == ready_before

        wait_for(all_adopted, 15, f"replicas {ready_before} to be ready again")
        adopted_at = time.monotonic()
        wait_for(lambda: traffic.served_since(adopted_at, 5), 15, "requests to keep flowing")

    # The same server: port, state directory, store (the API key still works) and token.
    assert (cluster.port, cluster.api_key, cluster.admin_token) == (port, api_key, admin_token)
    assert (cluster.root / "server.yaml").read_text() == config_before
    # Zero engine restarts: the very same processes, all still running, and nothing new.
    assert all_engines(cluster) == engines_before
    for engines in engines_before.values():
        for pid, started_at in engines.values():
            assert process_alive(pid, started_at)
    # The replicas are listed, and routed to, from the store as soon as the server is back:
    # the agent may register again only after that (its reconnect backoff).
    cluster.server_log_line("registered", "with 2 running shard(s)")
    after = server_log(cluster)[log_before:]
    assert "placed on" not in after and "stopping replica" not in after

    # Served throughout, except while the server itself was down: before the stop every
    # request was answered; once it was back, only the moment until the agent had
    # re-registered saw "no ready replica" (a 503, never a 500); after that, all answered.
    assert traffic.failures(end=stopping_at) == []
    assert {o for _, o in traffic.failures(stopping_at, back_at)} <= {"connection",
                                                                      "503 no_ready_replica"}
    assert {o for _, o in traffic.failures(back_at, first_served)} <= {"503 no_ready_replica"}
    assert traffic.failures(start=first_served) == []

    # Not asserted (it fails now and then; see the report): the server should exit on
    # SIGTERM, status 0, in well under a second. -9 means it hung and was killed after 15 s.
    record_property("server_sigterm_exit_status", exit_status)
    assert exit_status == 0, "SIGTERM must stop the server by itself, not by SIGKILL"
    figure(record_property, "server_sigterm_to_exit_s", stopped_at - stopping_at)
    figure(record_property, "server_start_to_healthz_s", back_at - stopped_at)
    figure(record_property, "server_back_to_first_served_s", first_served - back_at)
    figure(record_property, "server_back_to_all_adopted_s", adopted_at - back_at)


def test_a_node_reconnecting_late_after_a_server_restart_keeps_its_replica(make_cluster,
                                                                           record_property):
    cluster = two_nodes(make_cluster, [SIM_A])
    [original] = cluster.wait_ready("sim-a")
    x = home(original)
    y = other(x)
    engine = engine_of(cluster, original["id"])
    late = cluster.agents[x]
    # x's agent dials back later than y's (an agent's reconnect backoff grows to 30 s by
    # default): hold it until y has registered and the controller has had time to act.
    late.pause()
    try:
        # Read before the restart: the new server may act before restart_server() returns.
        log_restart = len(server_log(cluster))
        cluster.restart_server()
        wait_for(lambda: cluster.node_state(y) == "ready", 10, f"{y} to register")
        placed: list[str] = []

        def duplicate_ready() -> bool:
            # The original is listed from the stored replica table at once; anything
            # else is a duplicate.
            replicas = [r for r in cluster.replicas("sim-a") if r["id"] != original["id"]]
            placed.extend(r["id"] for r in replicas if r["id"] not in placed)
            return any(r["state"] == "ready" for r in replicas)

        # Nothing of sim-a should be placed while x is away: wait_for failing after 3 s
        # (six passes) is the right outcome, and is suppressed. A duplicate ends the wait
        # as soon as it is ready, which is when it does the most harm.
        with contextlib.suppress(AssertionError):
            wait_for(duplicate_ready, 3, "a ready replica of sim-a before its node is back")
    finally:
        late.resume()
    wait_for(lambda: cluster.node_state(x) == "ready", 15, f"{x} to register again")

    def settled() -> dict | None:
        replicas = cluster.replicas("sim-a")
        if len(replicas) == 1 and replicas[0]["state"] == "ready":
            return replicas[0]
        return None

    survivor = wait_for(settled, 20, "exactly one ready replica of sim-a")
    wait_for(lambda: len(all_engines(cluster)[x]) + len(all_engines(cluster)[y]) == 1, 20,
             "one engine of sim-a left")
    after = server_log(cluster)[log_restart:]
    found = {
        "placed while x was away": placed,
        "survivor": survivor["id"],
        "original engine alive": process_alive(*engine),
        "engines on y": sorted(all_engines(cluster)[y]),
        "controller log": [line.split("controller: ", 1)[1]
                           for line in after.splitlines() if "controller: " in line],
    }
    record_property("late_node_findings", repr(found))
    assert placed == [] and "placed on" not in after, found
    assert survivor["id"] == original["id"] and process_alive(*engine), found
    assert cluster.agents[y].shard_records() == []


# --- 3. a partition heals ----------------------------------------------------------------------


def partition(cluster: Cluster) -> tuple[dict, str, str]:
    """SIGSTOP the agent of the node running sim-a until the node is lost and sim-a is
    ready on the other one; the agent is left stopped (the caller resumes it)."""
    [original] = cluster.wait_ready("sim-a")
    x = home(original)
    y = other(x)
    cluster.agents[x].pause()
    wait_for(lambda: cluster.node_state(x) == "lost", LOST_AFTER_S + SLACK_S,
             f"the silent {x} to be lost")
    return original, x, y


def test_a_healed_partition_leaves_exactly_one_copy(make_cluster, record_property):
    cluster = two_nodes(make_cluster, [SIM_A], **SOON_LOST)
    [original] = cluster.wait_ready("sim-a")
    engines = {original["id"]: engine_of(cluster, original["id"])}
    # Requests go on through the partition: to the original while its engine answers
    # the gateway's own check, then to the replacement (make before break).
    load = ChatLoad(cluster.base_url, cluster.api_key, "sim-a", {"plain": 1, "stream": 1})
    load.start()
    paused_at = time.monotonic()
    try:
        original, x, y = partition(cluster)

        def replaced() -> dict | None:
            on_y = [r for r in cluster.ready_replicas("sim-a") if home(r) == y]
            return on_y[0] if on_y else None

        replacement = wait_for(replaced, MOVE_DEADLINE_S - (time.monotonic() - paused_at),
                               f"a replacement to be ready on {y}")
        move_s = time.monotonic() - paused_at
        engines[replacement["id"]] = engine_of(cluster, replacement["id"])
        # Behind the partition the original engine runs on; only its agent is silent.
        assert process_alive(*engines[original["id"]])
    finally:
        for agent in cluster.agents.values():
            agent.resume()
    healed_at = time.monotonic()

    def one_copy() -> dict | None:
        replicas = cluster.replicas("sim-a")
        if len(replicas) == 1 and replicas[0]["state"] == "ready":
            return replicas[0]
        return None

    # It reconnects (or its stream is found dead and it redials) and registers again: the
    # agent reconnects within 1 s here, the server answers at once.
    wait_for(lambda: cluster.node_state(x) == "ready", 10, f"{x} to be ready again")
    figure(record_property, "heal_to_node_ready_s", time.monotonic() - healed_at)
    # The replica the lost node ran was replaced: it is the one stopped when it returns.
    survivor = wait_for(one_copy, 20, "exactly one ready replica of sim-a")
    assert survivor["id"] == replacement["id"]
    wait_for(lambda: not process_alive(*engines[original["id"]]), 20,
             f"the engine of the replaced {original['id']} to exit")
    one_copy_s = time.monotonic() - healed_at
    load.finish()
    assert process_alive(*engines[survivor["id"]])
    assert one_copy() and ask(cluster)
    failures = load.failures()
    assert failures == [], failures[:5]
    answered = load.answered_after(paused_at, healed_at)
    assert answered >= 20, f"only {answered} answers while the node was partitioned"
    record_property("answers_during_partition", answered)

    figure(record_property, "partition_to_replica_ready_elsewhere_s", move_s)
    figure(record_property, "heal_to_one_copy_and_engine_gone_s", one_copy_s)


# --- 4. a drain --------------------------------------------------------------------------------


def test_a_drained_node_hands_its_replica_over_before_stopping_it(make_cluster,
                                                                  record_property):
    cluster = two_nodes(make_cluster, [SIM_A])
    [original] = cluster.wait_ready("sim-a")
    x = home(original)
    y = other(x)
    original_engine = engine_of(cluster, original["id"])
    polls: list[tuple[float, list[dict]]] = []

    def moved() -> dict | None:
        replicas = cluster.replicas("sim-a")
        polls.append((time.monotonic(), replicas))
        ready_on_y = [r for r in replicas if r["state"] == "ready" and home(r) == y]
        if ready_on_y and all(r["id"] != original["id"] for r in replicas):
            return ready_on_y[0]
        return None

    with Traffic(cluster) as traffic:
        wait_for(lambda: traffic.served_since(0, 3), 15, "requests to be served before")
        drained_at = time.monotonic()
        reply = cluster.admin("POST", f"/api/nodes/{x}/drain")
        assert reply.status_code == 200, reply.text
        assert reply.json()["id"] == x
        # Not asserted: the reply carries the state of the last pass (see the report).
        record_property("drain_reply_state", reply.json()["state"])
        print(f"FIGURE drain_reply_state = {reply.json()['state']}")
        replacement = wait_for(moved, 25, f"sim-a to move to {y}", every_s=0.05)
        moved_at = time.monotonic()
        move_s = moved_at - drained_at
        wait_for(lambda: not process_alive(*original_engine), 20,
                 "the original's engine to exit")
        wait_for(lambda: traffic.served_since(moved_at, 3), 10, "requests after the move")

    # At every poll some replica was ready; the replacement was ready before the original
    # went away.
    assert polls and all(any(r["state"] == "ready" for r in replicas) for _, replicas in polls)
    first_gone = next(i for i, (_, replicas) in enumerate(polls)
                      if all(r["id"] != original["id"] for r in replicas))
    assert any(r["id"] == replacement["id"] and r["state"] == "ready"
               for r in polls[first_gone][1])
    assert traffic.failures() == [], "a drain must not fail a request"

    nodes = {n["id"]: n for n in cluster.admin("GET", "/api/nodes").json()}
    assert nodes[x]["state"] == "draining" and nodes[x]["replicas"] == []
    assert nodes[y]["replicas"] == [replacement["id"]]
    assert f"replica {replacement['id']} of sim-a: placed on {y}" in server_log(cluster)

    reply = cluster.admin("POST", f"/api/nodes/{x}/undrain")
    assert reply.status_code == 200, reply.text
    wait_for(lambda: cluster.node_state(x) == "ready", 10, f"{x} to be ready after undrain")
    assert [(r["id"], r["state"]) for r in cluster.replicas("sim-a")] == [
        (replacement["id"], "ready")]
    reply = cluster.admin("POST", "/api/nodes/no-such-node/drain")
    assert reply.status_code == 404

    figure(record_property, "drain_to_replica_moved_s", move_s)


# --- 5. priorities on a full node --------------------------------------------------------------

SIM_LOW = {"name": "sim-low", "profiles": [{"engine": "sim"}], "replicas": 2, "priority": 0}
SIM_HIGH = {"name": "sim-high", "profiles": [{"engine": "sim"}], "replicas": 1,
            "priority": 10}


def one_full_node(make_cluster, models: list[dict]) -> tuple[Cluster, tuple[int, int]]:
    """One node with two ports in its range: a sim shard takes one, so two shards fit."""
    cluster = make_cluster(models)
    cluster.start_server()
    low, _ = free_port_block(2)
    ports = (low, low + 1)
    cluster.add_agent("node-a", port_range=list(ports))
    return cluster, ports


def model_status(cluster: Cluster, name: str) -> dict:
    return next(m for m in cluster.status()["models"] if m["name"] == name)


def controller_passes(cluster: Cluster) -> float:
    """How many passes the controller made, from /metrics."""
    for line in cluster.admin("GET", "/metrics").text.splitlines():
        if line.startswith("llmgw_controller_pass_seconds_count"):
            return float(line.split()[-1])
    raise AssertionError("/metrics has no llmgw_controller_pass_seconds_count")


def test_on_a_full_node_the_higher_priority_model_gets_the_room(make_cluster):
    cluster, (low, high) = one_full_node(make_cluster, [SIM_LOW, SIM_HIGH])
    cluster.wait_ready("sim-high")
    cluster.wait_ready("sim-low", 1)

    def settled() -> dict | None:
        status = model_status(cluster, "sim-low")
        return status if status["unplaced"] else None

    status = wait_for(settled, 10, "sim-low to say why it is short of a replica")
    assert status["replicas_ready"] == 1 and status["replicas_wanted"] == 2
    assert status["unplaced"] == f"node-a: no free port left in {low}-{high}"
    assert model_status(cluster, "sim-high")["unplaced"] is None
    assert len(cluster.replicas("sim-low")) == 1 and len(cluster.replicas("sim-high")) == 1
    assert ask(cluster, "sim-high") and ask(cluster, "sim-low")

    # The high engine crashes: its room stays its own. While it waits out its backoff,
    # sim-low (still short of a replica) must not take the freed port, or sim-high would
    # have to evict it again.
    [before] = cluster.replicas("sim-high")
    log_before = len(server_log(cluster))
    os.kill(engine_of(cluster, before["id"])[0], signal.SIGKILL)

    def back() -> dict | None:
        high_ready = [r for r in cluster.ready_replicas("sim-high") if r["id"] != before["id"]]
        return high_ready[0] if high_ready else None

    wait_for(back, 20, "sim-high to be ready again")
    after = server_log(cluster)[log_before:]
    assert f"replica {before['id']} of sim-high failed" in after
    assert "of sim-low: placed on" not in after and "preempting" not in after
    status = wait_for(settled, 10, "sim-low to say why it is short of a replica")
    assert status["unplaced"] == f"node-a: no free port left in {low}-{high}"
    assert [r["state"] for r in cluster.replicas("sim-low")] == ["ready"]
    assert ask(cluster, "sim-high") and ask(cluster, "sim-low")


def test_a_higher_priority_model_added_to_a_full_node_evicts_one_lower_replica(
        make_cluster, record_property):
    cluster, (low, high) = one_full_node(make_cluster, [SIM_LOW])
    lows = cluster.wait_ready("sim-low", 2)
    engines = {r["id"]: engine_of(cluster, r["id"]) for r in lows}
    # Engines take time to stop (a large one frees its GPUs in seconds). Freeze both low
    # engines, so that the victim's stop hangs: while it lasts, its port is held and the
    # controller makes several passes.
    for pid, _ in engines.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        # An operator declares a more important model and restarts the server: the two
        # low replicas are adopted, one is evicted, and the high one takes its port.
        cluster.models = [SIM_LOW, SIM_HIGH]
        # Read before the restart: the new server's first pass may evict before
        # restart_server() returns.
        log_restart = len(server_log(cluster))
        cluster.restart_server()
        line = cluster.server_log_line("preempting replica")
        victim = line.split("preempting replica ", 1)[1].split()[0]
        assert victim in engines, line
        # Six passes with the victim stopping and sim-high still short of its port, then
        # the victim is let go: it exits on the SIGTERM it was sent (the agent's SIGKILL
        # after 10 s, for an engine that ignores SIGTERM, is the runtime contract's test).
        passes = controller_passes(cluster)
        wait_for(lambda: controller_passes(cluster) >= passes + 6, 20,
                 "six controller passes while the victim stops")
        os.kill(engines[victim][0], signal.SIGCONT)
        [winner] = cluster.wait_ready("sim-high", timeout_s=40)
        assert winner["shards"][0]["port"] in (low, high)
    finally:
        for pid, started_at in engines.values():
            if process_alive(pid, started_at):
                os.kill(pid, signal.SIGCONT)

    def settled() -> dict | None:
        status = model_status(cluster, "sim-low")
        replicas = cluster.replicas("sim-low")
        ready = len(replicas) == 1 and replicas[0]["state"] == "ready"
        return status if status["unplaced"] and ready else None

    status = wait_for(settled, 30, "sim-low to be down to one ready replica, saying why")
    assert status["unplaced"] == f"node-a: no free port left in {low}-{high}"
    [kept] = cluster.replicas("sim-low")
    evictions = [line.split("controller: ", 1)[1]
                 for line in server_log(cluster)[log_restart:].splitlines()
                 if "preempting replica" in line]
    record_property("evictions", repr(evictions))
    assert evictions and all("evicted for sim-high (priority 10 over 0)" in e
                             for e in evictions)
    # One replica of sim-low made room: the other kept serving throughout, never restarted.
    assert len(evictions) == 1 and kept["id"] in engines, (evictions, kept["id"])
    assert process_alive(*engines[kept["id"]])
    assert ask(cluster, "sim-high") and ask(cluster, "sim-low")
