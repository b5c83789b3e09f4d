"""Admission of a ``/v1`` request, written once: whether it goes to a replica now (a
lease), waits (for the store to count it against its key's limits, or for a slot), or is
refused (an ApiError saying why).

A request is served one of two ways (routes.py): from the server's callbacks with no task
(``GatewayFront.serve_now``), which takes only a request that needs no wait, or in a
task, which awaits what the decision waits for and asks again. Both ask ``decide`` with
the request's ``Ask``, so the two cannot drift apart.

A model may name fallbacks (``Catalog.fallbacks_of``): when it has no ready replica left
to try, or its queue refuses the request (429), the request becomes its next fallback's
(``fall_back``), one the key may use, before anything was sent to an engine. ``decide``
falls back at once where the model has no ready replica and none is on its way (so the
callback path serves a fallback too); the task path where a wait ended in a refusal. A
model without fallbacks pays one attribute read for this.
"""

from __future__ import annotations

import difflib
import enum
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import msgspec
import multipart

from llmgw.core.catalog import Name, may_use
from llmgw.core.routing import DEFAULT_PREFIX_BYTES, affinity_key
from llmgw.server.auth import bearer
from llmgw.server.errors import ApiError
from llmgw.server.openai.router import Lease, QueueFull, Saturated
from llmgw.store import ApiKeyRecord
from llmgw.transport.pool import JSON_TYPE

if TYPE_CHECKING:
    from llmgw.config import ServerConfig
    from llmgw.core.catalog import Catalog
    from llmgw.server.auth import KeyCache
    from llmgw.server.controller import Controller
    from llmgw.server.metrics import Metrics
    from llmgw.server.openai.router import Router
    from llmgw.server.openai.usage import UsageRecorder
    from llmgw.store import Store
    from llmgw.transport.pool import Pool

# Longer than any model's name: one that long is not looked for among close names.
_LONGEST_NAME = 256


class GatewayContext:
    """What the ``/v1`` routes use of the server, as plain attributes. (Litestar's State
    answers each attribute through a ``__getattr__`` in Python, 0.33 µs; a request asked
    it nine times.) In the app's state as ``gateway``. A plain class, not a dataclass: a
    handler that takes it as a dependency gets it as it is, not converted field by
    field."""

    __slots__ = ("api_keys", "awaiting", "config", "controller", "metrics", "router",
                 "store", "upstream", "usage")

    def __init__(self, *, config: ServerConfig, controller: Controller, router: Router,
                 store: Store, metrics: Metrics, usage: UsageRecorder, api_keys: KeyCache,
                 upstream: Pool | None = None) -> None:
        self.config = config
        self.controller = controller
        self.router = router
        self.store = store
        self.metrics = metrics
        self.usage = usage
        self.api_keys = api_keys
        self.upstream = upstream  # made in the app's lifespan, on its event loop
        # Per model, the requests waiting for a replica on its way (_replica_on_its_way).
        self.awaiting: dict[str, int] = {}


class Head(msgspec.Struct):
    """What routing reads of a request's body; everything else is the engine's business."""

    model: str | None = None
    stream: bool = False
    # Kept raw: whether they are there is all routing needs to know.
    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()
    # Raw too: only a key for affinity, whatever type a client sends.
    user: msgspec.Raw = msgspec.Raw()


