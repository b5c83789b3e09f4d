"""Every slot taken: the next request waits in the queue, then 429; a full queue refuses."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.integration.cluster import wait_for

ONE_SLOT = {"name": "sim-one", "replicas": 1, "profiles": [
    {"engine": "sim", "slots": 1, "args": ["--tokens-per-second", "5"]}]}


@pytest.fixture
def cluster(make_cluster):
    c = make_cluster(models=[ONE_SLOT], gateway={"queue_max": 1, "queue_wait_s": 1.0})
    c.start_server()
    c.add_agent("node-a")
    c.wait_ready("sim-one")
    return c


def test_a_full_replica_queues_then_refuses_with_429(cluster):
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                           max_retries=0, timeout=20)
    stream = client.chat.completions.create(
        model="sim-one", stream=True, max_tokens=200,
        messages=[{"role": "user", "content": "hold the slot"}])
    next(iter(stream))
    outcome = {}

    def waiting():
        started = time.monotonic()
        try:
            client.chat.completions.create(model="sim-one", max_tokens=1,
                                           messages=[{"role": "user", "content": "w"}])
        except openai.RateLimitError as err:
            outcome["waiter"] = (err.body["code"], time.monotonic() - started,
                                 err.response.headers.get("retry-after"))

    t = threading.Thread(target=waiting)
    t.start()

    def queued() -> bool:  # the waiter is in the queue, as /metrics shows it
        text = httpx.get(f"{cluster.base_url}/metrics", timeout=5).text
        return 'llmgw_queue_length{model="sim-one"} 1.0' in text
    wait_for(queued, 5, "the second request to wait in the queue")
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as full:
        client.chat.completions.create(model="sim-one", max_tokens=1,
                                       messages=[{"role": "user", "content": "x"}])
    assert full.value.body["code"] == "queue_full" and time.monotonic() - started < 0.5
    # Told when to come back, as the waiter that timed out is (below).
    assert int(full.value.response.headers["retry-after"]) >= 1
    t.join(10)
    code, waited, retry_after = outcome["waiter"]
    assert code == "queue_timeout" and 0.9 < waited < 3 and retry_after
    stream.close()
    wait_for(lambda: sum(r["in_flight"] for r in cluster.replicas("sim-one")) == 0, 10,
             "the slot is free again")
    answer = client.chat.completions.create(model="sim-one", max_tokens=2,
                                            messages=[{"role": "user", "content": "ok"}])
    assert answer.choices[0].message.content
