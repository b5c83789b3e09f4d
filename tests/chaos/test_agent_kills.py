"""An agent killed with SIGKILL ten times while chat requests flow through the gateway:
its engine is never restarted and no request fails. A real server, agent and sim engine on
loopback; the agent is started again after each kill, as systemd would."""

from __future__ import annotations

import time

from tests.chaos.measure import figure
from tests.integration.cluster import process_alive, wait_for
from tests.integration.load import ChatLoad

KILLS = 10


def test_ten_agent_kills_under_load_restart_no_engine_and_fail_no_request(make_cluster,
                                                                          record_property):
    c = make_cluster()
    c.start_server()
    agent = c.add_agent("node-a")
    [replica] = c.wait_ready("sim-small")
    engines = agent.engine_pids()
    assert len(engines) == 1, engines
    log_before = len((c.root / "server.log").read_text())

    load = ChatLoad(c.base_url, c.api_key, "sim-small", {"plain": 1, "stream": 1},
                    max_requests=3000, max_s=150)
    load.start()
    began = time.monotonic()
    back_s = []
    try:
        wait_for(lambda: load.answered_after(began) >= 3, 15, "requests to be answered")
        for round_ in range(KILLS):
            agent.kill()
            killed_at = time.monotonic()
            # While its agent is away the engine answers on.
            wait_for(lambda t=killed_at: load.answered_after(t) >= 3, 15,
                     f"answers with the agent down (kill {round_ + 1})")
            agent.start()
            wait_for(lambda n=round_ + 2: agent.log.read_text().count("registered with") == n,
                     20, f"the agent to register again (kill {round_ + 1})")
            wait_for(lambda: [r["id"] for r in c.ready_replicas("sim-small")] == [replica["id"]],
                     15, f"{replica['id']} to be ready again (kill {round_ + 1})")
            back_s.append(time.monotonic() - killed_at)
        after = time.monotonic()
        wait_for(lambda: load.answered_after(after) >= 3, 15, "answers after the last kill")
    finally:
        load.finish()

    failures = load.failures()
    now_running = agent.engine_pids()
    restarts = len(set(now_running.values()) - set(engines.values()))
    figure(record_property, "agent_kills", KILLS)
    figure(record_property, "engine_restarts", restarts)
    figure(record_property, "requests_answered", load.answered_after(began))
    figure(record_property, "requests_failed", len(failures))
    figure(record_property, "kill_to_replica_ready_again_mean_s", sum(back_s) / len(back_s), "s")
    figure(record_property, "kill_to_replica_ready_again_max_s", max(back_s), "s")

    # A re-registering agent reports its adopted shard "starting" until its first health
    # check of the engine answers: the ready replica stays routed meanwhile.
    assert failures == [], f"{len(failures)} failed: {failures[:5]}"
    # The same engine process throughout: adopted ten times, never started again.
    assert restarts == 0 and now_running == engines, (engines, now_running)
    assert all(process_alive(pid, started) for pid, started in engines.values())
    assert agent.log.read_text().count("adopting llmgw-shard-") == KILLS
    server_log = (c.root / "server.log").read_text()[log_before:]
    assert "placed on" not in server_log and "of sim-small failed" not in server_log
    assert [r["id"] for r in c.replicas("sim-small")] == [replica["id"]]
