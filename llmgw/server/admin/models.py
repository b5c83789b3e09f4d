"""Models over the admin API: list, add, remove, scale.

A model's static endpoints (servers someone else runs, by URL) show with their health as
this server last checked it (``server.endpoints``). One added over the API may name no
``api_key_file``: a key file named over the API would let whoever holds the admin token
have the server send any one-line file it can read (another secret) to a URL of their
choosing. Endpoints with keys are declared in server.yaml, which a reload (SIGHUP) applies.

The catalog they change is merged in ``server.catalog`` (server.yaml's models and the
API's); these functions read it, write the store, and hand the controller the result. The
handlers and the cluster page's models page call the same functions.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from litestar import delete, get, patch, post
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from litestar.typing import FieldDefinition

from llmgw.config import ConfigError, Model, ServerConfig
from llmgw.server.admin.common import (
    ADMIN,
    SERVICES,
    SIGNED_IN,
    Input,
    StrictBody,
    decode_json,
)
from llmgw.server.auth.sessions import Principal
from llmgw.server.catalog import (
    API,
    CONFIG,
    Entry,
    ModelError,
    catalog_of,
    clash_with_catalog,
    declared,
    entries,
    fallbacks_refused,
    fallen_back_on,
    parse_model,
    stored_spec,
)
from llmgw.server.controller import Controller
from llmgw.server.dependencies import from_state
from llmgw.server.endpoints import read_secrets
from llmgw.server.errors import ApiError, refusals
from llmgw.store import Store

log = logging.getLogger(__name__)

# Changes one at a time: each rereads the store and hands the controller the result.
DEPENDENCIES = {**SERVICES, "models_lock": from_state("models_lock")}


class Scale(Input):
    # null: back to server.yaml's replicas.
    replicas: Annotated[int, msgspec.Meta(ge=0)] | None


@dataclass(frozen=True, slots=True)
class NewModel:
    """A model to add: as the operator wrote it, and as server.yaml's rules read it."""

    written: dict[str, Any]
    model: Model


class ModelBody(StrictBody):
    """``POST /api/models``: a server.yaml ``models:`` entry, checked with server.yaml's
    own rules (errors name the key path), and documented as ``llmgw.config.Model``."""

    def decode_bytes(self, value: bytes) -> NewModel:
        return checked_model(decode_json(value or b"null"))

    @classmethod
    def create_openapi_schema(cls, field_definition: FieldDefinition, handler_id: str,
                              schema_creator: Any) -> Any:
        return schema_creator.for_field_definition(FieldDefinition.from_annotation(Model))


# --- what the handlers answer ----------------------------------------------------------------


class ProfileView(msgspec.Struct):
    name: str
    engine: str
    nodes: int
    gpus: int


class EndpointView(msgspec.Struct):
    """A static endpoint of a model, with its health as this server last checked it."""

    # What it goes by where a replica's name shows (refusals, in-flight counts).
    name: str
    url: str
    # "up", "down", or "unchecked" (routed to until a check fails).
    health: str
    # Why it is down: its check's failure, or a file it cannot read.
    reason: str | None = None
    # Since when (Unix time) it has been up or down.
    since: float | None = None
    # The upstream's name for the model; null: the model's own.
    model: str | None = None
    slots: int | None = None


class ModelView(msgspec.Struct):
    """A model as the catalog serves it; the fields after ``endpoints_declared`` only for
    an admin."""

    name: str
    source: str
    description: str
    replicas: int
    replicas_ready: int
    # Other names a client may send for it.
    aliases: list[str] = []
    # Names (or aliases) of the models that serve its requests when it cannot, in order, as
    # written: for everyone, as the x-llmgw-model header of an answer names the one that did.
    fallbacks: list[str] = []
    # Its static endpoints (servers someone else runs) routed to now (up, or not checked
    # yet), of how many declared.
    endpoints_ready: int = 0
    endpoints_declared: int = 0
    # Scale to zero: unloaded to min_replicas after idle_unload_s without a request (null:
    # never), and whether it is so now (its next request wakes it: one slow answer).
    idle_unload_s: float | None = None
    min_replicas: int = 0
    asleep: bool = False
    # server.yaml's value for its models (an override differs from it); null for the API's.
    replicas_in_config: int | msgspec.UnsetType | None = msgspec.UNSET
    overridden: bool | msgspec.UnsetType = msgspec.UNSET
    priority: int | msgspec.UnsetType = msgspec.UNSET
    profiles: list[ProfileView] | msgspec.UnsetType = msgspec.UNSET
    placed_on: list[str] | msgspec.UnsetType = msgspec.UNSET
    # Why no replica could be placed, while none can.
    unplaced: str | msgspec.UnsetType | None = msgspec.UNSET
    # Each static endpoint, with its health.
    endpoints: list[EndpointView] | msgspec.UnsetType = msgspec.UNSET
    # The model as declared (a server.yaml ``models:`` entry).
    spec: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class ModelRemoved(msgspec.Struct):
    removed: str


