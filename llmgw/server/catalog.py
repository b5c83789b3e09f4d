"""The catalog the server serves: server.yaml's models merged with those added over the API.

Two sources, one catalog. server.yaml declares some models (source ``config``): they stay
declared there, and the store mirrors them at every start. Others are added over the API
(source ``api``) and live in the store alone, so they survive restarts. Scaling works for
both: an API model's replicas are simply changed; a server.yaml model gets an override
kept beside its mirror, which outlives restarts and edits of server.yaml until it is reset
(``PATCH {"replicas": null}``, ``llmgw ctl models scale NAME --reset``).

What the store keeps per model (``StoredModel.spec``) is a ``Declared``. A row written
before sources existed is a bare server.yaml entry: it reads as a ``config`` mirror.

The merge is here, not in the HTTP handlers, because the server runs it at start
(``sync_declared``) as well as after every change over the API (``entries``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import msgspec

from llmgw import config
from llmgw.core.catalog import (
    Catalog,
    CatalogError,
    Model,
    clashes,
    fallback_problems,
    model_from_config,
)
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


def declared(stored: StoredModel) -> Declared:
    """What the store keeps of a model, read as a ``Declared``."""
    if "source" not in stored.spec:
        return Declared(source=CONFIG, model=stored.spec)
    return msgspec.convert(stored.spec, Declared)


def stored_spec(source: str, model: dict[str, Any], override: int | None = None) -> dict:
    """The spec to store for a model from ``source``."""
    return msgspec.to_builtins(Declared(source=source, model=model,
                                        replicas_override=override))


async def entries(store: Store, settings: config.ServerConfig) -> list[Entry]:
    """server.yaml's models in its order, then the API's by name. server.yaml's come from
    the file itself (checked at start); only their overrides come from the store."""
    stored = {s.name: declared(s) for s in await store.list_models()}
    result = []
    for i, raw in enumerate(settings.models):
        kept = stored.get(raw.name)
        override = kept.replicas_override if kept and kept.source == CONFIG else None
        model = model_from_config(raw, f"models[{i}]")
        if override is not None:
            model = dataclasses.replace(model, replicas=override)
        result.append(Entry(CONFIG, msgspec.to_builtins(raw), model, raw.replicas, override))
    in_config = {m.name for m in settings.models}
    so_far = catalog_of(result)
    for name, kept in sorted(stored.items()):
        if kept.source != API or name in in_config:
            continue
        where = f"model {name} (added over the API)"
        try:
            raw, model = parse_model(kept.model, where)
        except ModelError as err:
            # An upgrade may have tightened a rule: serve the rest, say what to do.
            log.error("%s; not served: fix it with `llmgw ctl models remove %s` and add it "
                      "again", err, name)
            continue
        clash = clashes(model, so_far)
        if clash is not None:
            # server.yaml took one of its names (or aliases) since it was added.
            log.error("%s: %s; not served: remove it (`llmgw ctl models remove %s`) or "
                      "change server.yaml", where, clash[1], name)
            continue
        result.append(Entry(API, kept.model, model, raw.replicas, None))
        so_far = Catalog((*so_far.models, model))
    return result


def clash_with_catalog(items: list[Entry], raw: config.Model) -> tuple[str, str] | None:
    """Why ``raw`` (checked by ``parse_model``) cannot be added beside ``items``: the key
    of a name or alias of it that is taken, and words naming both; None when it can."""
    return clashes(model_from_config(raw), catalog_of(items))


def fallbacks_refused(items: list[Entry], raw: config.Model) -> tuple[str, str] | None:
    """Why ``raw`` (checked by ``parse_model``, its names free) cannot be added beside
    ``items`` for its fallbacks: the key of one that names no model or alias there, or
    that leads back to it, and words saying which; None when every one can be followed.
    (Problems of the models already there are not the new one's.)"""
    catalog = Catalog((*catalog_of(items).models, model_from_config(raw)))
    # A cycle through the new model is always one of its own fallbacks leading back.
    return next(((key, why) for model, key, why in fallback_problems(catalog)
                 if model == raw.name), None)


def fallen_back_on(items: list[Entry], name: str) -> list[str]:
    """The other models whose fallbacks name model ``name`` (or one of its aliases)."""
    target = next((e.model for e in items if e.model.name == name), None)
    if target is None:
        return []
    names = {target.name, *target.aliases}
    return [e.model.name for e in items
            if e.model.name != name and names.intersection(e.model.fallbacks)]


def catalog_of(items: list[Entry]) -> Catalog:
    return Catalog(tuple(e.model for e in items))


async def sync_declared(store: Store, settings: config.ServerConfig) -> Catalog:
    """At start: mirror server.yaml's models into the store, keeping their overrides and
    the API's models; forget server.yaml models that are no longer declared."""
    in_config = {m.name: m for m in settings.models}
    stored = {s.name: declared(s) for s in await store.list_models()}
    for name, raw in in_config.items():
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
        await store.put_model(name, stored_spec(CONFIG, msgspec.to_builtins(raw), override))
    for name, kept in stored.items():
        if name not in in_config and kept.source == CONFIG:
            await store.delete_model(name)
            log.info("model %s is no longer in server.yaml: removed", name)
    return catalog_of(await entries(store, settings))
