"""Static endpoints as server.yaml and POST /api/models declare them: what is refused
(naming the key path), what a model of endpoints alone is (no replica), the bytes a
request to one carries (its path, Host and key; a replica's unchanged), the router
holding them beside replicas, key files read (a missing or unusable one refused naming
its key), and what the models API refuses of them."""

from __future__ import annotations

import msgspec
import pytest
import yaml

from llmgw.config import ConfigError, Model, ServerConfig, parse
from llmgw.core.catalog import CatalogError, catalog_from_config
from llmgw.core.endpoints import endpoint_name, model_of_endpoint
from llmgw.server.admin.models import checked_model
from llmgw.server.endpoints import Secrets, StaticEndpoints, config_secrets
from llmgw.server.errors import ApiError
from llmgw.server.openai.proxy import body_for
from llmgw.server.openai.router import Router
from llmgw.transport.pool import request_bytes
from llmgw.transport.target import Target


def catalog_of(text: str):
    return catalog_from_config(parse(yaml.safe_load(text), ServerConfig).models)


def refusal_of(text: str) -> str:
    with pytest.raises(CatalogError) as caught:
        catalog_of(text)
    return str(caught.value)


def one(endpoint: str, extra: str = "") -> str:
    return f"models:\n  - name: remote\n{extra}    endpoints:\n      - {endpoint}\n"


def test_a_model_of_endpoints_alone_runs_no_replica():
    [model] = catalog_of(one("{url: 'https://api.example.com/openai/v1/', model: gpt-x, "
                             "slots: 8, api_key_file: /run/k}")).models
    assert (model.replicas, model.profiles) == (0, ())
    [endpoint] = model.endpoints
    assert endpoint.url == "https://api.example.com/openai/v1"
    address = endpoint.address
    assert (address.host, address.port, address.path, address.tls) == (
        "api.example.com", 443, "/openai/v1", True)
    assert address.host_header == "api.example.com"
    assert (endpoint.model, endpoint.slots, endpoint.api_key_file) == ("gpt-x", 8, "/run/k")
    [plain] = catalog_of(one("{url: 'http://[::1]:8000/v1'}")).models[0].endpoints
    assert (plain.address.host, plain.address.host_header) == ("::1", "[::1]:8000")


def test_a_model_with_profiles_and_endpoints_keeps_its_replicas():
    [model] = catalog_of("models:\n  - name: both\n    replicas: 2\n    profiles: "
                         "[{engine: sim}]\n    endpoints: [{url: 'http://h:1/v1'}]\n").models
    assert (model.replicas, len(model.endpoints)) == (2, 1)


@pytest.mark.parametrize(("written", "words"), [
    ("{url: 'ftp://h/v1'}", "models[0].endpoints[0].url: 'ftp://h/v1' is not an http:// or "
                            "https:// URL"),
    ("{url: 'http:///v1'}", "names no host"),
    ("{url: 'http://me:pw@h/v1'}", "holds a user or password: drop it, and put the API key"),
    ("{url: 'http://h/v1?x=1'}", "has a query or fragment"),
    ("{url: 'http://h:99999/v1'}", "is not a URL"),
    # What would break a request's head, or be dropped by urlsplit without a word.
    ("{url: 'http://a b/v1'}", "holds a space, a line break or a character no host name"),
    ('{url: "http://h/v1\\r\\nX-Injected: 1"}', "holds a space, a line break"),
    ("{url: 'http://h/v1/caf\u00e9'}", "has a path with characters a URL must %-escape"),
    ("{url: 'http://h:8000/'}", "has no path: requests to it would go to /chat/completions;"
                                " write the base URL an OpenAI client would use, usually "
                                "ending in /v1 (http://h:8000/v1)"),
    ("{url: 'http://h/v1', ca_file: /ca.pem}", "models[0].endpoints[0].ca_file is set but "
                                               "the URL is http://"),
    ("{url: 'http://h/v1', api_key_file: ''}", "models[0].endpoints[0].api_key_file is empty"),
])
def test_an_endpoint_written_wrong_is_refused_naming_its_key(written, words):
    assert words in refusal_of(one(written))


def test_the_same_url_twice_is_refused():
    text = ("models:\n  - name: m\n    endpoints: [{url: 'http://h/v1'}, "
            "{url: 'http://h/v1/'}]\n")
    assert refusal_of(text).startswith("models[0].endpoints[1].url: http://h/v1 is listed "
                                       "twice in this model")


def test_a_model_with_neither_profiles_nor_endpoints_is_refused_naming_both():
    assert refusal_of("models:\n  - name: m\n") == (
        "models[0]: the model has neither profiles (engines llmgw runs) nor endpoints "
        "(servers someone else runs, by URL); give one or both")


def test_replicas_of_a_model_without_profiles_are_refused():
    assert refusal_of(one("{url: 'http://h/v1'}", "    replicas: 3\n")).startswith(
        "models[0].replicas is 3 but the model has no profiles")


