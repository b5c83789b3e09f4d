"""One machine end to end: a real server, a real agent, the sim engine, the openai client."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import httpx
import openai
import psutil
import pytest

from llmgw import wire
from tests.integration.cluster import wait_for
from tests.integration.conftest import SIM_SMALL, one_node_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    """One cluster for the module. The tests that kill part of it come last, each reading
    what runs at its start and leaving the cluster serving again, as it asserts."""
    with one_node_cluster(tmp_path_factory.mktemp("skeleton"), request, [SIM_SMALL]) as c:
        yield c


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                         max_retries=0, timeout=20)


def test_chat_completions_and_stream_through_llmgw(cluster):
    c = client(cluster)
    messages = [{"role": "user", "content": "Say something about clusters"}]
    reply = c.chat.completions.create(model="sim-small", messages=messages, max_tokens=12)
    text = reply.choices[0].message.content
    assert text and len(text.split()) == 12
    assert reply.usage.completion_tokens == 12

    stream = c.chat.completions.create(model="sim-small", messages=messages, max_tokens=12,
                                       stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1, "a stream must arrive in several chunks"
    assert "".join(pieces) == text

    completion = c.completions.create(model="sim-small", prompt="Once upon a time",
                                      max_tokens=5)
    assert len(completion.choices[0].text.split()) == 5
    assert [m.id for m in c.models.list().data] == ["sim-small"]


def test_async_client_streams_completions(cluster):
    async def run() -> str:
        c = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                               max_retries=0)
        parts = []
        stream = await c.completions.create(model="sim-small", prompt="hello", max_tokens=6,
                                            stream=True)
        async for chunk in stream:
            parts.extend(choice.text for choice in chunk.choices)
        await c.close()
        return "".join(parts)

    assert len(asyncio.run(run()).split()) == 6


def test_bad_input_gets_openai_errors_and_never_a_500(cluster):
    c = client(cluster)
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="sim-smal", messages=[{"role": "user", "content": "x"}])
    assert "sim-small" in str(err.value), "an unknown model should suggest the close name"

    url = f"{cluster.base_url}/v1/chat/completions"
    auth = {"authorization": f"Bearer {cluster.api_key}"}
    cases = [
        (b"{not json", 400, "invalid_json"),
        (b'{"model": "sim-small"}', 400, "missing_field"),
        (b'["a", "list"]', 400, "invalid_json"),
        (b'{"messages": []}', 400, "missing_field"),
    ]
    for body, status, code in cases:
        resp = httpx.post(url, content=body, headers=auth)
        assert resp.status_code == status, body
        error = resp.json()["error"]
        assert error["code"] == code and error["message"] and error["type"]

    resp = httpx.post(url, json={"model": "sim-small", "messages": []})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "missing_api_key"
    bad_key = "llmgw_" + "A" * 50
    resp = httpx.post(url, json={"model": "sim-small", "messages": []},
                      headers={"authorization": f"Bearer {bad_key}"})
    assert resp.status_code == 401
    # Any POST under /v1 naming a model is forwarded; other methods are refused.
    resp = httpx.get(f"{cluster.base_url}/v1/nothing-here", headers=auth)
    assert resp.status_code == 405
    assert resp.json()["error"]["message"] == "/v1/nothing-here does not take GET"
    assert resp.headers["allow"] == "POST"
    # Every path says every method it takes (Litestar 2 alone named only the first
    # handler's: GET on /api/users, though POST works).
    options = httpx.options(f"{cluster.base_url}/api/users")
    assert options.status_code == 204 and options.headers["allow"] == "GET, OPTIONS, POST"
    refused = httpx.put(f"{cluster.base_url}/api/users", headers=auth)
    assert refused.status_code == 405
    assert set(refused.headers["allow"].split(", ")) == {"GET", "OPTIONS", "POST"}
    assert httpx.options(f"{cluster.base_url}/api/keys/x").headers["allow"] == \
        "DELETE, OPTIONS, PATCH"
    resp = httpx.get(f"{cluster.base_url}/nothing-here", headers=auth)
    assert resp.status_code == 404 and "error" in resp.json()
    # Still serving after all of that.
    reply = c.chat.completions.create(model="sim-small", messages=[{"role": "user",
                                                                    "content": "ok?"}])
    assert reply.choices[0].message.content


def test_a_garbage_agent_is_dropped_and_the_rest_keep_serving(cluster):
    async def speak_garbage() -> tuple[int | None, str]:
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(f"ws://127.0.0.1:{cluster.port}/agent/v1/stream")
            await ws.send_bytes(b"\xc1 this is not msgpack")
            msg = await ws.receive(timeout=10)
            return ws.close_code, msg.extra or ""

    code, reason = asyncio.run(speak_garbage())
    assert code == 4400, (code, reason)
    assert "msgpack" in reason or "malformed" in reason

    async def wrong_first_message() -> int | None:
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(f"ws://127.0.0.1:{cluster.port}/agent/v1/stream")
            await ws.send_bytes(wire.encode(wire.Heartbeat()))
            await ws.receive(timeout=10)
            return ws.close_code

    assert asyncio.run(wrong_first_message()) == 4400
    c = client(cluster)
    assert c.chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "still there?"}]
    ).choices[0].message.content
    assert cluster.node_state("node-a") == "ready"


def test_killed_engine_fails_the_replica_and_it_is_restarted(cluster):
    agent = cluster.agents["node-a"]
    [before] = cluster.ready_replicas("sim-small")
    [record] = agent.shard_records()
    os.kill(record["pid"], signal.SIGKILL)

    def replaced():
        ready = cluster.ready_replicas("sim-small")
        return ready and ready[0]["id"] != before["id"] and ready[0]

    after = wait_for(replaced, 30, "a new replica to replace the killed one")
    assert after["epoch"] > before["epoch"]
    [new_record] = agent.shard_records()
    assert new_record["pid"] != record["pid"]
    assert client(cluster).chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "back?"}]
    ).choices[0].message.content


def test_killed_agent_makes_the_node_unreachable_and_a_restart_brings_it_back(cluster):
    agent = cluster.agents["node-a"]
    [record] = agent.shard_records()
    [replica] = cluster.ready_replicas("sim-small")
    agent.kill()
    wait_for(lambda: cluster.node_state("node-a") == "unreachable", 10,
             "the node to be marked unreachable")
    # The engine is not the agent: it keeps serving while its agent is away.
    assert psutil.pid_exists(record["pid"])
    assert client(cluster).chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "anyone?"}]
    ).choices[0].message.content

    agent.start()
    wait_for(lambda: cluster.node_state("node-a") == "ready", 15, "the node to be ready again")
    [adopted] = cluster.wait_ready("sim-small")
    assert adopted["id"] == replica["id"], "the running shard should be adopted, not replaced"
    [again] = agent.shard_records()
    assert again["pid"] == record["pid"], "adoption must not restart the engine"