class Ask:
    """One ``/v1`` request as routing knows it, from its admission to its answer: what it
    is (``path``, its metrics ``kind``, ``head``, ``body``, ``content_type``), whose it is
    (``key``: the API key's record, None where no key is required), and how far it got
    (``admitted``: counted against the key's limits; ``tried`` and ``refusals``: the
    replicas that did not take it, and why)."""

    __slots__ = ("_affinity", "admitted", "body", "content_type", "fallback_refusals",
                 "fallbacks", "first_refusal", "head", "key", "kind", "model", "path",
                 "refusals", "replica_due", "requested", "shows_model", "stream", "tried",
                 "tried_before")

    def __init__(self, path: str, kind: str, head: Head, body: bytes, content_type: bytes,
                 key: ApiKeyRecord | None) -> None:
        self.path = path
        self.kind = kind
        self.head = head
        # What the client sent as ``model``; ``model`` is the catalog's name for it once
        # ``decide`` resolved an alias (``serve_as``), which routing, usage and metrics use.
        self.requested: str = head.model  # type: ignore[assignment]  # parsing checked it
        self.model = self.requested
        self.stream = head.stream
        self.body = body
        self.content_type = content_type
        self.key = key
        self.admitted = key is None or not key.limits.any
        self.tried: set[str] = set()
        self.refusals: list[str] = []
        # Until when it may wait for a replica on its way (monotonic); see admit().
        self.replica_due: float | None = None
        self._affinity: bytes | bool | None = False  # False: not worked out yet
        # The model sent names fallbacks: the answer says which model served it
        # (``proxy.show_model``), whichever did.
        self.shows_model = False
        # Once it fell back (``fall_back``): the fallbacks not tried yet, the first model's
        # refusal (what the client is told if none serves), the later ones', and how many
        # replicas were tried before the model it is now for.
        self.fallbacks: tuple[Name, ...] | None = None
        self.first_refusal: ApiError | None = None
        self.fallback_refusals: tuple[str, ...] = ()  # no list made for every request
        self.tried_before = 0

    def affinity(self, router: Router) -> bytes | None:
        """The request's affinity key (``routing.affinity_key``): its ``user``, else the
        first bytes of its ``messages`` or ``prompt``, copied from the body only as far as
        the key reads (a conversation with images runs to megabytes: 27 µs a megabyte
        copied whole). None while the model has one replica: there is nothing to choose."""
        if self._affinity is False:
            if router.choices(self.model) < 2:
                return None
            head = self.head
            conversation = head.messages or head.prompt
            self._affinity = affinity_key(
                bytes(head.user), bytes(memoryview(conversation)[:DEFAULT_PREFIX_BYTES]))
        return self._affinity  # type: ignore[return-value]

    def serve_as(self, name: str) -> None:
        """The client sent an alias of model ``name``: the request is that model's from
        here on, and its body names it, as its engine serves it (an engine refuses a
        ``model`` it was not started with)."""
        self.model = name
        self.body = body_with_model(self.body, self.content_type, name)

    def refused_by(self, replica: str, why: str) -> None:
        """``replica`` did not take the request (no engine worked on it): try another."""
        self.tried.add(replica)
        self.refusals.append(why)


class Wait(enum.Enum):
    """What a request must wait for before it can go."""

    LIMITS = "the store, to count it against its key's limits"
    SLOT = "a free slot on a replica"


def decide(state: GatewayContext, ask: Ask) -> Lease | Wait | ApiError:
    """Go with a lease on a replica with a free slot, wait, or be refused; in that order:
    the key may use the model (403), the model exists (404), the key's limits admit it
    (waits for the store), a replica not yet tried has a free slot (waits in its queue);
    a model with no ready replica left, none on its way, goes on to its next fallback.
    The lease, when there is one, is the caller's to release."""
    requested = ask.requested
    catalog = state.controller.catalog
    allowed = ask.key.allowed_models if ask.key is not None else None
    # One lookup by the name sent, an alias or the model's own (catalog.may_use, inline).
    served = catalog.resolve(requested)
    if served is None or (allowed is not None and requested not in allowed
                          and served.name not in allowed):
        return not_usable(catalog, requested, allowed)
    if ask.first_refusal is None:
        model = served.name
        if model != ask.model:  # an alias, the first time it is decided on
            ask.serve_as(model)
        if served.fallbacks:
            ask.shows_model = True
    else:  # fell back: the fallback's now
        model = ask.model
    controller = state.controller
    if model in controller.sleepy:
        controller.requested(model)  # noted; wakes it when it sleeps
    if not ask.admitted:
        return Wait.LIMITS
    router = state.router
    if not state.config.gateway.affinity:
        lease = router.pick(model, None, ask.tried)
    else:
        lease = router.pick(model, ask.affinity(router), ask.tried)
    if lease is not None:
        return lease
    if (ask.shows_model and not router.reachable(model, ask.tried)
            and not controller.expecting(model) and fall_back(state, ask)):
        return decide(state, ask)  # for the fallback (a chain ends: it recurses as far)
    return Wait.SLOT


