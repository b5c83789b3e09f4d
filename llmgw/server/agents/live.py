"""The agent streams open on this server over mTLS, by node and certificate serial: what
a revocation must close (``mtls.AgentListener`` adds them).

Apart from mtls.py, which brings aiohttp: a server without ``tls`` keeps a LiveStreams
(the revoke endpoint calls it) and never needs the listener, nor its imports (0.27 s of
CPU at every start, measured importing ``server.run`` with and without them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from llmgw.server.agents.protocol import CLOSE_UNAUTHORIZED, AgentSocket, Identity
from llmgw.store import StoreError

if TYPE_CHECKING:
    from llmgw.store import Store

log = logging.getLogger(__name__)

WATCH_S = 2.0  # how often live streams are checked against the store's revocations


@dataclass(eq=False)
class _Live:
    identity: Identity
    socket: AgentSocket


@dataclass
class LiveStreams:
    """The mTLS streams open on this server, by node and certificate serial: what a
    revocation must close. The revoke endpoint calls ``on_revoked``."""

    _live: set[_Live] = field(default_factory=set)

    def add(self, identity: Identity, socket: AgentSocket) -> _Live:
        entry = _Live(identity, socket)
        self._live.add(entry)
        return entry

    def discard(self, entry: _Live) -> None:
        self._live.discard(entry)

    def nodes(self) -> dict[str, list[int]]:
        """Each connected node's certificate serials (more than one while a newer stream
        replaces an older one)."""
        found: dict[str, list[int]] = {}
        for entry in self._live:
            found.setdefault(entry.identity.node, []).append(entry.identity.serial)
        return found

    async def _close(self, entries: list[_Live], reason: str) -> int:
        for entry in entries:
            log.warning("closing the agent stream of %s (certificate serial %x): %s",
                        entry.identity.node, entry.identity.serial, reason)
        await asyncio.gather(*(e.socket.close(CLOSE_UNAUTHORIZED, reason) for e in entries),
                             return_exceptions=True)
        return len(entries)

    async def close_node(self, node: str, reason: str) -> int:
        """Close every live stream of ``node``; returns how many were closed."""
        return await self._close([e for e in self._live if e.identity.node == node], reason)

    async def close_serials(self, serials: Iterable[int | str], reason: str) -> int:
        """Close the live streams whose certificate has one of ``serials`` (int, or the
        store's decimal text); returns how many were closed."""
        wanted = {int(s) for s in serials}
        return await self._close([e for e in self._live if e.identity.serial in wanted], reason)

    async def on_revoked(self, node: str, serials: list[str]) -> int:
        """The revoke endpoint's callback (``app.state.on_revoked``): every certificate of
        the node that had not expired was revoked, so each of its streams goes."""
        return await self.close_node(node, "its certificate was revoked")

    async def close_all(self, reason: str) -> int:
        return await self._close(list(self._live), reason)

    async def watch(self, store: Store, every_s: float = WATCH_S) -> None:
        """Close live streams whose certificate was revoked (by any server sharing the
        store) or has expired, every ``every_s``; runs until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            if not self._live:
                continue
            now = datetime.now(UTC)
            expired = [e for e in self._live if e.identity.not_after <= now]
            if expired:
                await self._close(expired, "its certificate expired; the agent renews it "
                                  "before that, so check the agent's log")
            try:
                revoked = await store.revoked_serials(now)
            except StoreError as err:
                log.warning("cannot read revoked certificates from the store: %s", err)
                continue
            live = {e.identity.serial for e in self._live}
            hit = live & {int(s) for s in revoked}
            if hit:
                await self.close_serials(hit, "its certificate was revoked")
