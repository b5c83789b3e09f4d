"""Schemathesis against a live server: no request to ``/v1`` or ``/api`` gets a 5xx.

The server serves no OpenAPI document (``openapi_config=None``), its ``/v1`` gateway
handlers are raw ASGI (invisible to OpenAPI), and its ``/api`` handlers take the raw
``Request`` and decode bodies themselves. So the document here is assembled: Litestar's
for the server's own HTTP handlers (paths, methods, path parameters), the ``/v1`` POST
operations described by hand with the fields the gateway reads, and every request body
filled in from what the handler decodes (the admin API's ``Input`` structs, as msgspec
JSON Schema). Schemathesis then generates valid and invalid requests from it (``mode:
all``: its coverage phase and a short fuzzing phase), deterministically, and sends them
to real processes.
"""

from __future__ import annotations

import re
import warnings

import msgspec
import pytest
import schemathesis
from litestar import Litestar
from litestar.openapi import OpenAPIConfig
from litestar.routes import ASGIRoute, HTTPRoute, WebSocketRoute
from schemathesis.checks import not_a_server_error

from llmgw import config
from llmgw.config import ServerConfig
from llmgw.core.catalog import Catalog
from llmgw.server.admin import accounts, join, keys, models
from llmgw.server.app import build
from tests.integration.conftest import one_node_cluster

MODEL = "sim-fuzz"
# Unpaced, so a generated request is answered at once.
FUZZ_MODEL = {"name": MODEL, "replicas": 1, "profiles": [
    {"engine": "sim", "args": ["--tokens-per-second", "0"]}]}

# What each handler that takes a body decodes. A new one without an entry fails
# test_every_route_and_body_is_described, so the fuzzing never silently skips its body.
ADMIN_BODIES: dict[tuple[str, str], type] = {
    ("post", "/api/auth/login"): accounts.Credentials,
    ("post", "/api/auth/token"): accounts.Credentials,
    ("post", "/api/auth/signup"): accounts.Signup,
    ("put", "/api/me/password"): accounts.PasswordChange,
    ("post", "/api/users"): accounts.NewUser,
    ("patch", "/api/users/{username}"): accounts.UserChange,
    ("post", "/api/invites"): accounts.NewInvite,
    ("put", "/api/settings"): accounts.Settings,
    ("post", "/api/keys"): keys.NewKey,
    ("patch", "/api/keys/{prefix}"): keys.KeyChange,
    ("post", "/api/models"): config.Model,
    ("patch", "/api/models/{name}"): models.Scale,
    ("post", "/api/nodes/{name}/join-tokens"): join.JoinTokenInput,
    ("post", "/api/join"): join.JoinInput,
}
# Rules the handlers check beyond the structs' types: generated values that keep them get
# past validation into the code behind it.
FIELD_RULES = {"username": {"pattern": "^[a-z][a-z0-9._-]{1,30}$"}}
# These take no body (or ignore it).
NO_BODY = {("post", "/api/auth/logout"), ("post", "/api/nodes/{node_id}/drain"),
           ("post", "/api/nodes/{node_id}/undrain"), ("post", "/api/nodes/{name}/revoke")}

