"""Models over the admin API: list, add, remove, scale.

Two sources, one catalog. server.yaml declares some models (source ``config``): they stay
declared there, and the store mirrors them at every start. Others are added over the API
(source ``api``) and live in the store alone, so they survive restarts. Scaling works for
both: an API model's replicas are simply changed; a server.yaml model gets an override
kept beside its mirror, which outlives restarts and edits of server.yaml until it is reset
(``PATCH {"replicas": null}``, ``llmgw ctl models scale NAME --reset``).

What the store keeps per model (``StoredModel.spec``) is a ``Declared``. A row written
before sources existed is a bare server.yaml entry: it reads as a ``config`` mirror.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, delete, get, patch, post
from litestar.params import FromPath

from llmgw import config
from llmgw.core.catalog import Catalog, CatalogError, Model, model_from_config
from llmgw.server.admin.common import Input, body, decode_json, require
from llmgw.server.errors import ApiError
from llmgw.store import Store, StoredModel

log = logging.getLogger(__name__)

CONFIG, API = "config", "api"


class Declared(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    source: Literal["config", "api"]
    # Exactly as a server.yaml ``models:`` entry.
    model: dict[str, Any]
    # A server.yaml model scaled over the API; None: server.yaml's replicas.
    replicas_override: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One model as the catalog serves it, with where it came from."""

    source: str
    spec: dict[str, Any]
    model: Model  # replicas already overridden
    declared_replicas: int  # what server.yaml (or the API's add) says
    override: int | None


class ModelError(ValueError):
    """A model document that cannot be used; the message names the key path."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_model(data: Any, where: str = "model") -> tuple[config.Model, Model]:
    """Check one model written as a server.yaml ``models:`` entry, with server.yaml's own
    rules; errors name the key path (``model.profiles[0].gpus: expected int, got str``)."""
    if not isinstance(data, dict):
        raise ModelError(f"{where}: expected one model as a mapping (name, profiles, "
                         f"replicas, ...), got {type(data).__name__}")
    marker = "<model>: models[0]"
    try:
        raw = config.parse({"models": [data]}, config.ServerConfig, "<model>").models[0]
    except config.ConfigError as err:
        text = str(err).replace(marker, where, 1)
        raise ModelError(text, _param(text, where)) from None
    try:
        return raw, model_from_config(raw, where)
    except CatalogError as err:
        raise ModelError(str(err), _param(str(err), where)) from None


def _param(text: str, where: str) -> str | None:
    path = text.split(":", 1)[0]
    return path.removeprefix(where).lstrip(".") or None


def _declared(stored: StoredModel) -> Declared:
    if "source" not in stored.spec:
        return Declared(source=CONFIG, model=stored.spec)
    return msgspec.convert(stored.spec, Declared)


async def entries(store: Store, settings: config.ServerConfig) -> list[Entry]:
    """server.yaml's models in its order, then the API's by name. server.yaml's come from
    the file itself (checked at start); only their overrides come from the store."""
    stored = {s.name: _declared(s) for s in await store.list_models()}
    result = []
    for i, raw in enumerate(settings.models):
        kept = stored.get(raw.name)
        override = kept.replicas_override if kept and kept.source == CONFIG else None
        model = model_from_config(raw, f"models[{i}]")
        if override is not None:
            model = dataclasses.replace(model, replicas=override)
        result.append(Entry(CONFIG, msgspec.to_builtins(raw), model, raw.replicas, override))
    declared = {m.name for m in settings.models}
    for name, kept in sorted(stored.items()):
        if kept.source != API or name in declared:
            continue
        try:
            raw, model = parse_model(kept.model, f"model {name} (added over the API)")
        except ModelError as err:
            # An upgrade may have tightened a rule: serve the rest, say what to do.
            log.error("%s; not served: fix it with `llmgw ctl models remove %s` and add it "
                      "again", err, name)
            continue
        result.append(Entry(API, kept.model, model, raw.replicas, None))
    return result


def catalog_of(items: list[Entry]) -> Catalog:
    return Catalog(tuple(e.model for e in items))


async def sync_declared(store: Store, settings: config.ServerConfig) -> Catalog:
    """At start: mirror server.yaml's models into the store, keeping their overrides and
    the API's models; forget server.yaml models that are no longer declared."""
    declared = {m.name: m for m in settings.models}
    stored = {s.name: _declared(s) for s in await store.list_models()}
    for name, raw in declared.items():
        kept = stored.get(name)
        override = None
        if kept is not None and kept.source == CONFIG:
            override = kept.replicas_override
        elif kept is not None:
            log.warning("model %s: server.yaml declares it now; its definition from the API "
                        "is replaced by server.yaml's", name)
        if override is not None and override != raw.replicas:
            log.info("model %s: %d replica(s), set over the API (server.yaml: %d); "
                     "`llmgw ctl models scale %s --reset` goes back to server.yaml's",
                     name, override, raw.replicas, name)
        await store.put_model(name, _spec(CONFIG, msgspec.to_builtins(raw), override))
    for name, kept in stored.items():
        if name not in declared and kept.source == CONFIG:
            await store.delete_model(name)
            log.info("model %s is no longer in server.yaml: removed", name)
    return catalog_of(await entries(store, settings))


