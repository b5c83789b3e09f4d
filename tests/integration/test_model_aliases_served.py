"""GET /v1/models/{id} and model aliases on a real server, agent and sim engines, through
the official `openai` client. The sim engine, like vLLM, refuses a `model` it was not
started with: an alias's request answers only if the gateway forwarded it naming the
model."""

from __future__ import annotations

import hashlib

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import wait_for
from tests.integration.conftest import one_node_cluster

QWEN = "org/qwen3-8b"  # a name with a `/`, as Hugging Face names are
ALIASES = ["gpt-4o-mini", "openai/gpt-4o-mini"]
QWEN_MODEL = {"name": QWEN, "aliases": ALIASES, "profiles": [{"engine": "sim"}],
              "replicas": 1}
SIM_B = {"name": "sim-b", "profiles": [{"engine": "sim"}], "replicas": 1}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    with one_node_cluster(tmp_path_factory.mktemp("aliases"), request,
                          [QWEN_MODEL, SIM_B]) as c:
        yield c


def _client(c, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=key or c.api_key,
                         max_retries=0, timeout=20)


def _key_for(c, *models: str) -> tuple[str, str]:
    """A new API key that may use only ``models`` (names or aliases), and its prefix."""
    made = c.admin("POST", "/api/keys", json={"name": "only " + " ".join(models),
                                              "models": list(models)})
    assert made.status_code == 201, made.text
    return made.json()["key"], made.json()["prefix"]


def test_models_lists_aliases_and_each_key_sees_what_it_may_send(cluster):
    listed = [m.id for m in _client(cluster).models.list()]
    assert listed == [QWEN, *ALIASES, "sim-b"]
    # A key allowed the model may send any of its names; one allowed an alias, that one.
    by_model, _ = _key_for(cluster, QWEN)
    assert [m.id for m in _client(cluster, by_model).models.list()] == [QWEN, *ALIASES]
    by_alias, _ = _key_for(cluster, "gpt-4o-mini")
    assert [m.id for m in _client(cluster, by_alias).models.list()] == ["gpt-4o-mini"]


def test_retrieve_answers_each_listed_model_as_the_list_does(cluster):
    client = _client(cluster)
    listed = {m.id: m for m in client.models.list()}
    for name in (QWEN, *ALIASES, "sim-b"):  # the client sends a `/` as %2F
        assert client.models.retrieve(name) == listed[name]

    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o-mimi")
    body = missing.value.body
    assert (body["code"], body["param"], body["type"]) == (
        "model_not_found", "model", "not_found_error"), body
    assert "'gpt-4o-mimi' does not exist; did you mean gpt-4o-mini" in body["message"]

    # A key not allowed a model does not see it: 404, as the list it gets implies.
    by_alias, _ = _key_for(cluster, "gpt-4o-mini")
    limited = _client(cluster, by_alias)
    assert limited.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    for hidden in (QWEN, "openai/gpt-4o-mini", "sim-b"):
        with pytest.raises(openai.NotFoundError) as refused:
            limited.models.retrieve(hidden)
        assert refused.value.body["code"] == "model_not_found"
        message = refused.value.body["message"]
        assert f"{hidden!r} does not exist or this API key may not use it" in message
        # Only what the key may send is offered.
        assert message.endswith(("; available: gpt-4o-mini", "; did you mean gpt-4o-mini?"))
        assert "sim-b" not in message.replace(f"{hidden!r}", "")

    with pytest.raises(openai.AuthenticationError):
        _client(cluster, "llmgw_not-a-key").models.retrieve(QWEN)


def _scrape(cluster) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_an_alias_is_served_by_its_model_and_counted_as_it(cluster):
    key, prefix = _key_for(cluster, QWEN)  # the model: its aliases are the key's too
    client = _client(cluster, key)
    before = _scrape(cluster)

    # Twice each: the second, with the key read and a connection to the engine kept, is
    # sent from the server's callback (serve_now), the first from a task.
    for alias in ALIASES:
        for _ in range(2):
            chat = client.chat.completions.create(model=alias, messages=HI, max_tokens=3)
            # The answer's `model` is the engine's: the model's own name.
            assert chat.model == QWEN and chat.usage.completion_tokens == 3
    stream = client.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=3,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert {c.model for c in chunks} == {QWEN} and chunks[-1].usage.completion_tokens == 3
    vectors = client.embeddings.create(model="gpt-4o-mini", input=["a", "b"])
    assert len(vectors.data) == 2
    audio = bytes(range(256)) * 8
    heard = client.audio.transcriptions.create(model="openai/gpt-4o-mini",
                                               file=("a.wav", audio, "audio/wav"))
    assert heard.text == f"{len(audio)} bytes of a.wav, sha256 " \
                         f"{hashlib.sha256(audio).hexdigest()[:12]}"

    def recorded():
        usage = cluster.admin("GET", f"/api/keys/{prefix}/usage").json()
        return sum(m["requests"] for m in usage["models"]) >= 7 and usage["models"]
    [used] = wait_for(recorded, 10, "the usage of seven requests to be written")
    assert used["model"] == QWEN and used["requests"] == 7
    assert used["completion_tokens"] == 5 * 3

    after = _scrape(cluster)

    def added(labels: dict) -> float:
        key = ("llmgw_requests_total", tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)
    assert added({"model": QWEN, "kind": "chat", "status": "2xx"}) == 5
    assert added({"model": QWEN, "kind": "embeddings", "status": "2xx"}) == 1
    # No series is labelled with a name the request sent.
    assert not [k for k in after if any(v in ALIASES for _, v in k[1])]


def test_a_key_may_send_an_alias_when_it_names_the_model_or_that_alias(cluster):
    by_model, _ = _key_for(cluster, QWEN)
    chat = _client(cluster, by_model).chat.completions.create(
        model="gpt-4o-mini", messages=HI, max_tokens=2)
    assert chat.choices[0].message.content

    by_alias = _client(cluster, _key_for(cluster, "gpt-4o-mini")[0])
    assert by_alias.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=2)
    for other in (QWEN, "openai/gpt-4o-mini"):  # the model's other names are not the key's
        with pytest.raises(openai.PermissionDeniedError) as refused:
            by_alias.chat.completions.create(model=other, messages=HI, max_tokens=2)
        assert refused.value.body["code"] == "model_not_allowed"
        assert f"may not use model {other!r}" in refused.value.body["message"]


def test_an_added_model_whose_name_or_alias_is_taken_is_refused_naming_both(cluster):
    taken = {"name": "gpt-4o-mini", "profiles": [{"engine": "sim"}], "replicas": 0}
    refused = cluster.admin("POST", "/api/models", json=taken)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["param"] == "name"
    assert error["message"].startswith(
        f"name 'gpt-4o-mini' of model 'gpt-4o-mini' is already an alias of model {QWEN!r}")

    aliased = {"name": "llama", "aliases": ["gpt-4o", "sim-b"], "profiles": [{"engine": "sim"}],
               "replicas": 0}
    refused = cluster.admin("POST", "/api/models", json=aliased)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["param"] == "aliases[1]"
    assert error["message"].startswith("alias 'sim-b' of model 'llama' is already model 'sim-b'")
    assert [m.id for m in _client(cluster).models.list()] == [QWEN, *ALIASES, "sim-b"]