_TEXT = {"type": "string", "maxLength": 64}
_MESSAGES = {"type": "array", "minItems": 1, "maxItems": 3, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": _TEXT}}}
_TEXTS = {"anyOf": [_TEXT, {"type": "array", "maxItems": 3, "items": _TEXT}]}


def _v1_body(field: str | None, schema: dict | None) -> dict:
    """What the gateway reads of a /v1 body. No ``max_tokens``: the sim would generate as
    many as it is asked for, and that is the engine's business, not the gateway's."""
    properties = {
        # Valid requests name the real model and are forwarded; invalid ones name others.
        "model": {"enum": [MODEL]},
        "stream": {"type": "boolean"},
        "user": _TEXT,
    }
    if field is not None:
        properties[field] = schema
    return {"type": "object", "required": ["model", *([field] if field else [])],
            "properties": properties}


V1_BODIES = {
    ("post", "/v1/chat/completions"): _v1_body("messages", _MESSAGES),
    ("post", "/v1/completions"): _v1_body("prompt", _TEXTS),
    ("post", "/v1/embeddings"): _v1_body("input", _TEXTS),
    ("post", "/v1/{path}"): _v1_body(None, None),
}

CONFIG = {
    "seed": 20_240_601,
    "generation": {"mode": "all", "max-examples": 30, "deterministic": True,
                   "database": "none"},
    "request-timeout": 20,
}


def _template(route) -> str:
    """A route's path as OpenAPI writes it: ``/x/{name}`` for Litestar's ``/x/{name:type}``,
    and ``/x/{path}`` for an ASGI app mounted at ``/x``."""
    path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
    if isinstance(route, ASGIRoute) and route.route_handler.is_mount:
        path = path.rstrip("/") + "/{path}"
    return path


def server_routes() -> list:
    """The routes of a server as ``llmgw server`` builds it (never started here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        app = build(ServerConfig(), None, Catalog(), "unused").app  # type: ignore[arg-type]
    return app.routes


def litestar_schema() -> dict:
    """The OpenAPI document Litestar makes of the server's HTTP handlers."""
    handlers = [h for route in server_routes() if isinstance(route, HTTPRoute)
                for h in route.route_handlers if h.http_methods != {"OPTIONS"}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        app = Litestar(route_handlers=handlers,
                       openapi_config=OpenAPIConfig(title="llmgw", version="test"))
        return app.openapi_schema.to_schema()


def _v1_operation(path: str) -> dict:
    params = re.findall(r"\{(\w+)\}", path)
    return {"post": {
        "operationId": "v1" + re.sub(r"\W+", "_", path),
        "parameters": [{"name": p, "in": "path", "required": True,
                        "schema": {"type": "string", "minLength": 1}} for p in params],
        "responses": {"200": {"description": "the engine's answer"}},
    }}


def described_schema() -> dict:
    """Litestar's document, plus the /v1 operations, with each body described."""
    document = litestar_schema()
    for _, path in V1_BODIES:
        document["paths"][path] = _v1_operation(path)
    refs, components = msgspec.json.schema_components(
        list(ADMIN_BODIES.values()), ref_template="#/components/schemas/{name}")
    for component in components.values():
        for name, rules in FIELD_RULES.items():
            if name in component["properties"]:
                component["properties"][name].update(rules)
    document.setdefault("components", {}).setdefault("schemas", {}).update(components)
    bodies = {**dict(zip(ADMIN_BODIES, refs, strict=True)), **V1_BODIES}
    for (method, path), body in bodies.items():
        operation = document["paths"][path][method]
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": body}}}
    return document


def test_every_route_and_body_is_described():
    """A new route or body makes this fail, so the fuzzing never silently skips it."""
    routes = {_template(r) for r in server_routes()
              if not isinstance(r, WebSocketRoute) and r.path != "/metrics"}
    document = described_schema()
    assert routes == set(document["paths"])
    assert {_template(r) for r in server_routes() if isinstance(r, ASGIRoute)} == {
        path for _, path in V1_BODIES}
    writes = {(method, path) for path, operations in litestar_schema()["paths"].items()
              for method in operations if method in ("post", "put", "patch")}
    assert writes == set(ADMIN_BODIES) | NO_BODY


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


# Loaded at import: the document needs no server. The server's address comes per call.
# (Not `schemathesis.pytest.from_fixture`: in 4.32.5 it sets `Function._nodeid`, which
# pytest 9 no longer has.)
schema = schemathesis.openapi.from_dict(described_schema(),
                                        config=schemathesis.Config.from_dict(CONFIG))


@schema.parametrize()
def test_no_server_errors(case, cluster):
    token = cluster.api_key if case.path.startswith("/v1") else cluster.admin_token
    case.call_and_validate(base_url=cluster.base_url,
                           headers={"authorization": f"Bearer {token}"},
                           checks=[not_a_server_error])
