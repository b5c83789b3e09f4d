"""Per-key limits and usage through real servers: a key over its requests per minute is
refused with 429 and Retry-After, what it used is recorded from the engine's `usage`, and
two servers sharing one PostgreSQL enforce one limit between them."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.integration.cluster import wait_for
from tests.integration.conftest import SIM_SMALL, one_node_cluster


def _key(c, **limits) -> str:
    made = c.admin("POST", "/api/keys", json={"name": "limited", "limits": limits})
    assert made.status_code == 201, made.text
    return made.json()["key"]


def _chat(c, key: str, stream: bool = False) -> httpx.Response:
    body = {"model": "sim-small", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": "count me"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return httpx.post(f"{c.base_url}/v1/chat/completions", json=body, timeout=20,
                      headers={"authorization": f"Bearer {key}"})


def _one_minute_ahead() -> None:
    """Requests that must count in one window of `rpm` (a UTC minute) are not sent in a
    minute's last seconds: wait for the next one to start."""
    into_minute = time.time() % 60
    if into_minute > 50:
        time.sleep(60.2 - into_minute)


@pytest.fixture(scope="module")
def one_server(tmp_path_factory, request):
    """One server and node for the tests of one server's limits: each has its own key."""
    with one_node_cluster(tmp_path_factory.mktemp("limits"), request, [SIM_SMALL]) as c:
        yield c


def test_a_key_over_its_requests_per_minute_gets_429_and_its_usage_is_recorded(one_server):
    c = one_server
    key = _key(c, rpm=3)

    _one_minute_ahead()
    answers = [_chat(c, key), _chat(c, key, stream=True), _chat(c, key)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    refused = _chat(c, key)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert "limit of 3 requests per minute is used up" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60

    keys = c.admin("GET", "/api/keys").json()
    prefix = next(k["prefix"] for k in keys if key.startswith(k["prefix"]))

    def recorded():
        # Usage is written in batches once a second: wait for all three requests, which
        # may span two batches.
        usage = c.admin("GET", f"/api/keys/{prefix}/usage").json()
        return sum(m["requests"] for m in usage["models"]) >= 3 and usage
    usage = wait_for(recorded, 10, "the usage of three requests to be written")
    [model] = usage["models"]
    assert model["model"] == "sim-small" and model["requests"] == 3
    # The sim counts prompt words and generated tokens; the stream's usage came from its
    # final chunk.
    assert model["completion_tokens"] == 12 and model["prompt_tokens"] > 0


def test_a_stream_without_usage_counts_what_it_sent_against_a_token_limit(one_server):
    """The sim, like vLLM, reports a stream's usage only when asked. Not asked, the stream
    counts one completion token per event it sent, so what it generated counts against the
    key's token limits (its prompt does not: llmgw has no tokenizer). A daily limit: a
    minute's could roll over between the stream and the request it must refuse."""
    c = one_server
    key = _key(c, tokens_per_day=5)
    body = {"model": "sim-small", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "count me"}]}
    streamed = httpx.post(f"{c.base_url}/v1/chat/completions", json=body, timeout=20,
                          headers={"authorization": f"Bearer {key}"})
    assert streamed.status_code == 200
    # The role, four tokens, the finish, [DONE]; no usage among them.
    assert streamed.text.count("data: ") == 7 and '"usage"' not in streamed.text

    prefix = next(k["prefix"] for k in c.admin("GET", "/api/keys").json()
                  if key.startswith(k["prefix"]))

    def recorded():
        usage = c.admin("GET", f"/api/keys/{prefix}/usage").json()
        return usage["models"] and usage
    [model] = wait_for(recorded, 10, "the stream's usage to be written")["models"]
    # Its seven events, however the reads cut them.
    assert model["requests"] == 1 and model["prompt_tokens"] == 0
    assert model["completion_tokens"] == 7
    refused = _chat(c, key)
    assert refused.status_code == 429, refused.text
    assert "limit of 5 tokens per day (UTC) is used up" in refused.json()["error"]["message"]
    # Come back when the day (UTC) turns: within a day, never at once.
    assert 0 < int(refused.headers["retry-after"]) <= 86400


def test_two_servers_sharing_postgresql_enforce_one_limit(make_cluster, postgres_database):
    auth = {"key_cache_s": 1.0}
    a = make_cluster(store={"url": postgres_database}, auth=auth)
    a.start_server()
    a.add_agent("node-a")
    b = make_cluster(store={"url": postgres_database}, auth=auth)
    b.start_server()
    b.add_agent("node-b")
    a.wait_ready("sim-small")
    b.wait_ready("sim-small")
    key = _key(a, rpm=5)

    _one_minute_ahead()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda c: _chat(c, key), [a, b] * 4))

    codes = sorted(r.status_code for r in answers)
    assert codes == [200] * 5 + [429] * 3, [(r.status_code, r.text[:80]) for r in answers]

    # A key revoked through a: a refuses it at once, b (which read it a moment ago)
    # within its auth.key_cache_s.
    key = _key(a)
    assert _chat(b, key).status_code == 200
    prefix = next(k["prefix"] for k in a.admin("GET", "/api/keys").json()
                  if key.startswith(k["prefix"]))
    assert a.admin("DELETE", f"/api/keys/{prefix}").status_code == 200
    revoked = time.monotonic()
    assert _chat(a, key).status_code == 401
    wait_for(lambda: _chat(b, key).status_code == 401, 10, "b to refuse the revoked key")
    assert time.monotonic() - revoked < 1.0 + 2.0  # the cache's second, and slack
