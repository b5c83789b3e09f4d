"""Scale to zero: which models are idle, and how many replicas each then keeps.

A model that names ``idle_unload_s`` keeps only ``min_replicas`` of its replicas once that
long has passed since it was last asked for (a request came, or one was still being
answered), and all of them again from the next request. Without a request since it was
declared (nothing recorded), it is idle from the start: like llama-swap, nothing is
loaded before someone asks. Times are wall-clock seconds, as every server records them
(the store keeps them across restarts and between servers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from llmgw.core.catalog import Catalog, Model


def is_idle(model: Model, last_asked: float | None, now: float) -> bool:
    """Whether ``model`` has gone unasked long enough to keep only its ``min_replicas``."""
    if model.idle_unload_s is None:
        return False
    return last_asked is None or now - last_asked >= model.idle_unload_s


def awake_catalog(catalog: Catalog, last_asked: Mapping[str, float], now: float
                  ) -> tuple[Catalog, frozenset[str]]:
    """The catalog placement plans for, each idle model's ``replicas`` lowered to its
    ``min_replicas``, and the names of the idle models that keep fewer than they run
    awake (asleep: the next request wakes them). The catalog itself when none is."""
    asleep: list[str] = []
    models: list[Model] = []
    for model in catalog.models:
        keep = min(model.min_replicas, model.replicas)
        if keep < model.replicas and is_idle(model, last_asked.get(model.name), now):
            asleep.append(model.name)
            model = dataclasses.replace(model, replicas=keep)
        models.append(model)
    if not asleep:
        return catalog, frozenset()
    return Catalog(tuple(models)), frozenset(asleep)


def merged(*views: Mapping[str, float]) -> dict[str, float]:
    """Each model's latest time across ``views`` (this server's, the store's)."""
    out: dict[str, float] = {}
    for view in views:
        for model, when in view.items():
            if when > out.get(model, float("-inf")):
                out[model] = when
    return out
