"""The ``/v1`` half of the server's OpenAPI document.

The gateway's POST handlers are raw ASGI (``routes.py``): Litestar does not see their
bodies, so it cannot describe them. This module does, as the OpenAI API shapes llmgw takes:
what the gateway itself reads (``model``, ``stream``, ``user`` and the endpoint's own
field) and what an engine behind it checks of the rest (the sim engine holds to these; a
real one may take more, and refuses what it does not take with a 4xx of its own). Every
other OpenAI field is passed to the engine as it is, so the objects stay open.

``GatewayDocument`` serves Litestar's document (``/api``, ``/healthz``) with these paths
and schemas merged in; the types below exist for the document only, the gateway never
decodes with them.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import msgspec
from litestar import Litestar, Request
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import SecurityScheme

from llmgw.server.errors import ErrorEnvelope, refusals

ModelName = Annotated[str, msgspec.Meta(min_length=1,
                                        description="a model of GET /v1/models")]
Count = Annotated[int, msgspec.Meta(ge=1)]
Stream = Annotated[bool, msgspec.Meta(
    description="server-sent events, a chunk each, instead of one answer")]
# Any JSON value: the gateway only compares it.
User = Annotated[Any, msgspec.Meta(
    description="requests with the same `user` go to the same replica while it is not "
                "overloaded: its prefix cache holds their conversation")]

# --- requests ----------------------------------------------------------------------------------


class ContentPart(msgspec.Struct):
    """One part of a message: text, or an image, audio … (the engine reads those)."""

    type: str = "text"
    text: str = ""


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(msgspec.Struct):
    # A last event with the whole stream's usage.
    include_usage: bool = False


class ChatRequest(msgspec.Struct):
    """``POST /v1/chat/completions``."""

    model: ModelName
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    stream: Stream = False
    stream_options: StreamOptions | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    user: User = None


class CompletionRequest(msgspec.Struct):
    """``POST /v1/completions``."""

    model: ModelName
    prompt: str | list[str]
    stream: Stream = False
    stream_options: StreamOptions | None = None
    max_tokens: Count | None = None
    user: User = None


class EmbeddingRequest(msgspec.Struct):
    """``POST /v1/embeddings``."""

    model: ModelName
    input: str | Annotated[list[str], msgspec.Meta(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: User = None


class AnyRequest(msgspec.Struct):
    """Any other endpoint an engine serves below /v1 (``rerank``, ``responses`` …): the
    gateway routes it by its ``model`` and passes the rest on."""

    model: ModelName
    stream: Stream = False
    user: User = None


class AnyForm(msgspec.Struct):
    """A multipart/form-data body (an audio upload): routed by its ``model`` field."""

    model: ModelName
    # ``true`` streams the answer; anything else does not.
    stream: str = "false"


# --- answers -----------------------------------------------------------------------------------


class Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class AnswerMessage(msgspec.Struct):
    role: str
    content: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AnswerMessage
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None


class Completion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Embedding(msgspec.Struct):
    object: str
    index: int
    # Floats, or base64 of little-endian float32s with ``encoding_format: base64``.
    embedding: list[float] | str


class Embeddings(msgspec.Struct):
    object: str
    data: list[Embedding]
    model: str
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]


# --- the document ------------------------------------------------------------------------------

# The /v1's API keys (the /api's credentials are the guards').
SECURITY_SCHEMES = {"api_key": SecurityScheme(
    type="http", scheme="bearer",
    description="an API key (`llmgw ctl keys create`), as the OpenAI clients send it")}

# A forwarded path: segments that are not `.` or `..` (refused: they are not forwarded).
_ENGINE_PATH = r"^[A-Za-z0-9_~-][A-Za-z0-9._~-]*(/[A-Za-z0-9_~-][A-Za-z0-9._~-]*)*$"
_GATEWAY_REFUSALS = (400, 401, 403, 404, 413, 429, 502, 503, 504)

_TYPES = (ChatRequest, CompletionRequest, EmbeddingRequest, AnyRequest, AnyForm,
          ChatCompletion, Completion, Embeddings, ModelCard, ModelList, ErrorEnvelope)
# With `"stream": true`: server-sent events, each described here (OpenAPI 3.1 has a
# stream's schema describe one event).
_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk of the answer as "
                            "JSON (`chat.completion.chunk` …); the last event is `[DONE]`"}}}}}


@functools.cache
def gateway() -> tuple[dict[str, Any], dict[str, Any]]:
    """The /v1 paths and the schemas they refer to; made when first served (5 ms that no
    server start should pay)."""
    refs, schemas = msgspec.json.schema_components(
        _TYPES, ref_template="#/components/schemas/{name}")
    ref = dict(zip(_TYPES, refs, strict=True))

    def json_of(kind: type) -> dict[str, Any]:
        return {"application/json": {"schema": ref[kind]}}

    refused = {str(status): {"description": spec.description,
                             "content": json_of(ErrorEnvelope)}
               for status, spec in refusals(*_GATEWAY_REFUSALS).items()}

    def post(summary: str, body: dict[str, Any], answer: dict[str, Any],
             **extra: Any) -> dict[str, Any]:
        return {"post": {
            "summary": summary,
            "operationId": "v1" + "".join(w.title() for w in summary.split()),
            "security": [{"api_key": []}],
            **extra,
            "requestBody": {"required": True, "content": body},
            "responses": {"200": {"description": "the engine's answer", "content": answer},
                          **refused},
        }}

    paths = {
        "/v1/chat/completions": post("Chat completions", json_of(ChatRequest),
                                     {**json_of(ChatCompletion), **_STREAM}),
        "/v1/completions": post("Completions", json_of(CompletionRequest),
                                {**json_of(Completion), **_STREAM}),
        "/v1/embeddings": post("Embeddings", json_of(EmbeddingRequest), json_of(Embeddings)),
        "/v1/{path}": post(
            "Any engine endpoint",
            {**json_of(AnyRequest), "multipart/form-data": {"schema": ref[AnyForm]}},
            {"application/json": {"schema": {}}, **_STREAM},
            parameters=[{"name": "path", "in": "path", "required": True,
                         "description": "the endpoint below /v1, as the engine names it "
                                        "(`rerank`)",
                         "schema": {"type": "string", "pattern": _ENGINE_PATH}}]),
        "/v1/models": {"get": {
            "summary": "Models",
            "operationId": "v1Models",
            "description": "the models this API key may use, and their aliases",
            "security": [{"api_key": []}],
            "responses": {"200": {"description": "the models", "content": json_of(ModelList)},
                          "401": refused["401"]},
        }},
        "/v1/models/{model_id}": {"get": {
            "summary": "Model",
            "operationId": "v1Model",
            "description": "one model (or alias) as GET /v1/models lists it",
            "security": [{"api_key": []}],
            "parameters": [{"name": "model_id", "in": "path", "required": True,
                            "description": "a model's name or alias; it may hold `/`",
                            "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the model", "content": json_of(ModelCard)},
                          "401": refused["401"], "404": refused["404"]},
        }},
    }
    return paths, schemas


def with_gateway(document: dict[str, Any]) -> dict[str, Any]:
    """Litestar's ``document`` with the /v1 operations and their schemas merged in (its
    own GET /v1/models, which knows no answer's shape, replaced), and llmgw's version."""
    import llmgw  # its version is looked up on first use: 50 ms no start should pay

    paths, schemas = gateway()
    components = dict(document.get("components") or {})
    components["schemas"] = {**schemas, **(components.get("schemas") or {})}
    return {**document, "info": {**document["info"], "version": llmgw.__version__},
            "paths": {**document["paths"], **paths}, "components": components}


def document(app: Litestar) -> dict[str, Any]:
    """The document ``app`` serves (built from its handlers, not fetched)."""
    return with_gateway(app.openapi_schema.to_schema())


class GatewayDocument(JsonRenderPlugin):
    """The whole API's OpenAPI document as JSON: Litestar's, ``with_gateway``, made once."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._rendered: bytes | None = None

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        if self._rendered is None:
            self._rendered = self.render_json(request, with_gateway(openapi_schema))
        return self._rendered