def test_an_endpoint_s_request_carries_its_path_host_and_key_and_a_replica_s_none():
    target = Target("10.0.0.5", 8000, "/openai/v1", "api.example.com", api_key="sk-1")
    sent = target.request("/v1/chat/completions", b"{}", b"application/json")
    assert sent == (b"POST /openai/v1/chat/completions HTTP/1.1\r\nhost: api.example.com"
                    b"\r\nauthorization: Bearer sk-1\r\ncontent-type: application/json\r\n"
                    b"accept: application/json\r\ncontent-length: 2\r\n\r\n{}")
    assert target.get("/v1/models").startswith(b"GET /openai/v1/models HTTP/1.1\r\n")
    assert "sk-1" not in repr(target)
    # A replica's request: no key, no prefix, as before.
    assert request_bytes("10.0.0.5", 8000, "/v1/chat/completions", b"{}",
                         b"application/json") == (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.5:8000\r\ncontent-type: "
        b"application/json\r\naccept: application/json\r\ncontent-length: 2\r\n\r\n{}")


def test_the_router_holds_endpoints_beside_replicas(tmp_path):
    catalog = catalog_of("models:\n  - name: m\n    profiles: [{engine: sim}]\n"
                         "    endpoints: [{url: 'http://h:1/v1', slots: 5, model: up}]\n")
    endpoints = StaticEndpoints()
    routes = endpoints.routes(catalog, servers=2)
    [(name, host, port, slots, remote)] = routes["m"]
    assert (name, host, port, slots) == ("m@endpoint-0", "h", 1, 3)  # half, rounded up
    assert model_of_endpoint(name) == "m" and model_of_endpoint("m-e3") is None
    router = Router()
    router.update({"m": [("m-e1", "127.0.0.1", 9000, None), *routes["m"]]})
    leases = [router.pick("m", exclude={"m-e1"}), router.pick("m", exclude={name})]
    assert [lease.endpoint.remote for lease in leases] == [remote, None]
    assert leases[0].endpoint.slots == 3
    for lease in leases:
        lease.release()


def test_the_body_names_the_endpoint_s_model_only_where_it_has_its_own():
    ask = type("Ask", (), {"model": "m", "body": b'{"model":"m","x":1}',
                           "content_type": b"application/json"})()
    assert body_for(ask, None) is ask.body and body_for(ask, "m") is ask.body
    assert msgspec.json.decode(body_for(ask, "up")) == {"model": "up", "x": 1}


def test_key_files_are_read_and_one_that_cannot_be_is_refused_naming_its_key(tmp_path):
    good = tmp_path / "good"
    good.write_text("sk-abc\n")
    models = parse({"models": [
        {"name": "a", "endpoints": [{"url": "http://h/v1", "api_key_file": str(good)}]},
        {"name": "b", "endpoints": [{"url": "http://h/v1"},
                                    {"url": "http://i/v1",
                                     "api_key_file": str(tmp_path / "absent")}]},
    ]}, ServerConfig).models
    with pytest.raises(ConfigError) as caught:
        config_secrets(models, "server.yaml")
    assert str(caught.value) == (
        f"server.yaml: models[1].endpoints[1].api_key_file: cannot read {tmp_path}/absent: "
        "No such file or directory; write the endpoint's API key there, or drop api_key_file")
    secrets = config_secrets(models[:1])
    assert secrets.keys == {str(good): "sk-abc"} and "sk-abc" not in repr(secrets)
    two_words = tmp_path / "two"
    two_words.write_text("sk-abc\nX-Evil: 1\n")
    models[0].endpoints[0].api_key_file = str(two_words)
    with pytest.raises(ConfigError, match="holds more than one word"):
        config_secrets(models[:1])


def test_an_unreadable_key_keeps_the_endpoint_out_of_routing_saying_why(tmp_path):
    catalog = catalog_of(one(f"{{url: 'http://h/v1', api_key_file: {tmp_path}/absent}}"))
    endpoints = StaticEndpoints()
    endpoints.use(Secrets())
    assert endpoints.routes(catalog) == {}
    [model] = catalog.models
    assert endpoints.why_not(model).startswith(
        f"endpoint http://h/v1 cannot be used: cannot read {tmp_path}/absent")
    [state] = endpoints.states(model)
    assert (state.name, state.health) == (endpoint_name("remote", 0), "down")


def test_the_models_api_takes_endpoints_but_no_key_file():
    added = checked_model({"name": "r", "endpoints": [{"url": "http://h/v1"}]})
    assert isinstance(added.model, Model) and added.model.endpoints[0].url == "http://h/v1"
    with pytest.raises(ApiError) as refused:
        checked_model({"name": "r", "endpoints": [{"url": "http://h/v1",
                                                   "api_key_file": "/etc/x"}]})
    assert refused.value.param == "endpoints[0].api_key_file"
    assert "declared in server.yaml" in refused.value.message
    with pytest.raises(ApiError) as refused:
        checked_model({"name": "r", "endpoints": [{"url": "https://h/v1",
                                                   "ca_file": "/nonexistent/ca.pem"}]})
    assert refused.value.param == "endpoints[0].ca_file"
    assert "cannot read CA certificates from /nonexistent/ca.pem" in refused.value.message