def model_view(entry: Entry, controller: Controller, admin: bool) -> ModelView:
    name = entry.model.name
    ready = sum(1 for r in controller.replicas.values()
                if r.model == name and r.state.value == "ready")
    endpoints = controller.endpoints.states(entry.model) if entry.model.endpoints else []
    shown = ModelView(name=name, source=entry.source, description=entry.model.description,
                      replicas=entry.model.replicas, replicas_ready=ready,
                      aliases=list(entry.model.aliases), fallbacks=list(entry.model.fallbacks),
                      endpoints_ready=sum(1 for e in endpoints if e.health != "down"),
                      endpoints_declared=len(endpoints),
                      idle_unload_s=entry.model.idle_unload_s,
                      min_replicas=entry.model.min_replicas,
                      asleep=name in controller.asleep)
    if not admin:
        return shown
    return msgspec.structs.replace(
        shown,
        replicas_in_config=entry.declared_replicas if entry.source == CONFIG else None,
        overridden=entry.override is not None,
        priority=entry.model.priority,
        profiles=[ProfileView(p.name, p.engine, p.nodes, p.gpus)
                  for p in entry.model.profiles],
        placed_on=sorted({s.node_id for r in controller.replicas.values()
                          if r.model == name for s in r.shards}),
        unplaced=controller.unplaced.get(name),
        endpoints=[EndpointView(e.name, e.url, e.health, e.reason, e.since, e.model, e.slots)
                   for e in endpoints],
        spec=entry.spec,
    )


async def _find(store: Store, settings: ServerConfig, name: str) -> Entry:
    found = next((e for e in await entries(store, settings) if e.model.name == name), None)
    if found is None:
        raise ApiError(404, f"no model {name!r}; `llmgw ctl models list` (GET /api/models) "
                       "shows them", code="model_not_found")
    return found


async def _apply(store: Store, settings: ServerConfig, controller: Controller
                 ) -> list[Entry]:
    items = await entries(store, settings)
    await controller.set_catalog(catalog_of(items))
    return items


# --- what the API and the cluster page both do -----------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelParts:
    """What a change of the models works on: the store, server.yaml, the controller that is
    handed the result, and the lock that makes changes one at a time."""

    store: Store
    settings: ServerConfig
    controller: Controller
    lock: asyncio.Lock

    @classmethod
    def of(cls, state: State) -> ModelParts:
        return cls(state.store, state.config, state.controller, state.models_lock)


def checked_model(written: Any) -> NewModel:
    """A model as the operator wrote it (a server.yaml ``models:`` entry), checked with
    server.yaml's own rules; a 400 naming the key path otherwise."""
    try:
        model, _ = parse_model(written)
    except ModelError as err:
        raise ApiError(400, str(err), param=err.param, code="invalid_model") from None
    for k, endpoint in enumerate(model.endpoints):
        if endpoint.api_key_file is not None:
            raise ApiError(400, f"endpoints[{k}].api_key_file: an endpoint with a key is "
                           "declared in server.yaml (a reload applies it: systemctl reload "
                           "llmgw-server), not over the API, where a key file could be any "
                           "file the server can read", param=f"endpoints[{k}].api_key_file",
                           code="invalid_model")
    try:
        read_secrets([("model", model)])  # its CA files, on this server
    except ConfigError as err:
        text = str(err).removeprefix("model.")
        raise ApiError(400, text, param=text.split(":", 1)[0], code="invalid_model") from None
    return NewModel(written, model)


async def model_views(store: Store, settings: ServerConfig, controller: Controller,
                      admin: bool) -> list[ModelView]:
    return [model_view(e, controller, admin) for e in await entries(store, settings)]


async def add_to_catalog(parts: ModelParts, new: NewModel) -> ModelView:
    """Store a checked model as the API's; 409 when the name is taken."""
    store, config, name = parts.store, parts.settings, new.model.name
    async with parts.lock:
        existing = await store.get_model(name)
        if existing is not None or any(m.name == name for m in config.models):
            where = ("server.yaml declares it" if existing is None
                     or declared(existing).source == CONFIG else "it was added over the API")
            raise ApiError(409, f"model {name!r} exists ({where}): scale it with `llmgw "
                           f"ctl models scale {name} N`, or remove it first",
                           param="name", code="model_exists")
        items = await entries(store, config)
        clash = clash_with_catalog(items, new.model)
        if clash is not None:
            raise ApiError(409, clash[1], param=clash[0], code="model_exists")
        broken = fallbacks_refused(items, new.model)
        if broken is not None:
            raise ApiError(400, broken[1], param=broken[0], code="invalid_model")
        # As the operator wrote it (checked above), as server.yaml keeps what it was given.
        await store.put_model(name, stored_spec(API, new.written))
        log.info("model %s added over the API", name)
        items = await _apply(store, config, parts.controller)
    return model_view(next(e for e in items if e.model.name == name), parts.controller, True)


