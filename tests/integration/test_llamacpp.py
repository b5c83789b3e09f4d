"""A real model on the CPU: llama-server with SmolLM2-135M behind llmgw."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from tests.integration.conftest import one_node_cluster

CHAT = "smollm2"
EMBED = "smollm2-embed"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request, llama_cpp):
    """One cluster for the module's tests, which only send it requests."""
    server, weights = llama_cpp
    # One thread each: two threads collapse when the machine is busy with the rest.
    chat = {"name": CHAT, "replicas": 2, "profiles": [
        {"engine": "llama.cpp", "weights": weights, "startup_timeout_s": 120,
         "args": ["--threads", "1", "--ctx-size", "2048", "--metrics"]}]}
    embed = {"name": EMBED, "replicas": 1, "profiles": [
        {"engine": "llama.cpp", "weights": weights, "embeddings": True,
         "startup_timeout_s": 120,
         "args": ["--threads", "1", "--ctx-size", "2048", "--pooling", "mean"]}]}
    with one_node_cluster(tmp_path_factory.mktemp("llamacpp"), request, [chat, embed],
                          ready={CHAT: 2, EMBED: 1},
                          agent_overrides={"engines": {"llama.cpp": {"binary": server}}}) as c:
        yield c


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                         max_retries=0, timeout=60)


def test_openai_client_gets_chat_stream_completions_and_embeddings(cluster):
    c = _client(cluster)
    question = [{"role": "user", "content": "What is 2+2? Answer with the number."}]
    reply = c.chat.completions.create(model=CHAT, messages=question, max_tokens=24,
                                      temperature=0)
    answer = reply.choices[0].message.content
    assert "4" in answer, answer
    assert reply.usage.completion_tokens > 0 and reply.model == CHAT

    stream = c.chat.completions.create(model=CHAT, messages=question, max_tokens=24,
                                       temperature=0, stream=True)
    pieces = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert len([p for p in pieces if p]) > 1, "tokens must arrive one by one"
    assert "".join(pieces).strip() == answer.strip(), "greedy stream and reply agree"

    completion = c.completions.create(model=CHAT, prompt="The capital of France is",
                                      max_tokens=8, temperature=0)
    assert completion.choices[0].text.strip()

    vectors = c.embeddings.create(model=EMBED, input=["a cat", "a dog"]).data
    assert len(vectors) == 2
    assert len(vectors[0].embedding) == len(vectors[1].embedding) > 100
    assert vectors[0].embedding != vectors[1].embedding

    assert sorted(m.id for m in c.models.list().data) == [CHAT, EMBED]


def _decoded(port: int) -> int:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return int(float(re.search(r"^llamacpp:n_decode_total (\S+)$", text, re.M).group(1)))


def test_both_replicas_on_one_machine_get_traffic(cluster):
    replicas = cluster.ready_replicas(CHAT)
    ports = [r["shards"][0]["port"] for r in replicas]
    assert len(set(ports)) == 2
    before = [_decoded(p) for p in ports]

    async def burst() -> list[str]:
        c = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                               max_retries=0, timeout=60)
        try:
            replies = await asyncio.gather(*(
                c.chat.completions.create(
                    model=CHAT, max_tokens=16,
                    messages=[{"role": "user", "content": f"Name a colour. ({i})"}])
                for i in range(6)))
        finally:
            await c.close()
        return [r.choices[0].message.content for r in replies]

    assert all(asyncio.run(burst()))
    after = [_decoded(p) for p in ports]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
