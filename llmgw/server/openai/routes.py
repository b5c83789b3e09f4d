"""``/v1`` routes: authenticate, read just enough of the body to route it, forward it."""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Callable

import msgspec
import multipart
from litestar import Request, asgi, get
from litestar.types import ASGIApp, Receive, Scope, Send

from llmgw.core.catalog import may_use
from llmgw.core.usage import StreamUsage, Usage, answer_of, usage_from_body
from llmgw.server.dependencies import from_states
from llmgw.server.errors import ApiError, store_refusal
from llmgw.server.metrics import Metrics, endpoint_kind
from llmgw.server.openai.admission import (
    Ask,
    GatewayContext,
    Head,
    admit,
    authorize,
    decide,
    fall_back,
    no_replica,
    not_listed,
)
from llmgw.server.openai.direct import REFUSED, Exchange
from llmgw.server.openai.proxy import ACCEPT_STREAM, Retryable, forward
from llmgw.server.openai.router import Lease
from llmgw.server.openai.timing import StreamClock
from llmgw.server.openai.trail import Done, Origin
from llmgw.server.openai.usage import UsageRecorder
from llmgw.store import ApiKeyRecord, StoreUnavailable
from llmgw.transport.pool import JSON_TYPE, request_bytes
from llmgw.transport.writer import BODY_WRITER, BodyWriter

log = logging.getLogger(__name__)

# The largest request body taken: prompts with images run to megabytes, not more.
MAX_BODY = 32 * 2**20


class ClientGone(Exception):
    """The client went away before its answer was done; nothing more is sent."""

# Replicas of one model tried for a request before giving up on it (or going on to its
# fallback), when the first ones refuse outright.
_MAX_ATTEMPTS = 3
# Under a server that offers no BodyWriter: how long a request runs before its client is
# watched for leaving, well within the second in which an abandoned request must be closed
# upstream.
_WATCH_AFTER_S = 0.2


_head_decoder = msgspec.json.Decoder(Head)

# msgspec's decoder recurses once a level of nesting, what it passes over included, as far
# as CPython's recursion limit lets it (1,000 frames less the server's own: about 980
# levels on Python 3.11), then raises RecursionError. That is the gateway's bound: an
# OpenAI request nests six levels or so, a tool's JSON schema a few more, and a lower
# bound of llmgw's own would mean walking every body (5 times the decode's CPU).
TOO_DEEP = ("the JSON body is nested too deeply: the gateway reads JSON nested several "
            "hundred levels, far more than any OpenAI request needs")


def _parse(body: bytes, required: str | None) -> Head:
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    if not body.isascii():
        # msgspec checks the UTF-8 only of the strings it makes (`model`): what it passes
        # over (the messages, any field routing does not read) would reach the engine
        # unchecked. isascii() costs 0.07 µs a KB; only a body that is not ASCII is
        # decoded (about 0.5 µs a KB), and the str made is dropped.
        try:
            body.decode()
        except UnicodeDecodeError as err:
            raise ApiError(400, f"the request body is not valid UTF-8 ({err.reason} at "
                           f"byte {err.start}); a JSON body must be UTF-8",
                           code="invalid_json") from None
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
    except RecursionError:
        raise ApiError(400, TOO_DEEP, code="invalid_json") from None
    if not head.model:
        raise ApiError(400, "the request has no `model`; name one of GET /v1/models",
                       param="model", code="missing_field")
    if required and bytes(getattr(head, required)) in (b"", b"null"):
        raise ApiError(400, f"the request has no `{required}`", param=required,
                       code="missing_field")
    return head


# What routing reads of a multipart/form-data body (an audio upload, say): the same
# fields as of a JSON one, each a plain form field.
_FORM_FIELDS = frozenset({"model", "stream", "user"})
_FORM = b"multipart/form-data"