async def remove_from_catalog(parts: ModelParts, name: str) -> ModelRemoved:
    """Remove a model added over the API; server.yaml's are refused (409), saying how."""
    store, config = parts.store, parts.settings
    async with parts.lock:
        if any(m.name == name for m in config.models):
            raise ApiError(409, f"model {name!r} is declared in server.yaml: remove it there "
                           "and reload the server (`systemctl reload llmgw-server`, or "
                           f"SIGHUP); to stop its replicas meanwhile: `llmgw ctl models scale "
                           f"{name} 0`", code="model_in_config")
        leaning = fallen_back_on(await entries(store, config), name)
        if leaning:
            raise ApiError(409, f"model {name!r} is a fallback of {', '.join(leaning)}: "
                           "remove it from their fallbacks first (their requests would "
                           "otherwise lose it without a word)", code="model_in_use")
        if not await store.delete_model(name):
            await _find(store, config, name)  # says what to do
        log.info("model %s removed over the API; its replicas stop", name)
        await _apply(store, config, parts.controller)
    return ModelRemoved(name)


async def set_replicas(parts: ModelParts, name: str, replicas: int | None) -> ModelView:
    """Scale a model; None goes back to server.yaml's value (refused for the API's)."""
    store, config = parts.store, parts.settings
    async with parts.lock:
        entry = await _find(store, config, name)
        if not entry.model.profiles:
            raise ApiError(400, f"model {name!r} has no profiles: llmgw runs no replica of "
                           "it, its endpoints serve it; declare a profile to run replicas "
                           "of it too", param="replicas", code="invalid_value")
        if entry.source == CONFIG:
            raw = next(m for m in config.models if m.name == name)
            await store.put_model(name, stored_spec(CONFIG, msgspec.to_builtins(raw),
                                                    replicas))
        elif replicas is None:
            raise ApiError(400, f"model {name!r} was added over the API: it has no "
                           "server.yaml value to go back to; give a number of replicas",
                           param="replicas", code="invalid_value")
        else:
            await store.put_model(name, stored_spec(API, {**entry.spec,
                                                          "replicas": replicas}))
        log.info("model %s scaled to %s over the API", name,
                 "server.yaml's replicas" if replicas is None else replicas)
        items = await _apply(store, config, parts.controller)
    return model_view(next(e for e in items if e.model.name == name), parts.controller, True)


# --- the handlers ----------------------------------------------------------------------------


@get("/api/models", **{**SIGNED_IN, "dependencies": DEPENDENCIES},
     responses=refusals(401))
async def list_models(principal: NamedDependency[Principal], store: NamedDependency[Store],
                      config: NamedDependency[ServerConfig],
                      controller: NamedDependency[Controller]) -> list[ModelView]:
    return await model_views(store, config, controller, principal.is_admin)


_ADMIN = {**ADMIN, "dependencies": DEPENDENCIES}


@post("/api/models", status_code=201, **_ADMIN, dto=ModelBody,
      responses=refusals(400, 401, 403, 409, 415))
async def add_model(data: JSONBody[NewModel], store: NamedDependency[Store],
                    config: NamedDependency[ServerConfig], controller: NamedDependency[Controller],
                    models_lock: NamedDependency[asyncio.Lock]) -> ModelView:
    return await add_to_catalog(ModelParts(store, config, controller, models_lock), data)


@delete("/api/models/{name:path}", status_code=200, **_ADMIN,
        responses=refusals(401, 403, 404, 409, 415))
async def remove_model(name: FromPath[str], store: NamedDependency[Store],
                       config: NamedDependency[ServerConfig],
                       controller: NamedDependency[Controller],
                       models_lock: NamedDependency[asyncio.Lock]) -> ModelRemoved:
    return await remove_from_catalog(ModelParts(store, config, controller, models_lock),
                                     name.lstrip("/"))


@patch("/api/models/{name:path}", **_ADMIN, dto=StrictBody,
       responses=refusals(400, 401, 403, 404, 415))
async def scale_model(name: FromPath[str], data: JSONBody[Scale], store: NamedDependency[Store],
                      config: NamedDependency[ServerConfig],
                      controller: NamedDependency[Controller],
                      models_lock: NamedDependency[asyncio.Lock]) -> ModelView:
    """``{"replicas": 3}``; ``{"replicas": null}`` goes back to server.yaml's value."""
    return await set_replicas(ModelParts(store, config, controller, models_lock),
                              name.lstrip("/"), data.replicas)


ROUTES = [list_models, add_model, remove_model, scale_model]
