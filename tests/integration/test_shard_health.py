"""A ready shard that stops answering is taken out of routing, and replaced if it does not
come back. Real agent, real sim engine; the engine is frozen with SIGSTOP, so it neither
exits nor answers, like an engine wedged on a dead peer."""

from __future__ import annotations

import os
import signal

import httpx

from tests.integration.cluster import process_alive, wait_for


def _shard(c) -> dict:
    [replica] = [r for r in c.replicas("sim-small") if r["state"] != "failed"] or [None]
    return replica and replica["shards"][0]


def test_a_frozen_engine_is_unhealthy_then_ready_again_when_it_thaws(make_cluster):
    c = make_cluster()
    c.start_server()
    agent = c.add_agent("node-a", shard_health={"every_s": 0.3, "unhealthy_after_s": 1.0,
                                                "fail_after_s": 60})
    [replica] = c.wait_ready("sim-small")
    [record] = agent.shard_records()
    os.kill(record["pid"], signal.SIGSTOP)
    try:
        shard = wait_for(lambda: (s := _shard(c)) and s["state"] == "unhealthy" and s, 15,
                         "the shard to be reported unhealthy")
        assert "/health" in shard["detail"]
        # Not routed to: the gateway answers at once instead of waiting on a frozen engine.
        reply = httpx.post(f"{c.base_url}/v1/chat/completions", timeout=10,
                           headers={"authorization": f"Bearer {c.api_key}"},
                           json={"model": "sim-small",
                                 "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 503, reply.text
    finally:
        os.kill(record["pid"], signal.SIGCONT)
    [again] = c.wait_ready("sim-small", timeout_s=15)
    assert again["id"] == replica["id"]  # the same replica, never restarted
    assert agent.shard_records()[0]["pid"] == record["pid"]


def test_an_engine_that_stays_unhealthy_is_failed_and_replaced(make_cluster):
    c = make_cluster()
    c.start_server()
    agent = c.add_agent("node-a", shard_health={"every_s": 0.3, "unhealthy_after_s": 0.6,
                                                "fail_after_s": 2.0})
    [replica] = c.wait_ready("sim-small")
    [record] = agent.shard_records()
    os.kill(record["pid"], signal.SIGSTOP)
    try:
        line = c.server_log_line("health check failed for 2 s", timeout_s=20)
        assert replica["id"] in line
    finally:
        # Failed, it is the agent's to stop: thawed, it takes the SIGTERM it is sent (the
        # SIGKILL after 10 s, for an engine that ignores SIGTERM, is the runtime contract's
        # test). Were it not stopped, it would run on, answering, and the wait below fail.
        if process_alive(record["pid"], record["started_at"]):
            os.kill(record["pid"], signal.SIGCONT)
    wait_for(lambda: not process_alive(record["pid"], record["started_at"]), 20,
             "the failed engine to be stopped")
    [again] = c.wait_ready("sim-small", timeout_s=30)
    assert again["id"] != replica["id"]
