"""What the store tests share: a clock the test moves, and a controller on a real store
with nodes unreachable after 3 s and lost after 8 s."""

from __future__ import annotations

import time
from collections.abc import Callable

from llmgw import config
from llmgw.core import reconcile
from llmgw.core.catalog import Catalog
from llmgw.core.inventory import Timeouts
from llmgw.server.agents.sessions import NodeSessions
from llmgw.server.controller import Controller
from llmgw.store import Store


class Clock:
    """Wall-clock seconds that move only when a test sets ``now``."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def controller_on(store: Store, clock: Callable[[], float] = time.time, *,
                  catalog: Catalog | None = None,
                  settings: config.ServerConfig | None = None,
                  policy: reconcile.Policy | None = None,
                  interval_s: float = 1.0) -> Controller:
    return Controller(catalog or Catalog(), store,
                      NodeSessions(Timeouts(unreachable_after_s=3, lost_after_s=8)),
                      policy or reconcile.Policy(adoption_grace_s=5), interval_s=interval_s,
                      heartbeat_interval_s=1, clock=clock,
                      settings=settings or config.ServerConfig())