def _parse_form(body: bytes, content_type: bytes) -> Head:
    """``model``, ``stream`` and ``user`` of a multipart/form-data body; the files in it
    are only scanned past (the engine reads them)."""
    _, options = multipart.parse_options_header(content_type.decode("latin-1"))
    if not options.get("boundary"):
        raise ApiError(400, "the multipart/form-data body has no boundary in its "
                       "Content-Type", code="invalid_body")
    fields: dict[str, bytes] = {}
    try:
        with multipart.PushMultipartParser(options["boundary"], len(body)) as parser:
            name = None
            for event in parser.parse(body):
                if isinstance(event, multipart.MultipartSegment):
                    name = event.name if (event.filename is None
                                          and event.name in _FORM_FIELDS) else None
                    if name is not None:
                        fields[name] = b""
                elif event is None:
                    name = None
                elif name is not None:
                    fields[name] += event
    except multipart.MultipartError as err:
        raise ApiError(400, f"the multipart/form-data body is not valid: {err}",
                       code="invalid_body") from None
    model = fields.get("model", b"").decode("utf-8", "replace").strip()
    if not model:
        raise ApiError(400, "the form has no `model` field; name one of GET /v1/models",
                       param="model", code="missing_field")
    return Head(model=model, stream=fields.get("stream", b"").strip().lower() == b"true",
                 user=msgspec.Raw(fields.get("user", b"")))


async def _body(receive: Receive) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"the request body is over {MAX_BODY // 2**20} MiB",
                           code="body_too_large")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send_error(send: Send, err: ApiError) -> None:
    headers, body = err.raw()
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# The field each known endpoint's body must have; any other POST under /v1 needs `model` only.
REQUIRED_FIELD = {"/v1/chat/completions": "messages", "/v1/completions": "prompt",
                  "/v1/embeddings": "input"}


# The endpoints whose requests ``serve_now`` serves, as the server finds them in a request
# line: each with its path, the field its body must have and its metrics' kind.
_SERVED_NOW = {path.encode(): (path, field, endpoint_kind(path))
               for path, field in REQUIRED_FIELD.items()}


def gateway_first(app: ASGIApp, state: GatewayContext) -> GatewayFront:
    """The ASGI app the server runs: every POST under ``/v1`` (but ``/v1/models``) goes
    straight to the gateway, everything else to ``app`` (Litestar)."""
    return GatewayFront(app, state)


class GatewayFront:
    """The ASGI app the server runs (``gateway_first``).

    The gateway's routes are Litestar's too (other methods, and an app driven without this
    front, reach them there); their POSTs are taken here so that neither the request nor
    each streamed chunk passes through Litestar's exception middleware, router and send
    wrapper, which the gateway does not need: it answers its own errors.

    And on llmgw's own server (``transport.writer.CallbackRoutes``), a chat, completion or
    embedding request, streamed or not, that needs no wait before it goes to an engine
    (its API key read lately, and ``admission.decide`` giving it a lease at once; an idle
    kept-alive connection to the replica) is sent from the server's callback and answered
    from the engine connection's (``direct.Exchange``): no task, no coroutine, no ASGI
    message for it. Every other request, and one handed back before anything was written
    (the engine refused it), goes through the same admission in a task."""

    def __init__(self, app: ASGIApp, state: GatewayContext):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path.startswith("/v1/") and path != "/v1/models":
                required = REQUIRED_FIELD.get(path)
                if required is None and scope.get("raw_path"):
                    # Forwarded as the client wrote it, percent-escapes and all.
                    path = scope["raw_path"].decode("latin-1").split("?", 1)[0]
                return await _gateway(self.state, scope, receive, send, path, required)
        await self.app(scope, receive, send)

    callback_paths = frozenset(_SERVED_NOW)

    def serve_now(self, target: bytes, headers: dict[bytes, bytes],
                  body: bytearray, writer: BodyWriter,
                  fall_back: Callable[[dict | None], None]) -> bool:
        state = self.state
        pool = state.upstream
        if pool is None or writer.disconnected:
            return False
        trail = state.metrics.trail
        path, required, kind = _SERVED_NOW[target]
        try:
            head = _parse(body, required)
        except ApiError:
            return False  # the task path answers it
        if headers.get(b"content-type", b"")[:len(_FORM)].lower() == _FORM:
            return False
        record = None
        if state.config.auth.require_api_key:
            authorization = headers.get(b"authorization", b"")
            # ``Bearer <key>`` as clients send it; any other form (``auth.bearer`` takes
            # more), a key not read lately, refused or limited: the task path says which.
            if authorization[:7] != b"Bearer ":
                return False
            record = state.api_keys.good_now(authorization[7:].decode("latin-1"),
                                             writer.connection_memo)
            if record is None:
                return False
        ask = Ask(path, kind, head, body, JSON_TYPE, record)
        lease = decide(state, ask)
        if type(lease) is not Lease:
            return False  # the task path waits for it, or says why not
        endpoint, gateway = lease.endpoint, state.config.gateway
        if endpoint.remote is not None:
            # A static endpoint (a server someone else runs): sent from a task, with its
            # path, key and TLS (proxy.forward).
            lease.release()
            return False
        answer = pool.send_now(
            endpoint.host, endpoint.port,
            request_bytes(endpoint.host, endpoint.port, path, ask.body,
                          ACCEPT_STREAM if ask.stream else JSON_TYPE),
            gateway.first_byte_timeout_s, gateway.idle_timeout_s)
        if answer is None:
            lease.release()
            return False
        Exchange(state, ask, lease, answer, writer, fall_back,
                 None if trail is None else trail.origin(headers, writer.client_host))
        return True


