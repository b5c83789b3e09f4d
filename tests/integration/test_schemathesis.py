"""Schemathesis against a live server, from the OpenAPI document the server serves, with
every one of its checks: no 5xx, every answer as the document describes it (status, media
type, schema, headers), bad input refused and good input taken, credentials enforced,
``Allow`` on a 405.

The document is the one ``GET /openapi.json`` serves (``spec.document`` of the server's
app; ``test_the_server_serves_the_document`` holds the two to be the same). Schemathesis
generates valid and invalid requests from it (``mode: all``: its coverage phase and a
short fuzzing phase), deterministically, and sends them to real processes.
"""

from __future__ import annotations

import copy
import re
import warnings

import httpx
import pytest
import schemathesis
from litestar.routes import ASGIRoute, WebSocketRoute

from llmgw.config import ServerConfig
from llmgw.core.catalog import Catalog
from llmgw.server.app import build
from llmgw.server.openai import spec
from tests.integration.conftest import one_node_cluster

MODEL = "sim-fuzz"
# Unpaced, so a generated request is answered at once.
FUZZ_MODEL = {"name": MODEL, "replicas": 1, "profiles": [
    {"engine": "sim", "args": ["--tokens-per-second", "0"]}]}

# Operations that refuse, with a 400, some bodies JSON Schema cannot tell from good ones:
# a key naming a model this cluster does not serve; a model breaking server.yaml's rules
# across fields (a GPU engine with `gpus: 0`); a password change asked with the admin
# token, which has no password. Everything else schema-valid must be taken.
BEYOND_THE_SCHEMA = [("POST", "/api/keys"), ("POST", "/api/models"),
                     ("PUT", "/api/me/password")]
# positive_data_acceptance's own list (a 5xx fails not_a_server_error), and 400.
POSITIVE_STATUSES = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx", "400"]

# max-examples bounds the fuzzing phase alone: the coverage phase sends every operation its
# boundary and invalid cases whatever it is. 12 fuzzed cases an operation (deterministic)
# still draw both a valid and an invalid request for every operation that has anything to
# make invalid, as 30 did.
CONFIG = {
    "seed": 20_240_601,
    "generation": {"mode": "all", "max-examples": 12, "deterministic": True,
                   "database": "none"},
    "request-timeout": 20,
    "operations": [
        {"include-method": method, "include-path": path,
         "checks": {"positive_data_acceptance": {"expected-statuses": POSITIVE_STATUSES}}}
        for method, path in BEYOND_THE_SCHEMA],
}


def server_app():
    """The app as ``llmgw server`` builds it (never started here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return build(ServerConfig(), None, Catalog(), "unused").app  # type: ignore[arg-type]


DOCUMENT = spec.document(server_app())


def _fuzzed(document: dict) -> dict:
    """The document as fuzzed. A model's endpoints are on loopback. A valid /v1 request
    names the model this cluster serves:
    any other is a 404, and would never reach an engine. And the counts the sim engine
    reads (``max_tokens``, ``dimensions``) are left out: it takes ``16`` but refuses the
    ``16.0`` JSON Schema calls an integer too, and generates as many tokens as asked, up
    to 32768; what the gateway itself does with a /v1 body does not depend on them."""
    fuzzed = copy.deepcopy(document)
    schemas = fuzzed["components"]["schemas"]
    for name in ("ChatRequest", "CompletionRequest", "EmbeddingRequest", "AnyRequest",
                 "AnyForm"):
        fields = schemas[name]["properties"]
        fields["model"] = {"enum": [MODEL]}
        for count in ("max_tokens", "max_completion_tokens", "dimensions"):
            fields.pop(count, None)
    # A model's static endpoints are checked by the server: never anything but loopback
    # (port 9, where nothing listens), whatever URL a case would make up.
    schemas["Endpoint"]["properties"]["url"] = {"enum": ["http://127.0.0.1:9/v1"]}
    return fuzzed


def _template(route) -> str:
    """A route's path as OpenAPI writes it: ``/x/{name}`` for Litestar's ``/x/{name:type}``,
    and ``/x/{path}`` for an ASGI app mounted at ``/x``."""
    path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
    if isinstance(route, ASGIRoute) and route.route_handler.is_mount:
        path = path.rstrip("/") + "/{path}"
    return path


def test_every_route_is_in_the_document():
    """A new route without its operation fails here, so the fuzzing never silently skips
    it; and every operation that takes a body says what the body is."""
    app = server_app()
    served = {"/openapi.json", "/openapi.json/openapi.json", "/openapi.json/{path}",
              "/metrics"}  # the document itself; Prometheus' text format
    # The cluster page (/ and /ui) answers HTML for browsers: not part of the API.
    routes = {_template(r) for r in app.routes
              if not isinstance(r, WebSocketRoute)
              and r.path != "/" and not r.path.startswith("/ui")} - served
    assert routes == set(DOCUMENT["paths"])
    without_body = {(method, path) for path, item in DOCUMENT["paths"].items()
                    for method, operation in item.items()
                    if method in ("post", "put", "patch") and "requestBody" not in operation}
    # These read no body: who is asking, and the path, say it all.
    assert without_body == {("post", "/api/auth/logout"), ("post", "/api/nodes/{node_id}/drain"),
                            ("post", "/api/nodes/{node_id}/undrain"),
                            ("post", "/api/nodes/{node_id}/upgrade"),
                            ("post", "/api/nodes/{name}/revoke")}
    guarded = {(method, path) for path, item in DOCUMENT["paths"].items()
               for method, operation in item.items() if operation.get("security")}
    assert {("get", "/api/status"), ("post", "/v1/chat/completions"),
            ("get", "/v1/models")} <= guarded


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    # The cheapest argon2 the config allows: many generated users and passwords.
    cheap = {
        "auth": {"argon2_memory_kib": 19 * 1024, "argon2_time_cost": 2,
                 "argon2_parallelism": 1},
    }
    with one_node_cluster(tmp_path_factory.mktemp("fuzz"), request, [FUZZ_MODEL],
                          cheap) as c:
        yield c


def test_the_server_serves_the_document(cluster):
    served = httpx.get(f"{cluster.base_url}/openapi.json", timeout=30)
    assert served.status_code == 200, served.text
    assert served.headers["content-type"].startswith("application/vnd.oai.openapi+json")
    assert served.json() == DOCUMENT


# Loaded at import: the document needs no server. The server's address comes per call.
# (Not `schemathesis.pytest.from_fixture`: in 4.32.5 it sets `Function._nodeid`, which
# pytest 9 no longer has.)
schema = schemathesis.openapi.from_dict(_fuzzed(DOCUMENT),
                                        config=schemathesis.Config.from_dict(CONFIG))


# The cluster's credentials, once it is up: an API key for /v1, the admin token for /api.
TOKENS: dict[str, str] = {}


@schema.auth(refresh_interval=None)
class Credentials:
    """Schemathesis' credentials, so that its ``ignored_auth`` check can take them away
    (and send made-up ones) to see each guarded operation refuse."""

    def get(self, case, ctx) -> str:
        # Asked at collection too, before any cluster runs: nothing to send yet.
        return TOKENS.get("v1" if case.path.startswith("/v1") else "api", "")

    def set(self, case, data: str, ctx) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


@schema.parametrize()
def test_the_api_is_as_its_document_says(case, cluster):
    TOKENS.update(v1=cluster.api_key, api=cluster.admin_token)
    case.call_and_validate(base_url=cluster.base_url)
