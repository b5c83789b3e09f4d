"""Every /v1 endpoint through the official `openai` client, sync and async, streamed and
not, against one real cluster with the sim engine: on each HTTP server llmgw runs
(``listen.server``), over plain HTTP and over https."""

from __future__ import annotations

import hashlib

import openai
import pytest

from llmgw.config import HTTP_SERVERS
from tests.integration.cluster import ClusterCa
from tests.integration.conftest import SIM_SMALL, one_node_cluster

MODEL = "sim-small"


@pytest.fixture(scope="module",
                params=[*HTTP_SERVERS, *(f"{server}+tls" for server in HTTP_SERVERS)])
def cluster(tmp_path_factory, request):
    server, _, tls = request.param.partition("+")
    root = tmp_path_factory.mktemp(f"openai-client-{server}-{tls or 'plain'}")
    ca = ClusterCa.make(root / "ca") if tls else None
    with one_node_cluster(root / "cluster", request, [SIM_SMALL], http_server=server,
                          ca=ca) as c:
        # The server runs on the one named, as its first log line of serving says.
        c.server_log_line("serving on", f"({server})")
        yield c


def _sync(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=c.api_key, max_retries=0,
                         timeout=20)


def _async(c) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{c.base_url}/v1", api_key=c.api_key,
                              max_retries=0, timeout=20)


MESSAGES = [{"role": "user", "content": "say something"}]
# Endpoints llmgw has no route of its own for, reached by the model their body names.
RERANK = {"model": MODEL, "query": "red fox",
          "documents": ["a blue whale", "the red fox jumps", "red paint"]}
AUDIO = b"RIFF" + bytes(range(256)) * 64
HEARD = f"{len(AUDIO)} bytes of a.wav, sha256 {hashlib.sha256(AUDIO).hexdigest()[:12]}"


def test_sync_client_every_endpoint(cluster):
    client = _sync(cluster)
    assert [m.id for m in client.models.list()] == [MODEL]

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(
                           model=MODEL, messages=MESSAGES, max_tokens=5, stream=True)
                       if c.choices)
    assert streamed == chat.choices[0].message.content  # the sim is deterministic

    text = client.completions.create(model=MODEL, prompt="once upon", max_tokens=4)
    assert text.choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=4, stream=True) if c.choices]
    assert "".join(pieces) == text.choices[0].text

    vectors = client.embeddings.create(model=MODEL, input=["a", "b"])
    assert [d.index for d in vectors.data] == [0, 1] and len(vectors.data[0].embedding) > 0

    ranked = client.post("/rerank", cast_to=object, body=RERANK)
    assert [r["index"] for r in ranked["results"]] == [1, 2, 0]
    heard = client.audio.transcriptions.create(model=MODEL, file=("a.wav", AUDIO, "audio/wav"))
    assert heard.text == HEARD


async def test_async_client_every_endpoint(cluster):
    client = _async(cluster)
    models = [m.id async for m in client.models.list()]
    assert models == [MODEL]

    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                  max_tokens=5, stream=True)
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert streamed == chat.choices[0].message.content

    text = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=4)
    stream = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=4,
                                             stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == \
        text.choices[0].text

    vectors = await client.embeddings.create(model=MODEL, input="one")
    assert len(vectors.data) == 1

    ranked = await client.post("/rerank", cast_to=object, body=RERANK)
    assert [r["index"] for r in ranked["results"]] == [1, 2, 0]
    heard = await client.audio.transcriptions.create(model=MODEL,
                                                     file=("a.wav", AUDIO, "audio/wav"))
    assert heard.text == HEARD
    await client.close()


def test_retrieve_a_model(cluster):
    """``models.retrieve``: the model as the list has it; a name with a `/` (sent as %2F)
    reaches the route on each server, and one not served is a 404 in OpenAI's envelope."""
    client = _sync(cluster)
    assert client.models.retrieve(MODEL) == next(iter(client.models.list()))
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve(f"org/{MODEL}")
    assert missing.value.body["code"] == "model_not_found"
    assert missing.value.body["message"].startswith(f"the model 'org/{MODEL}' does not exist")