def _has_dot_segment(path: str) -> bool:
    """Whether ``path`` (as the client wrote it, the query left off) has a ``.`` or ``..``
    segment, plain or percent-escaped in either case (``%2e``, ``%2E``), an escaped slash
    taken as one: it is forwarded as written, and the engine would resolve it to a path
    it was not routed to (``/v1/%2e%2e/sim/stats`` is its ``/sim/stats``)."""
    if "%" in path:
        path = urllib.parse.unquote(path)
    return "/." in path and any(part in (".", "..") for part in path.split("/"))


async def _gateway(state, scope: Scope, receive: Receive, send: Send, path: str,
                   required: str | None) -> None:
    """One /v1 request, on a thin ASGI path: this is the hot route, and Litestar's request
    and response objects cost more than everything else llmgw does for it."""
    if scope["method"] != "POST":
        return await _send_error(send, ApiError(405, f"{path} does not take "
                                                f"{scope['method']}", code="method_not_allowed",
                                                headers={"allow": "POST"}))
    if required is None and _has_dot_segment(path):
        return await _send_error(send, ApiError(
            400, f"the path {path} has a `.` or `..` segment (plain or escaped as %2e): "
            "it is not forwarded; name the endpoint's own path", code="invalid_path"))
    trail = state.metrics.trail
    seen = _Seen(state.metrics, None if trail is None else trail.origin(
        dict(scope["headers"]), scope["client"][0] if scope.get("client") else None))
    try:
        await _serve(state, scope, receive, send, path, required, seen)
    except ClientGone:
        seen.status = seen.status or 499  # nobody to answer
    except ApiError as err:
        if not seen.status:
            await _send_error(send, err)
            seen.status = err.status
    except StoreUnavailable as err:
        # A key not read lately, or limits to count, while the store does not answer (it
        # logged the outage once); requests that need neither go on.
        if not seen.status:
            refusal = store_refusal(err)
            await _send_error(send, refusal)
            seen.status = refusal.status
    except Exception:
        log.exception("unexpected error serving POST %s", path)
        if not seen.status:
            await _send_error(send, ApiError(500, "internal error; the server's log has the "
                                             "details", code="internal_error"))
            seen.status = 500
    finally:
        seen.done(path)


