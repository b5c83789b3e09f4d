"""Sidecars: helper processes a profile declares start before its engine, the engine
waits for them, and they live and die with it. Real agents, real processes."""

from __future__ import annotations

import os
import signal
import socket
import sys

import psutil

from tests.integration.cluster import free_port, process_alive, wait_for


def _model(port: int, **sidecar) -> dict:
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return {"name": "sim-sc", "replicas": 1, "profiles": [{
        "engine": "sim", "sidecars": [{"name": "helper", "command": command, "port": port,
                                        "startup_timeout_s": 20, **sidecar}]}]}


def _records(agent) -> tuple[dict, dict]:
    records = agent.shard_records()
    [engine] = [r for r in records if not r.get("sidecar_of")]
    [sidecar] = [r for r in records if r.get("sidecar_of")]
    return engine, sidecar


def test_the_engine_starts_after_its_sidecar_answers_and_both_stop_together(make_cluster):
    port = free_port()
    c = make_cluster(models=[_model(port)])
    c.start_server()
    agent = c.add_agent("node-a")
    [replica] = c.wait_ready("sim-sc")

    engine, sidecar = _records(agent)
    assert sidecar["sidecar_of"] == engine["unit"] == f"llmgw-shard-{replica['id']}-0"
    assert sidecar["unit"] == engine["unit"] + "-helper" and sidecar["port"] == port
    # Started first, and serving before the engine was launched.
    assert sidecar["started_at"] <= engine["started_at"]
    assert psutil.Process(sidecar["pid"]).environ().get("CUDA_VISIBLE_DEVICES") == ""

    # The agent crashes and comes back: engine and sidecar are adopted, not restarted.
    agent.kill()
    agent.start()
    wait_for(lambda: c.node_state("node-a") == "ready", 15, "node-a back")
    assert c.ready_replicas("sim-sc")[0]["id"] == replica["id"]
    assert process_alive(sidecar["pid"], sidecar["started_at"])

    # The sidecar dies: the shard fails with that reason and the replica is rebuilt.
    os.kill(sidecar["pid"], signal.SIGKILL)
    failed = wait_for(lambda: "sidecar helper exited" in (c.root / "server.log").read_text(),
                      20, "the sidecar's exit to fail the shard")
    assert failed
    wait_for(lambda: not process_alive(engine["pid"], engine["started_at"]), 15,
             "the engine to be stopped with its sidecar gone")
    [again] = c.wait_ready("sim-sc", timeout_s=30)
    assert again["id"] != replica["id"]
    _, new_sidecar = wait_for(lambda: len(agent.shard_records()) == 2
                                       and _records(agent), 10, "the new shard's records")
    assert new_sidecar["pid"] != sidecar["pid"]


def test_a_sidecar_that_never_answers_fails_the_shard_before_the_engine_starts(make_cluster):
    port = free_port()
    c = make_cluster(models=[_model(port, command=[sys.executable, "-c",
                                                   "import time; time.sleep(60)"],
                                    startup_timeout_s=1.5)])
    c.start_server()
    agent = c.add_agent("node-a")
    line = c.server_log_line("sidecar helper did not accept")
    assert f"127.0.0.1:{port} within 1.5 s" in line
    # No engine was launched for it, and the sidecar was stopped.
    assert "llmgw.sim" not in (agent.log.read_text())
    wait_for(lambda: agent.shard_records() == [], 10, "the sidecar's record to go")


def test_a_sidecar_port_already_taken_is_refused_with_the_reason(make_cluster):
    port = free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))
    squatter.listen()
    try:
        c = make_cluster(models=[_model(port)])
        c.start_server()
        agent = c.add_agent("node-a")
        line = c.server_log_line(f"port {port} is already in use")
        assert "sidecar helper's" in line and "one shard of the profile per node" in line
        # Nothing was started for it: neither the sidecar nor the engine.
        assert "started sidecar" not in agent.log.read_text()
    finally:
        squatter.close()
