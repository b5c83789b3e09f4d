"""What an API key may see and use of the catalog, and how the gateway refuses a request
it cannot route: each refusal names the field at fault (`param`) and says why (`code`), as
OpenAI's API does, so that a client can tell what to fix. Real processes on loopback (two
sim engines), through the official `openai` client; each refusal is checked to be the
gateway's own, not an engine's: the engine never saw the request."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.conftest import one_node_cluster

SIM_A = {"name": "sim-a", "profiles": [{"engine": "sim"}], "replicas": 1}
SIM_B = {"name": "sim-b", "profiles": [{"engine": "sim"}], "replicas": 1}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    """One cluster for the module: each test makes the keys it needs and counts the
    engines' requests from where it found them."""
    # Both ready: a refusal of sim-b is then about the key, never about a missing replica.
    with one_node_cluster(tmp_path_factory.mktemp("key-models"), request,
                          [SIM_A, SIM_B]) as c:
        yield c


def _client(c, key: str | None = None) -> openai.OpenAI:
    """A client with ``key``, else with the cluster's own key (made with no model list:
    it may use every model)."""
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=key or c.api_key,
                         max_retries=0, timeout=20)


def _key_for(c, *models: str) -> str:
    """A new API key that may use only ``models``, made as an operator would: POST
    /api/keys on the admin API."""
    made = c.admin("POST", "/api/keys", json={"name": "only " + " ".join(models),
                                              "models": list(models)})
    assert made.status_code == 201, made.text
    assert made.json()["models"] == list(models)
    return made.json()["key"]


def _engine_requests(c, model: str) -> int:
    """How many /v1 requests the engine of ``model`` has had (the sim's own count)."""
    [replica] = c.replicas(model)
    [shard] = replica["shards"]
    stats = httpx.get(f"http://127.0.0.1:{shard['port']}/sim/stats", timeout=5).json()
    return stats["requests_total"]


def test_models_lists_only_the_models_the_key_may_use(cluster):
    everything = _client(cluster)
    assert sorted(m.id for m in everything.models.list()) == ["sim-a", "sim-b"]

    only_a = _client(cluster, _key_for(cluster, "sim-a"))
    assert [m.id for m in only_a.models.list()] == ["sim-a"]
    only_b = _client(cluster, _key_for(cluster, "sim-b"))
    assert [m.id for m in only_b.models.list()] == ["sim-b"]


def test_a_key_asking_for_a_model_it_may_not_use_is_refused_403_model_not_allowed(cluster):
    only_a = _client(cluster, _key_for(cluster, "sim-a"))
    engine_b_had = _engine_requests(cluster, "sim-b")

    def refused() -> None:
        with pytest.raises(openai.PermissionDeniedError) as err:
            only_a.chat.completions.create(model="sim-b", messages=HI, max_tokens=4)
        assert err.value.status_code == 403
        assert err.value.body["code"] == "model_not_allowed", err.value.body
        assert err.value.body["param"] == "model", err.value.body

    # A key the server has not read yet: the request goes the task path.
    refused()
    # The model it may use answers, so the refusal is about the model, not the key.
    reply = only_a.chat.completions.create(model="sim-a", messages=HI, max_tokens=4)
    assert reply.choices[0].message.content
    # sim-b serves a key that may use it; that leaves an idle connection to its engine.
    reply = _client(cluster).chat.completions.create(model="sim-b", messages=HI, max_tokens=4)
    assert reply.choices[0].message.content
    # The key was read lately and sim-b's engine has an idle connection: the request is
    # one for the server's callback path (serve_now), which must refuse it too.
    refused()

    # The gateway refused it itself: sim-b's engine saw only the allowed request.
    assert _engine_requests(cluster, "sim-b") == engine_b_had + 1


def test_a_request_without_the_field_its_endpoint_needs_is_refused_naming_it(cluster):
    client = _client(cluster)
    engine_had = _engine_requests(cluster, "sim-a")
    # (NOT_GIVEN leaves the field out of the body; None sends it as null.)
    cases = {
        "chat without messages": ("messages", lambda: client.chat.completions.create(
            model="sim-a", messages=openai.NOT_GIVEN)),
        "chat with messages null": ("messages", lambda: client.chat.completions.create(
            model="sim-a", messages=None)),
        "completion without prompt": ("prompt", lambda: client.completions.create(
            model="sim-a", prompt=openai.NOT_GIVEN)),
        "embedding without input": ("input", lambda: client.embeddings.create(
            model="sim-a", input=openai.NOT_GIVEN)),
    }
    for case, (field, call) in cases.items():
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        body = refused.value.body
        assert (body["param"], body["code"]) == (field, "missing_field"), (case, body)
        assert f"`{field}`" in body["message"], (case, body)
    # The gateway's own refusals (an engine would say the same field, with no code).
    assert _engine_requests(cluster, "sim-a") == engine_had


def test_a_field_of_the_wrong_type_is_refused_naming_it(cluster):
    client = _client(cluster)
    engine_had = _engine_requests(cluster, "sim-a")
    cases = {
        "stream as a string": ("stream", lambda: client.chat.completions.create(
            model="sim-a", messages=HI, extra_body={"stream": "yes"})),
        "model as a number": ("model", lambda: client.chat.completions.create(
            model=5, messages=HI)),
        "model as a list, in an embedding": ("model", lambda: client.embeddings.create(
            model=["sim-a"], input="hi")),
    }
    for case, (field, call) in cases.items():
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        body = refused.value.body
        assert (body["param"], body["code"]) == (field, "invalid_value"), (case, body)
    assert _engine_requests(cluster, "sim-a") == engine_had