class _Seen:
    """What the request showed so far, for its metrics (and its span and access-log line,
    when its ``origin`` was read for them); the proxy calls what ``proxy.Progress``
    names as the answer goes out, so nothing wraps ``send``."""

    __slots__ = ("ask", "began", "clock", "key", "metrics", "model", "origin", "replica",
                 "reported", "response_model", "status", "stream", "usage")

    def __init__(self, metrics: Metrics, origin: Origin | None = None) -> None:
        self.metrics = metrics
        self.origin = origin
        self.began = time.perf_counter()
        self.model: str | None = None
        # The API key's record once authorized, and where what it used is counted.
        self.key: ApiKeyRecord | None = None
        self.usage: UsageRecorder | None = None
        self.ask: Ask | None = None
        self.status = 0
        self.stream = False
        self.replica: str | None = None
        self.clock: StreamClock | None = None
        self.reported: Usage | None = None
        self.response_model: str | None = None

    def started(self, status: int) -> None:
        self.status = status

    def first_bytes(self) -> None:
        if self.stream:
            self.metrics.first_byte(self.model, time.perf_counter() - self.began)

    def stream_clock(self) -> StreamClock:
        self.clock = StreamClock(self.metrics.stream_series(self.model), self.began)
        return self.clock

    def answered(self, content: bytes) -> None:
        if self.origin is None:
            usage = usage_from_body(content)
        else:  # and the model it names, for the span and the log line
            usage, self.response_model = answer_of(content)
        self.reported = usage
        key = self.key
        if key is not None:
            self.usage.add(key.id, self.model, usage)  # type: ignore[union-attr]

    def streamed(self, reader: StreamUsage) -> None:
        counted, self.reported = reader.both()
        self.response_model = reader.model
        key = self.key
        if key is not None:
            self.usage.add(key.id, self.model, counted)  # type: ignore[union-attr]

    def done(self, path: str) -> None:
        """The request is over, however it ended: counted (499 if the client left
        unanswered), and its span and line recorded when asked for."""
        status = self.status or 499
        seconds = time.perf_counter() - self.began
        kind = endpoint_kind(path)
        ask = self.ask
        # The model an alias named, once admission resolved it: counted under its name.
        model = self.model if ask is None else ask.model
        self.metrics.request_done(model, kind, status, seconds, self.key, self.reported)
        if self.origin is None:
            return
        clock = self.clock
        self.metrics.trail.record(Done(  # type: ignore[union-attr]  # origin: it is on
            path=path, kind=kind, model=model, status=status, seconds=seconds,
            stream=self.stream, first_token=None if clock is None else clock.first_token,
            usage=self.reported, response_model=self.response_model,
            replica=self.replica, retries=0 if ask is None else len(ask.tried),
            key=self.key), self.origin)


