"""Model fallbacks on a real server, agent and sim engines, through the official `openai`
client: a model scaled to 0 answered by its fallback, from a task and from the server's
callback, the header and the answer's `model` naming the fallback; usage counted under
it; a key not allowed the fallback told the model's own refusal; POST /api/models
refusing fallbacks that cannot be followed."""

from __future__ import annotations

import aiohttp
import httpx
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.config import Model
from llmgw.core.catalog import catalog_from_config
from tests.integration.cluster import wait_for
from tests.integration.conftest import one_node_cluster
from tests.integration.gateway_state import engine_answering, gateway_front_in_process

# `primary` has no replica (scaled to 0): its requests go to `backup`.
PRIMARY = {"name": "primary", "fallbacks": ["backup"], "profiles": [{"engine": "sim"}],
           "replicas": 0}
BACKUP = {"name": "backup", "profiles": [{"engine": "sim"}], "replicas": 1}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    with one_node_cluster(tmp_path_factory.mktemp("fallbacks"), request,
                          [PRIMARY, BACKUP], ready={"backup": 1}) as c:
        yield c


def _client(c, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=key, max_retries=0,
                         timeout=20)


def _key_for(c, *models: str) -> tuple[str, str]:
    made = c.admin("POST", "/api/keys", json={"name": "only " + " ".join(models),
                                              "models": list(models)})
    assert made.status_code == 201, made.text
    return made.json()["key"], made.json()["prefix"]


def test_a_model_with_no_replica_is_answered_by_its_fallback_and_counted_as_it(cluster):
    key, prefix = _key_for(cluster, "primary", "backup")
    client = _client(cluster, key)
    # Twice: the second, with the key read and a connection to the engine kept, is sent
    # from the server's callback (serve_now), the first from a task.
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model="primary", messages=HI, max_tokens=3)
        assert raw.headers["x-llmgw-model"] == "backup"
        chat = raw.parse()
        assert chat.model == "backup" and chat.usage.completion_tokens == 3
    with client.chat.completions.with_streaming_response.create(
            model="primary", messages=HI, max_tokens=3, stream=True,
            stream_options={"include_usage": True}) as streamed:
        assert streamed.headers["x-llmgw-model"] == "backup"
        chunks = list(streamed.parse())
    assert {c.model for c in chunks} == {"backup"} and chunks[-1].usage.completion_tokens == 3

    # A model without fallbacks says nothing of it.
    plain = client.chat.completions.with_raw_response.create(
        model="backup", messages=HI, max_tokens=1)
    assert "x-llmgw-model" not in plain.headers

    def recorded():
        usage = cluster.admin("GET", f"/api/keys/{prefix}/usage").json()
        return sum(m["requests"] for m in usage["models"]) >= 4 and usage["models"]
    [used] = wait_for(recorded, 10, "the usage of four requests to be written")
    assert used["model"] == "backup" and used["requests"] == 4
    assert used["completion_tokens"] == 3 * 3 + 1

    # Each step to a fallback is counted, under catalog names only.
    scraped = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    steps = {tuple(sorted(s.labels.items())): s.value
             for f in text_string_to_metric_families(scraped) for s in f.samples
             if s.name == "llmgw_fallbacks_total"}
    assert steps == {(("fallback", "backup"), ("model", "primary")): 3.0}


def test_the_models_api_shows_each_model_s_fallbacks(cluster):
    listed = {m["name"]: m for m in cluster.admin("GET", "/api/models").json()}
    assert (listed["primary"]["fallbacks"], listed["primary"]["aliases"]) == (["backup"], [])
    assert listed["backup"]["fallbacks"] == []


def test_a_key_not_allowed_the_fallback_gets_the_model_s_own_refusal(cluster):
    key, _ = _key_for(cluster, "primary")
    client = _client(cluster, key)
    for _ in range(2):  # the callback path hands it to the task path: the same answer
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model="primary", messages=HI, max_tokens=1)
        assert refused.value.status_code == 503
        body = refused.value.body
        assert body["code"] == "no_ready_replica", body
        assert body["message"] == (
            "no replica of 'primary' can take the request: it is scaled to 0 replicas; scale "
            "it up (`llmgw ctl models scale primary N`), or give it idle_unload_s so that "
            "requests wake it")
        assert "backup" not in body["message"]


def test_a_model_another_falls_back_on_is_not_removed_from_under_it(cluster):
    for model in ({"name": "spare", "aliases": ["spare-alias"], "replicas": 0},
                  {"name": "leaning", "fallbacks": ["spare-alias"], "replicas": 0}):
        added = cluster.admin("POST", "/api/models",
                              json={**model, "profiles": [{"engine": "sim"}]})
        assert added.status_code == 201, added.text
    refused = cluster.admin("DELETE", "/api/models/spare")
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_in_use"
    assert error["message"].startswith("model 'spare' is a fallback of leaning: remove it "
                                       "from their fallbacks first"), error["message"]
    assert "spare" in [m["name"] for m in cluster.admin("GET", "/api/models").json()]
    assert cluster.admin("DELETE", "/api/models/leaning").status_code == 200
    assert cluster.admin("DELETE", "/api/models/spare").status_code == 200


def test_an_added_model_whose_fallbacks_cannot_be_followed_is_refused_naming_them(cluster):
    unknown = {"name": "third", "fallbacks": ["backup", "gpt-5"],
               "profiles": [{"engine": "sim"}], "replicas": 0}
    refused = cluster.admin("POST", "/api/models", json=unknown)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "fallbacks[1]" and error["code"] == "invalid_model"
    assert error["message"].startswith("'gpt-5' is not a model or an alias of one")

    itself = {"name": "third", "fallbacks": ["third"], "profiles": [{"engine": "sim"}],
              "replicas": 0}
    refused = cluster.admin("POST", "/api/models", json=itself)
    assert refused.status_code == 400, refused.text
    assert "'third' is this model itself" in refused.json()["error"]["message"]


async def test_the_callback_path_serves_a_fallback_as_the_task_path_does():
    """In process, on llmgw's server in front of a raw engine: the request for a model
    with no replica goes to its fallback from the server's callback once a connection to
    the fallback's engine is kept, and is answered as from the task path."""
    answer = b'{"model":"served","choices":[]}'
    seen: list[bytes] = []

    async def engine(head, body, reader, writer) -> None:
        seen.append(body)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(answer), answer))

    async with gateway_front_in_process("served", engine_answering(engine)) as running:
        front = running.front
        models = [msgspec.convert({"name": "asked", "fallbacks": ["served"],
                                   "profiles": [{"engine": "sim"}]}, Model),
                  msgspec.convert({"name": "served", "profiles": [{"engine": "sim"}]}, Model)]
        front.state.controller.catalog = catalog_from_config(models)
        url = f"http://127.0.0.1:{running.port}/v1/chat/completions"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for served_now in (0, 1):  # the first from a task; it opens the connection
                async with http.post(url, json={"model": "asked", "messages": HI}) as resp:
                    assert resp.status == 200 and await resp.read() == answer
                    assert resp.headers["x-llmgw-model"] == "served"
                assert front.served_now == served_now
    # The engine was asked for its own model, both times.
    assert [msgspec.json.decode(b)["model"] for b in seen] == ["served", "served"]
