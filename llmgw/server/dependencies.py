"""The server's parts, handed to handlers as Litestar dependencies.

``app.build`` keeps each part in the app's state under one name (``store``, ``config``,
``controller`` …). A handler names the part it needs as a typed parameter
(``store: Store``) and lists the providers in its own ``dependencies``, so it never reaches
into ``app.state``, and it works in any app whose state holds the parts it names: a test
builds one with a store and nothing else.
"""

from __future__ import annotations

from typing import Any

from litestar.datastructures import State
from litestar.di import Provide


def from_state(name: str) -> Provide:
    """A dependency on the part the app's state holds under ``name``."""

    def provide(state: State) -> Any:
        return state[name]

    provide.__name__ = provide.__qualname__ = f"provide_{name}"
    return Provide(provide, sync_to_thread=False)


def from_states(*names: str) -> dict[str, Provide]:
    """``from_state`` for each of ``names``, as a handler's ``dependencies``."""
    return {name: from_state(name) for name in names}