async def _serve(state: GatewayContext, scope: Scope, receive: Receive, send: Send,
                 path: str, required: str | None, seen: _Seen) -> None:
    headers = dict(scope["headers"])  # built in C: quicker than a loop in Python
    authorization = headers.get(b"authorization")
    # The key before the body: nobody without one has a body of up to MAX_BODY read.
    record = seen.key = await authorize(state, authorization and
                                        authorization.decode("latin-1"))
    if record is not None:
        seen.usage = state.usage
    body = await _body(receive)
    content_type = headers.get(b"content-type", b"")
    if required is None and content_type[:len(_FORM)].lower() == _FORM:
        head = _parse_form(body, content_type)
    else:
        head, content_type = _parse(body, required), JSON_TYPE
    seen.model, seen.stream = head.model, head.stream
    ask = seen.ask = Ask(path, endpoint_kind(path), head, body, content_type, record)
    extensions = scope.get("extensions")
    refused = extensions.get(REFUSED) if extensions else None
    if refused is not None:
        ask.refused_by(*refused)

    # If the client goes, this task is cancelled: the upstream request is then closed and
    # the engine stops generating for nobody. llmgw's server says so from the connection's
    # callback; under another server a watcher task, started only for a request still
    # going after a moment (most answers are done sooner), waits for it on ``receive``.
    # (One lookup of the loop: on Python 3.11 each one is a getpid() system call.)
    loop = asyncio.get_running_loop()
    handler = asyncio.current_task(loop)
    watching = True
    gone = False
    watcher: asyncio.Task | None = None
    timer: asyncio.TimerHandle | None = None

    def client_gone() -> None:
        nonlocal gone
        if watching:
            gone = True
            handler.cancel()

    def on_disconnect(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            client_gone()

    def watch() -> None:
        nonlocal watcher
        watcher = loop.create_task(_until_disconnect(receive))
        watcher.add_done_callback(on_disconnect)

    writer = extensions.get(BODY_WRITER) if extensions else None
    if writer is not None:
        if writer.disconnected:
            raise ClientGone
        writer.on_disconnect(client_gone)
    else:
        timer = loop.call_later(_WATCH_AFTER_S, watch)
    try:
        await _route(state, ask, send, seen, writer)
    except asyncio.CancelledError:
        if gone and handler.uncancel() == 0:
            raise ClientGone from None
        raise
    finally:
        watching = False
        if writer is not None:
            writer.on_disconnect(None)
        else:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _route(state: GatewayContext, ask: Ask, send: Send, progress: _Seen,
                 writer: BodyWriter | None) -> None:
    """Admit the request and forward it, to another replica while one refuses it before
    any engine worked on it (``proxy.Retryable``), up to _MAX_ATTEMPTS replicas of a
    model; then to the model's next fallback, if it has one."""
    while True:
        lease = await admit(state, ask)
        if lease is None:
            break
        progress.model = ask.model  # an alias's model (or a fallback), now admitted
        progress.replica = lease.replica
        try:
            return await forward(state, lease, ask, send, progress, writer)
        except Retryable as err:
            state.metrics.retry(ask.model)
            ask.refused_by(lease.replica, str(err))
        if len(ask.tried) - ask.tried_before >= _MAX_ATTEMPTS and not fall_back(state, ask):
            break
    raise no_replica(state, ask)


async def _litestar_route(scope: Scope, receive: Receive, send: Send, path: str) -> None:
    await _gateway(scope["litestar_app"].state.gateway, scope, receive, send, path,
                   REQUIRED_FIELD.get(path))


@asgi("/v1/chat/completions", copy_scope=False)
async def chat_completions(scope: Scope, receive: Receive, send: Send) -> None:
    await _litestar_route(scope, receive, send, "/v1/chat/completions")


@asgi("/v1/completions", copy_scope=False)
async def completions(scope: Scope, receive: Receive, send: Send) -> None:
    await _litestar_route(scope, receive, send, "/v1/completions")


@asgi("/v1/embeddings", copy_scope=False)
async def embeddings(scope: Scope, receive: Receive, send: Send) -> None:
    await _litestar_route(scope, receive, send, "/v1/embeddings")


@asgi("/v1", is_mount=True, copy_scope=True)
async def any_model_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    """Any other POST under /v1 with a JSON body that names a ``model`` (responses, rerank
    …) goes to an engine serving that model as it is: new endpoints work without a new
    llmgw. (The routes above, and GET /v1/models, are matched before this mount.)"""
    path = scope["raw_path"].decode("latin-1") if scope.get("raw_path") else scope["path"]
    await _litestar_route(scope, receive, send, path.split("?", 1)[0])


def _model_object(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "llmgw"}


@get("/v1/models", dependencies=from_states("gateway", "started_at"))
async def list_models(request: Request, gateway: GatewayContext, started_at: float) -> dict:
    """Every name the key may send as ``model``: models and their aliases."""
    record = await authorize(gateway, request.headers.get("authorization"))
    allowed = record.allowed_models if record else None
    created = int(started_at)
    return {
        "object": "list",
        "data": [_model_object(n.name, created)
                 for n in gateway.controller.catalog.served_names()
                 if may_use(allowed, n.name, n.model)],
    }


@get("/v1/models/{model_id:path}", dependencies=from_states("gateway", "started_at"))
async def retrieve_model(request: Request, gateway: GatewayContext, started_at: float,
                         model_id: str) -> dict:
    """One model (or alias) as GET /v1/models lists it; 404 for a name it does not list
    to this key."""
    record = await authorize(gateway, request.headers.get("authorization"))
    allowed = record.allowed_models if record else None
    name = model_id.removeprefix("/")  # a path parameter keeps its leading slash
    model = gateway.controller.catalog.resolve(name)
    if model is None or not may_use(allowed, name, model):
        # Not listed to this key: not found, as GET /v1/models implies.
        raise not_listed(gateway.controller.catalog, name, allowed)
    return _model_object(name, int(started_at))


ROUTES = [chat_completions, completions, embeddings, list_models, retrieve_model,
          any_model_endpoint]
