"""The store (the real PostgreSQL) does not answer for 40 s, five times the time after which
a silent node is lost, four times the leader's lease, while chat requests flow: no node is
taken for unreachable or lost, the known routes serve every request, what needs the store
is a 503 saying so, and the server answers and leads again once the store answers, without
a restart. Then the store comes back empty: a refusal saying its tables are gone.

The database is closed to new connections and its sessions are ended, later dropped and
made again. Two agents with a sim engine each (two replicas of one model); the requests
use a key read before the outage, which goes on working past its cache time (2 s)."""

from __future__ import annotations

import time

import httpx

from llmgw.server.auth.keys import key_id, new_api_key
from tests.chaos.measure import figure, timed_lines
from tests.integration.cluster import wait_for
from tests.integration.load import ChatLoad
from tests.pg import as_admin, close_database, open_database, run_blocking

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
    healths: set[tuple[str, str]] = set()
    unseen_key: httpx.Response | None = None
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
            if unseen_key is None:
                # A key the server never saw needs the store: 503, not 401 nor 500.
                unseen_key = httpx.post(
                    f"{c.base_url}/v1/chat/completions", timeout=20,
                    headers={"authorization": f"Bearer {new_api_key()}"},
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            health = httpx.get(f"{c.base_url}/healthz", timeout=5).json()
            healths.add((health["status"], health["store"]))
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
    # What needs the store said why, and when to try again; the store's address is the
    # operator's, in the log, not the client's.
    assert refusals and all(r.status_code == 503 for r in refusals), \
        [(r.status_code, r.text) for r in refusals]
    for r in refusals:
        assert r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "store_unavailable"
        assert "store is not answering" in r.json()["error"]["message"]
        assert name not in r.text
    assert unseen_key is not None and unseen_key.status_code == 503, unseen_key.text
    assert healths == {("degraded", "unreachable")}, healths
    # Logged once, without a traceback; the lease ran out and was taken up again.
    assert text.count("does not answer") == 1, text[-3000:]
    assert "Traceback" not in text
    assert not_leading_at is not None
    assert not_leading_at - closed_at <= LEASE_S + 3
    assert len(timed_lines(log, "not sure this server still leads")) == 1
    assert len(timed_lines(log, "leading again, term")) == 1
    # It answers again without a restart: the same process, the outage's end logged.
    assert c.server.poll() is None
    c.server_log_line("answers again, after")
    health = httpx.get(f"{c.base_url}/healthz", timeout=5).json()
    assert (health["status"], health["store"], health["leader"]) == ("ok", "ok", True)
    assert c.admin("GET", "/api/keys").status_code == 200

    # The usage counted during the outage was kept, and written once the store answered:
    # every request of the load, each answered (no failures, above).
    def recorded() -> int:
        usage = c.admin("GET", f"/api/keys/{key_id(key)}/usage")
        return sum(d["requests"] for d in usage.json()["days"]) if usage.is_success else 0

    wait_for(lambda: recorded() == len(load.done), 10,
             f"the {len(load.done)} requests to be recorded")

    # Dropped and made again, empty: a refusal saying the tables are gone, not a 500.
    run_blocking(as_admin(f'DROP DATABASE "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"'))
    empty = c.admin("GET", "/api/keys")
    assert empty.status_code == 503, empty.text
    assert empty.json()["error"]["code"] == "store_schema_missing"
    c.server_log_line("has no llmgw tables", "llmgw store restore")
    assert httpx.get(f"{c.base_url}/healthz", timeout=5).json()["store"] == "schema missing"
    assert "Traceback" not in log.read_text()