async def admit(state: GatewayContext, ask: Ask) -> Lease | None:
    """``decide``, waiting for what it waits for: a lease, or None when the model, and
    each fallback it went on to, has no ready replica left to try (503: ``no_replica``).
    Raises the ApiError of a refusal (a 429 from the key's limits or a full queue among
    them; a full queue first sends the request on to a fallback, if there is one)."""
    while True:
        decision = decide(state, ask)
        if type(decision) is Lease:
            return decision
        if decision is Wait.LIMITS:
            key = ask.key
            refusal = await state.store.admit(key.id, key.limits, datetime.now(UTC))
            if refusal is not None:
                state.metrics.refused(ask.model, "rate_limit")
                raise ApiError(429, refusal.message, code=refusal.code,
                               headers={"retry-after": str(refusal.retry_after_s)})
            ask.admitted = True
        elif decision is Wait.SLOT:
            router = state.router
            affinity = ask.affinity(router) if state.config.gateway.affinity else None
            try:
                lease = await router.acquire(ask.model, affinity, exclude=ask.tried)
                if lease is not None:
                    return lease
                if not await _replica_on_its_way(state, ask) and not fall_back(state, ask):
                    return None
            except Saturated as err:
                refusal = ApiError(429, str(err), code=err.code,
                                   headers={"retry-after": str(err.retry_after_s)})
                if fall_back(state, ask, refusal):
                    continue
                state.metrics.refused(ask.model, err.code)
                raise final_refusal(ask, refusal) from None
        else:
            raise decision


async def _replica_on_its_way(state: GatewayContext, ask: Ask) -> bool:
    """With no replica to take the request: when one is on its way (the controller says
    so), wait for the routing table to change, within ``gateway.queue_wait_s`` in all,
    and say whether to ask again. A slow answer rather than a 503 while a restarted
    server hears from its nodes, while an engine that stopped answering this server is
    replaced or comes back, or while a model a request woke from its sleep starts (then
    up to the model's ``wake_timeout_s``)."""
    now = time.monotonic()
    if ask.replica_due is None:
        ask.replica_due = now + max(state.config.gateway.queue_wait_s,
                                    state.controller.wake_left(ask.model))
    left = ask.replica_due - now
    model = ask.model
    if left <= 0 or not state.controller.expecting(model):
        return False
    # As many wait as the model's queue holds (``gateway.queue_max``): a flood of requests
    # for a model that is starting must not pile up without bound.
    awaiting = state.awaiting
    count = awaiting.get(model, 0)
    if count >= state.config.gateway.queue_max:
        raise QueueFull(f"{count} request(s) already wait for a replica of {model!r} to "
                        "start", state.router.retry_after_s)
    awaiting[model] = count + 1
    try:
        await state.router.changed(left)
    finally:
        if awaiting[model] > 1:
            awaiting[model] -= 1
        else:
            del awaiting[model]
    return True


def no_replica(state: GatewayContext, ask: Ask) -> ApiError:
    """The 503 of a request no replica took: why each one tried did not, or why the model
    has none ready; the first model's, naming its fallbacks' too, when it fell back."""
    return final_refusal(ask, _no_replica_of(state, ask))


def _no_replica_of(state: GatewayContext, ask: Ask) -> ApiError:
    why = ("; ".join(ask.refusals) if ask.refusals
           else state.controller.why_not_ready(ask.model))
    model = state.controller.catalog.get(ask.model)
    # A model served by static endpoints only has no replicas to speak of.
    what = "endpoint" if model is not None and not model.profiles else "replica"
    return ApiError(503, f"no {what} of {ask.model!r} can take the request: {why}",
                    code="no_ready_replica", headers={"retry-after": "5"})


def fall_back(state: GatewayContext, ask: Ask, refusal: ApiError | None = None) -> bool:
    """The request's model refused it before anything was sent (``refusal``; None: no
    replica of it can take it): make it the next fallback's that the key may use (its
    body names that model, for its engine), and say so; False when there is none left,
    and the caller answers ``final_refusal``. A fallback the key may not use is passed
    over: the key's model list applies to fallbacks as to models sent."""
    if not ask.shows_model:
        return False
    remaining = ask.fallbacks
    if remaining is None:
        catalog = state.controller.catalog
        first = catalog.resolve(ask.requested)
        remaining = () if first is None else catalog.fallbacks_of(first)
    allowed = ask.key.allowed_models if ask.key is not None else None
    for i, fallback in enumerate(remaining):
        if not may_use(allowed, fallback.name, fallback.model):
            continue
        ask.fallbacks = remaining[i + 1:]
        refusal = refusal or _no_replica_of(state, ask)
        if ask.first_refusal is None:
            ask.first_refusal = refusal
        else:
            ask.fallback_refusals += (refusal.message,)
        state.metrics.fell_back(ask.model, fallback.model.name)
        ask.serve_as(fallback.model.name)
        ask.refusals = []
        ask.replica_due = None
        ask.tried_before = len(ask.tried)
        ask._affinity = False  # another model's replicas to choose between
        return True
    ask.fallbacks = ()
    return False


