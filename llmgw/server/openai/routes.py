"""``/v1`` routes: authenticate, read just enough of the body to route it, forward it."""

from __future__ import annotations

import difflib
from datetime import UTC, datetime

import msgspec
from litestar import Request, Response, get, post

from llmgw.core.routing import affinity_key
from llmgw.server.auth import bearer, check_api_key
from llmgw.server.errors import ApiError
from llmgw.server.openai.proxy import ClientGone, Retryable, forward
from llmgw.server.openai.router import Saturated

# Replicas tried for one request before giving up, when the first ones refuse outright.
_MAX_ATTEMPTS = 3


class _Head(msgspec.Struct):
    """What routing reads of a request; everything else is the engine's business."""

    model: str | None = None
    stream: bool = False
    # Kept raw: whether they are there is all routing needs to know.
    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()
    # Raw too: only a key for affinity, whatever type a client sends.
    user: msgspec.Raw = msgspec.Raw()


_head_decoder = msgspec.json.Decoder(_Head)


def _parse(body: bytes, required: str | None) -> _Head:
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        head = _head_decoder.decode(body)
    except msgspec.ValidationError as err:
        text = str(err)
        field = text.rsplit("$.", 1)[-1].rstrip("`") if "$." in text else None
        if field is None and "Expected `object`" in text:
            raise ApiError(400, "the request body must be a JSON object",
                           code="invalid_json") from None
        raise ApiError(400, f"invalid request: {text}", param=field,
                       code="invalid_value") from None
    except msgspec.DecodeError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}",
                       code="invalid_json") from None
    if not head.model:
        raise ApiError(400, "the request has no `model`; name one of GET /v1/models",
                       param="model", code="missing_field")
    if required and bytes(getattr(head, required)) in (b"", b"null"):
        raise ApiError(400, f"the request has no `{required}`", param=required,
                       code="missing_field")
    return head


async def _authorize(request: Request) -> list[str] | None:
    """Check the API key; returns the models it may use (``None``: all)."""
    state = request.app.state
    if not state.config.auth.require_api_key:
        return None
    key = bearer(request.headers.get("authorization"))
    if key is None:
        raise ApiError(401, "no API key: send `Authorization: Bearer llmgw_...`",
                       code="missing_api_key")
    record = await check_api_key(state.store, key, datetime.now(UTC))
    if isinstance(record, str):
        raise ApiError(401, record, code="invalid_api_key")
    return record.allowed_models


def _model_or_404(request: Request, name: str, allowed: list[str] | None) -> None:
    catalog = request.app.state.controller.catalog
    visible = [m for m in catalog.names() if allowed is None or m in allowed]
    if name in visible:
        return
    if catalog.get(name) is not None:
        raise ApiError(403, f"this API key may not use model {name!r}", param="model",
                       code="model_not_allowed")
    close = difflib.get_close_matches(name, visible, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else (
        f"; available: {', '.join(visible)}" if visible else "; no models are declared")
    raise ApiError(404, f"the model {name!r} does not exist{hint}", param="model",
                   code="model_not_found")


async def _proxy(request: Request, path: str, required: str | None) -> Response:
    allowed = await _authorize(request)
    body = await request.body()
    head = _parse(body, required)
    _model_or_404(request, head.model, allowed)
    state = request.app.state
    key = (affinity_key(bytes(head.user), bytes(head.messages) or bytes(head.prompt))
           if state.config.gateway.affinity else None)
    tried: set[str] = set()
    refusals = []
    for _ in range(_MAX_ATTEMPTS):
        try:
            lease = await state.router.acquire(head.model, key, exclude=tried)
        except Saturated as err:
            raise ApiError(429, str(err), code=err.code,
                           headers={"retry-after": str(err.retry_after_s)}) from None
        if lease is None:
            break
        try:
            return await forward(state.http, lease, path, body, head.stream,
                                 state.config.gateway, request.receive)
        except Retryable as err:
            refusals.append(str(err))
            tried.add(lease.replica)
        except ClientGone:
            # Nobody to answer; 499 as nginx logs it, for the access log only.
            return Response(b"", status_code=499)
    why = "; ".join(refusals) if refusals else state.controller.why_not_ready(head.model)
    raise ApiError(503, f"no replica of {head.model!r} can take the request: {why}",
                   code="no_ready_replica", headers={"retry-after": "5"})


@post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _proxy(request, "/v1/chat/completions", "messages")


@post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _proxy(request, "/v1/completions", "prompt")


@post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    return await _proxy(request, "/v1/embeddings", "input")


@post("/v1/{path:path}")
async def any_model_endpoint(request: Request, path: str) -> Response:
    """Any other POST under /v1 that names a ``model`` (responses, rerank, audio …) goes to
    an engine serving that model as it is: new endpoints work without a new llmgw."""
    return await _proxy(request, "/v1" + path, None)


@get("/v1/models")
async def list_models(request: Request) -> dict:
    allowed = await _authorize(request)
    catalog = request.app.state.controller.catalog
    created = int(request.app.state.started_at)
    return {
        "object": "list",
        "data": [
            {"id": m.name, "object": "model", "created": created, "owned_by": "llmgw"}
            for m in catalog.models
            if allowed is None or m.name in allowed
        ],
    }


ROUTES = [chat_completions, completions, embeddings, list_models, any_model_endpoint]
