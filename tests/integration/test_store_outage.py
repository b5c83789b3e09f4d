"""A server whose PostgreSQL stops answering, then answers again, then comes back empty:
real server, agent and sim engine, and the real PostgreSQL, whose database is closed to
connections (its sessions ended) and later dropped and made again.

While the store does not answer, what needs no store goes on (a key read lately, a
known route, the nodes' liveness), what needs it is a 503 with Retry-After saying so, the
server logs the outage once (no traceback per request), and it answers again without a
restart."""

from __future__ import annotations

import time

import httpx

from llmgw.server.auth.keys import key_id, new_api_key
from tests.integration.cluster import wait_for
from tests.pg import as_admin, close_database, open_database, run_blocking

MODEL = "sim-small"


def _chat(c, key: str) -> httpx.Response:
    return httpx.post(f"{c.base_url}/v1/chat/completions", timeout=20,
                      headers={"authorization": f"Bearer {key}"},
                      json={"model": MODEL, "max_tokens": 3,
                            "messages": [{"role": "user", "content": "still there?"}]})


def test_a_store_outage_refuses_only_what_needs_the_store_and_ends_without_a_restart(
        make_cluster, postgres_database):
    url = postgres_database
    name = url.rsplit("/", 1)[1]
    c = make_cluster(store={"url": url}, auth={"key_cache_s": 2.0})
    c.start_server()
    c.add_agent("node-a")
    c.wait_ready(MODEL)
    made = c.admin("POST", "/api/keys", json={"name": "outage"})
    assert made.status_code == 201, made.text
    key = made.json()["key"]
    assert _chat(c, key).status_code == 200  # read now: in the key cache

    close_database(name)
    # The cluster's state is the controller's, in memory: it still answers.
    assert c.admin("GET", "/api/status").status_code == 200
    # Keys are listed from the store: 503, and the outage logged once.
    keys = c.admin("GET", "/api/keys")
    assert keys.status_code == 503, keys.text
    assert keys.headers["retry-after"] == "5"
    assert keys.json()["error"]["code"] == "store_unavailable"
    assert "store is not answering" in keys.json()["error"]["message"]
    assert name not in keys.text  # the store's address is the operator's, in the log

    # A key in use goes on working past its cache time (2 s), and so does the route; and
    # the node, whose heartbeats need no store, stays ready past lost_after_s (8 s):
    # requests paced over 9 s, at most 80.
    answers, states = [], set()
    until = time.monotonic() + 9
    while time.monotonic() < until and len(answers) < 80:
        answers.append(_chat(c, key).status_code)
        c.admin("GET", "/api/keys")  # more failures: still one log line
        states.add(c.node_state("node-a"))
        time.sleep(0.1)  # pacing, so that the requests span the cache time
    assert set(answers) == {200}, answers
    assert states == {"ready"}, states
    # A key the server never saw needs the store: 503, not 401 nor 500.
    unseen = _chat(c, new_api_key())
    assert unseen.status_code == 503, unseen.text
    health = httpx.get(f"{c.base_url}/healthz", timeout=5).json()
    assert (health["status"], health["store"]) == ("degraded", "unreachable")

    log = (c.root / "server.log").read_text()
    assert log.count("does not answer") == 1, log[-3000:]
    assert "Traceback" not in log

    # The database opens again: the server answers at once, without a restart.
    open_database(name)
    wait_for(lambda: c.admin("GET", "/api/keys").status_code == 200, 10,
             "the admin API to answer again")
    c.server_log_line("answers again, after")
    assert httpx.get(f"{c.base_url}/healthz", timeout=5).json()["store"] == "ok"
    # The usage counted during the outage was kept, and written once it answered.
    def recorded() -> int:
        usage = c.admin("GET", f"/api/keys/{key_id(key)}/usage")
        return sum(d["requests"] for d in usage.json()["days"]) if usage.is_success else 0

    wait_for(lambda: recorded() == len(answers) + 1, 10,
             f"the {len(answers) + 1} requests to be recorded")

    # Dropped and made again, empty: a refusal saying the tables are gone, not a 500.
    run_blocking(as_admin(f'DROP DATABASE "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"'))
    empty = c.admin("GET", "/api/keys")
    assert empty.status_code == 503, empty.text
    assert empty.json()["error"]["code"] == "store_schema_missing"
    c.server_log_line("has no llmgw tables", "llmgw store restore")
    assert httpx.get(f"{c.base_url}/healthz", timeout=5).json()["store"] == "schema missing"
    assert "Traceback" not in (c.root / "server.log").read_text()