def _spec(source: str, model: dict[str, Any], override: int | None = None) -> dict:
    return msgspec.to_builtins(Declared(source=source, model=model,
                                        replicas_override=override))


# --- the API ------------------------------------------------------------------------------


def model_json(entry: Entry, controller, admin: bool) -> dict:
    name = entry.model.name
    ready = sum(1 for r in controller.replicas.values()
                if r.model == name and r.state.value == "ready")
    shown = {"name": name, "source": entry.source, "description": entry.model.description,
             "replicas": entry.model.replicas, "replicas_ready": ready}
    if not admin:
        return shown
    return {
        **shown,
        # server.yaml's value for its models (an override differs from it); null for the API's.
        "replicas_in_config": entry.declared_replicas if entry.source == CONFIG else None,
        "overridden": entry.override is not None,
        "priority": entry.model.priority,
        "profiles": [{"name": p.name, "engine": p.engine, "nodes": p.nodes, "gpus": p.gpus}
                     for p in entry.model.profiles],
        "placed_on": sorted({s.node_id for r in controller.replicas.values()
                             if r.model == name for s in r.shards}),
        "unplaced": controller.unplaced.get(name),
        "spec": entry.spec,
    }


class Scale(Input):
    # null: back to server.yaml's replicas.
    replicas: Annotated[int, msgspec.Meta(ge=0)] | None


def _lock(request: Request) -> asyncio.Lock:
    # Changes one at a time: each rereads the store and hands the controller the result.
    return request.app.state.setdefault("models_lock", asyncio.Lock())


async def _find(request: Request, name: str) -> Entry:
    state = request.app.state
    found = next((e for e in await entries(state.store, state.config)
                  if e.model.name == name), None)
    if found is None:
        raise ApiError(404, f"no model {name!r}; `llmgw ctl models list` (GET /api/models) "
                       "shows them", code="model_not_found")
    return found


async def _apply(request: Request) -> list[Entry]:
    state = request.app.state
    items = await entries(state.store, state.config)
    await state.controller.set_catalog(catalog_of(items))
    return items


@get("/api/models")
async def list_models(request: Request) -> list[dict]:
    principal = await require(request)
    state = request.app.state
    return [model_json(e, state.controller, principal.is_admin)
            for e in await entries(state.store, state.config)]


@post("/api/models", status_code=201)
async def add_model(request: Request) -> dict:
    await require(request, admin=True)
    data = decode_json(await request.body() or b"null")
    try:
        raw, _ = parse_model(data)
    except ModelError as err:
        raise ApiError(400, str(err), param=err.param, code="invalid_model") from None
    state = request.app.state
    async with _lock(request):
        existing = await state.store.get_model(raw.name)
        if existing is not None or any(m.name == raw.name for m in state.config.models):
            where = ("server.yaml declares it" if existing is None
                     or _declared(existing).source == CONFIG else "it was added over the API")
            raise ApiError(409, f"model {raw.name!r} exists ({where}): scale it with `llmgw "
                           f"ctl models scale {raw.name} N`, or remove it first",
                           param="name", code="model_exists")
        # As the operator wrote it (checked above), as server.yaml keeps what it was given.
        await state.store.put_model(raw.name, _spec(API, data))
        log.info("model %s added over the API", raw.name)
        items = await _apply(request)
    return model_json(next(e for e in items if e.model.name == raw.name), state.controller,
                      True)


@delete("/api/models/{name:path}", status_code=200)
async def remove_model(request: Request, name: FromPath[str]) -> dict:
    await require(request, admin=True)
    name = name.lstrip("/")
    state = request.app.state
    async with _lock(request):
        if any(m.name == name for m in state.config.models):
            raise ApiError(409, f"model {name!r} is declared in server.yaml: remove it there "
                           "and restart the server (to stop its replicas meanwhile: `llmgw "
                           f"ctl models scale {name} 0`)", code="model_in_config")
        if not await state.store.delete_model(name):
            await _find(request, name)  # says what to do
        log.info("model %s removed over the API; its replicas stop", name)
        await _apply(request)
    return {"removed": name}


@patch("/api/models/{name:path}")
async def scale_model(request: Request, name: FromPath[str]) -> dict:
    """``{"replicas": 3}``; ``{"replicas": null}`` goes back to server.yaml's value."""
    await require(request, admin=True)
    name = name.lstrip("/")
    change = await body(request, Scale)
    state = request.app.state
    async with _lock(request):
        entry = await _find(request, name)
        if entry.source == CONFIG:
            raw = next(m for m in state.config.models if m.name == name)
            await state.store.put_model(name, _spec(CONFIG, msgspec.to_builtins(raw),
                                                    change.replicas))
        elif change.replicas is None:
            raise ApiError(400, f"model {name!r} was added over the API: it has no "
                           "server.yaml value to go back to; give a number of replicas",
                           param="replicas", code="invalid_value")
        else:
            await state.store.put_model(name, _spec(API, {**entry.spec,
                                                          "replicas": change.replicas}))
        log.info("model %s scaled to %s over the API", name,
                 "server.yaml's replicas" if change.replicas is None else change.replicas)
        items = await _apply(request)
    return model_json(next(e for e in items if e.model.name == name), state.controller, True)


ROUTES = [list_models, add_model, remove_model, scale_model]
