"""The store (the real PostgreSQL) does not answer for 40 s, five times the time after which
a silent node is lost, four times the leader's lease, while chat requests flow: no node is
taken for unreachable or lost, the known routes serve every request, what needs the store
is a 503 saying so, and the server leads again once the store answers.

The outage is made as tests/integration/test_store_outage.py makes it: the database is
closed to new connections and its sessions are ended. Two agents with a sim engine each
(two replicas of one model); the requests use a key read before the outage."""

from __future__ import annotations

import time

import httpx

from tests.chaos.measure import figure, timed_lines
from tests.integration.cluster import wait_for
from tests.integration.load import ChatLoad
from tests.pg import close_database, open_database

OUTAGE_S = 40
LEASE_S = 10  # controller.lease_s, its default: the leader pauses about this long in
MODEL = "sim-two"
NODES = ("node-a", "node-b")


def test_a_40_s_store_outage_loses_no_node_and_fails_no_known_route(
        make_cluster, postgres_database, record_property):
    name = postgres_database.rsplit("/", 1)[1]
    c = make_cluster([{"name": MODEL, "replicas": 2, "profiles": [{"engine": "sim"}]}],
                     store={"url": postgres_database}, auth={"key_cache_s": 2.0})
    c.start_server()
    for node in NODES:
        c.add_agent(node)
    c.wait_ready(MODEL, count=2)
    made = c.admin("POST", "/api/keys", json={"name": "chaos"})
    assert made.status_code == 201, made.text
    key = made.json()["key"]
    log = c.root / "server.log"

    load = ChatLoad(c.base_url, key, MODEL, {"plain": 1, "stream": 1}, max_requests=3000,
                    max_s=OUTAGE_S + 40)
    load.start()
    states: set[str] = set()
    refusals: list[httpx.Response] = []
    not_leading_at = None
    try:
        wait_for(lambda: load.answered_after(0) >= 3, 15, "requests to be answered")
        closed_at = time.monotonic()
        close_database(name)
        # Watched through the outage, paced: the status is the controller's, in memory.
        while time.monotonic() < closed_at + OUTAGE_S:
            states |= {n["state"] for n in c.status()["nodes"]}
            if len(refusals) < 20:
                refusals.append(c.admin("GET", "/api/keys"))  # keys are read from the store
            health = httpx.get(f"{c.base_url}/healthz", timeout=5).json()
            if not_leading_at is None and not health["leader"]:
                not_leading_at = time.monotonic()
            time.sleep(0.5)
        opened_at = time.monotonic()
        open_database(name)
        wait_for(lambda: httpx.get(f"{c.base_url}/healthz", timeout=5).json()["leader"], 20,
                 "the server to lead again")
        leading_again_at = time.monotonic()
        # And it plans again from what it knows: the nodes stay ready over several passes
        # (interval 0.5 s) after it took up leading again.
        while time.monotonic() < leading_again_at + 3:
            states |= {n["state"] for n in c.status()["nodes"]}
            time.sleep(0.5)
        wait_for(lambda: load.answered_after(leading_again_at) >= 3, 15,
                 "requests answered after the outage")
    finally:
        load.finish()

    failures = load.failures()
    figure(record_property, "store_outage_s", opened_at - closed_at, "s")
    figure(record_property, "requests_answered_during_outage",
           load.answered_after(closed_at, opened_at))
    figure(record_property, "requests_failed", len(failures))
    figure(record_property, "outage_to_not_leading_s",
           (not_leading_at or opened_at) - closed_at, "s")
    figure(record_property, "store_back_to_leading_s", leading_again_at - opened_at, "s")

    assert failures == [], f"{len(failures)} failed: {failures[:5]}"
    assert load.answered_after(closed_at, opened_at) >= 20
    assert states == {"ready"}, states
    text = log.read_text()
    assert "-> unreachable" not in text and "-> lost" not in text
    assert [r["state"] for r in c.replicas(MODEL)] == ["ready", "ready"]
    # What needs the store said why, and when to try again.
    assert refusals and all(r.status_code == 503 for r in refusals), \
        [(r.status_code, r.text) for r in refusals]
    for r in refusals:
        assert r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "store_unavailable"
        assert "store is not answering" in r.json()["error"]["message"]
    # Logged once, without a traceback; the lease ran out and was taken up again.
    assert text.count("does not answer") == 1, text[-3000:]
    assert "Traceback" not in text
    assert not_leading_at is not None
    assert not_leading_at - closed_at <= LEASE_S + 3
    assert len(timed_lines(log, "not sure this server still leads")) == 1
    assert len(timed_lines(log, "leading again, term")) == 1
    health = httpx.get(f"{c.base_url}/healthz", timeout=5).json()
    assert (health["status"], health["store"], health["leader"]) == ("ok", "ok", True)
    assert c.admin("GET", "/api/keys").status_code == 200