def final_refusal(ask: Ask, refusal: ApiError) -> ApiError:
    """What the client is told when nothing took the request and ``refusal`` was the last
    word: that refusal, or, when the request fell back, the first model's (the model it
    sent), with why each fallback could not take it either."""
    first = ask.first_refusal
    if first is None:
        return refusal
    why = "; ".join([*ask.fallback_refusals, refusal.message])
    return ApiError(first.status, f"{first.message}; its fallbacks could not take it "
                    f"either: {why}", code=first.code, headers=first.headers)


async def authorize(state: GatewayContext, authorization: str | None) -> ApiKeyRecord | None:
    """The API key's record (None where no key is required); a 401 saying why otherwise."""
    if not state.config.auth.require_api_key:
        return None
    key = bearer(authorization)
    if key is None:
        raise ApiError(401, "no API key: send `Authorization: Bearer llmgw_...`",
                       code="missing_api_key")
    record = await state.api_keys.check(key)
    if isinstance(record, str):
        raise ApiError(401, record, code="invalid_api_key")
    return record


def not_usable(catalog: Catalog, name: str, allowed: list[str] | None) -> ApiError:
    """Why a key (``allowed``: its models, None for all) may not use model ``name``: it is
    not among the key's (403), or there is no such model (404, with close names)."""
    if catalog.resolve(name) is not None:
        return ApiError(403, f"this API key may not use model {name!r}", param="model",
                        code="model_not_allowed")
    return not_listed(catalog, name, allowed)


def not_listed(catalog: Catalog, name: str, allowed: list[str] | None) -> ApiError:
    """The 404 of a model name that GET /v1/models does not list to a key (``allowed``:
    its models, None for all), with the close names it does list."""
    visible = [n.name for n in catalog.served_names() if may_use(allowed, n.name, n.model)]
    if len(name) > _LONGEST_NAME:
        # No model is called that: no close names (difflib indexes every character of
        # it, seconds of the event loop for a body's worth), and not echoed whole.
        close, name = [], name[:_LONGEST_NAME] + "…"
    else:
        close = difflib.get_close_matches(name, visible, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else (
        f"; available: {', '.join(visible)}" if visible else "; no models are declared")
    # A limited key is not told which: what it may not use is not its to see.
    what = "does not exist" if allowed is None else "does not exist or this API key may not use it"
    return ApiError(404, f"the model {name!r} {what}{hint}", param="model",
                    code="model_not_found")


# A JSON body's top-level fields, each kept as its bytes: what renaming ``model`` needs.
_fields_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])


def body_with_model(body: bytes, content_type: bytes, name: str) -> bytes:
    """``body`` (JSON, or multipart/form-data as ``content_type`` says) naming model
    ``name``: for an alias's model (``Ask.serve_as``), or a static endpoint's own name for
    it (``proxy.body_for``)."""
    if content_type == JSON_TYPE:
        return json_with_model(body, name)
    return form_with_model(body, content_type, name)


def json_with_model(body: bytes, name: str) -> bytes:
    """``body`` (a JSON object, parsed before) with ``model`` set to ``name``, every other
    field as the client wrote it, in its place."""
    fields = _fields_decoder.decode(body)
    fields["model"] = msgspec.Raw(msgspec.json.encode(name))
    return msgspec.json.encode(fields)


def form_with_model(body: bytes, content_type: bytes, name: str) -> bytes:
    """``body`` (a multipart/form-data one, parsed before) with its ``model`` field's
    value set to ``name``, every other part as the client wrote it. (The boundary cannot
    occur inside a part, so splitting on it finds the parts.)"""
    _, options = multipart.parse_options_header(content_type.decode("latin-1"))
    delimiter = b"--" + options["boundary"].encode("latin-1")
    parts = bytes(body).split(delimiter)
    for i, part in enumerate(parts):
        head, blank, value = part.partition(b"\r\n\r\n")
        if not blank or not value.endswith(b"\r\n"):
            continue
        disposition = next((line for line in head.split(b"\r\n")
                            if line[:20].lower() == b"content-disposition:"), None)
        if disposition is None:
            continue
        _, fields = multipart.parse_options_header(disposition[20:].decode("latin-1"))
        if fields.get("name") == "model" and "filename" not in fields:
            parts[i] = head + blank + name.encode() + b"\r\n"
    return delimiter.join(parts)
