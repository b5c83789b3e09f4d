"""Scale to zero on a real server, agent and sim engines, through the official `openai`
client: a model that can sleep is not placed before it is asked for; its first request
waits while a replica is placed and starts, and is answered; it is unloaded after
``idle_unload_s`` without a request, and the next request (streamed) wakes it again; a
model that cannot start within its ``wake_timeout_s`` is refused with placement's reason,
not kept waiting."""

from __future__ import annotations

import time

import openai
import pytest

from tests.integration.cluster import wait_for
from tests.integration.conftest import one_node_cluster
from tests.integration.test_ctl import run
from tests.integration.ui_session import logged_in

IDLE_S = 2
NAP = {"name": "nap", "profiles": [{"engine": "sim"}], "idle_unload_s": IDLE_S,
       "wake_timeout_s": 30}
# Wants a GPU node-a does not have: woken, it cannot be placed.
STRANDED = {"name": "stranded", "profiles": [{"engine": "sim", "gpus": 1}],
            "idle_unload_s": IDLE_S, "wake_timeout_s": 2}
ALWAYS = {"name": "always", "profiles": [{"engine": "sim"}]}
HI = [{"role": "user", "content": "hi"}]
PASSWORD = "a-long-password"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    # queue_wait_s shorter than STRANDED's wake_timeout_s: a woken model's request waits
    # by the model's bound, not the queue's.
    with one_node_cluster(tmp_path_factory.mktemp("sleep"), request, [NAP, STRANDED, ALWAYS],
                          {"gateway": {"queue_wait_s": 0.5}}, ready={"always": 1}) as c:
        yield c


def _client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=c.make_key(), max_retries=0,
                         timeout=40)


def _model(c, name: str) -> dict:
    return next(m for m in c.status()["models"] if m["name"] == name)


@pytest.mark.usefixtures("ctl_environment")
def test_a_sleeping_model_wakes_on_a_request_and_sleeps_again_when_idle(cluster):
    assert _model(cluster, "nap")["asleep"] is True
    assert cluster.replicas("nap") == []
    [listed] = [m for m in cluster.admin("GET", "/api/models").json() if m["name"] == "nap"]
    assert (listed["asleep"], listed["idle_unload_s"], listed["min_replicas"]) == (True, 2, 0)
    for command in ("status", "models"):
        shown = run("ctl", command, "--server", cluster.base_url,
                    "--token", cluster.admin_token)
        assert shown.code == 0, shown.err
        assert "asleep (no request for 2 s); the next one wakes it" in shown.out, command
    cluster.admin("POST", "/api/users", json={"username": "ops", "password": PASSWORD,
                                              "role": "admin"}).raise_for_status()
    browser = logged_in(cluster, "ops", PASSWORD)
    try:
        page, listing = browser.get("/ui/models/nap").text, browser.get("/ui/models").text
    finally:
        browser.close()
    assert ("Asleep: no request for 2 s, so it keeps 0. The next request wakes it (one slow "
            "answer).") in page
    assert "asleep; the next request wakes it" in listing
    client = _client(cluster)

    began = time.monotonic()
    chat = client.chat.completions.create(model="nap", messages=HI, max_tokens=3)
    woke_s = time.monotonic() - began
    assert chat.model == "nap" and chat.usage.completion_tokens == 3
    [replica] = cluster.ready_replicas("nap")
    assert _model(cluster, "nap")["asleep"] is False
    cluster.server_log_line("model nap: woken by a request")

    # Nothing asks for it: unloaded after IDLE_S, and said so.
    wait_for(lambda: cluster.replicas("nap") == [] and _model(cluster, "nap")["asleep"],
             IDLE_S + 15, "nap to be unloaded")
    cluster.server_log_line("model nap: no request for 2 s; keeping 0 of its 1 replica(s)")

    with client.chat.completions.with_streaming_response.create(
            model="nap", messages=HI, max_tokens=3, stream=True,
            stream_options={"include_usage": True}) as streamed:
        chunks = list(streamed.parse())
    assert chunks[-1].usage.completion_tokens == 3
    [again] = cluster.ready_replicas("nap")
    assert again["id"] != replica["id"]  # placed anew, not the one unloaded
    print(f"nap woke in {woke_s:.2f} s")


def test_a_model_that_cannot_start_in_its_wake_timeout_is_refused_with_the_reason(cluster):
    client = _client(cluster)
    began = time.monotonic()
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(model="stranded", messages=HI, max_tokens=1)
    waited = time.monotonic() - began
    assert refused.value.status_code == 503
    message = refused.value.body["message"]
    assert message.startswith("no replica of 'stranded' can take the request"), message
    assert "GPU" in message, message
    assert 1.5 <= waited < 15, waited  # its wake_timeout_s (2 s), not the queue's 0.5 s
