"""When each model that can sleep was last asked for, as this server saw it and as the
store keeps it for every server (core/idle.py decides what that means).

The gateway notes a request with :meth:`ModelActivity.asked` (one dict write, only for
models that name ``idle_unload_s``). Each server merges its notes into the store's
setting (:meth:`sync`): a follower at each follow pass, so that a request it took wakes a
sleeping model at the leader's next read; the leader as it reads the models, so that the
times outlive it. Two servers writing at once can lose one's newer time until its next
sync, which writes it again: a note is never older than the server's own view.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

from llmgw.core.idle import merged
from llmgw.store import Store

SETTING = "model_activity"


class ModelActivity:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        # Model -> the last time this server was asked for it (or, after a sync, any server).
        self.last: dict[str, float] = {}

    def asked(self, model: str) -> None:
        self.last[model] = self.clock()

    def busy(self, models: Collection[str]) -> None:
        """Models with requests in flight here: asked for as of now."""
        now = self.clock()
        for model in models:
            self.last[model] = now

    async def sync(self, store: Store, keep: Collection[str]) -> Mapping[str, float]:
        """Merge this server's times with the store's, write them back where this server
        knows a later one, and answer the merged view (only the models in ``keep``)."""
        stored = await store.get_setting(SETTING, {})
        if not isinstance(stored, dict):
            stored = {}
        stored = {m: float(t) for m, t in stored.items()
                  if m in keep and isinstance(t, int | float)}
        view = merged(stored, {m: t for m, t in self.last.items() if m in keep})
        if view != stored:
            await store.put_setting(SETTING, view)
        self.last = dict(view)
        return view
