"""Which server leads: the one that holds the lease in the store (store/leases.py).

Every server serves ``/v1`` and ``/api``; only the leader runs the controller and takes
agent streams. Each server tries for the lease every quarter of its length; the leader
renews it as often. A leader leads only while it is sure of its lease: until the lease's
length has passed since the renewal was sent, less a margin, by its own monotonic clock,
which runs on through a SIGSTOP or a frozen VM. So a leader that was paused, or that
cannot reach the store, stops acting before another server can take over. When the store
answers again and the lease is still its own, it goes on in the same term; if another
server took it, it steps down for good (its writes are fenced in the store by then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

from llmgw.store import Store, StoreError, StoreUnavailable
from llmgw.store.leases import LeaseRecord

log = logging.getLogger(__name__)

# A renewal's answer may arrive this long after the database extended the lease.
_MARGIN_S = 0.5


def server_name(host: str, port: int) -> str:
    """This server's name in the cluster, when server.yaml gives none: host and port,
    which tell servers on one machine apart. A wildcard address names the machine."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"{host}:{port}"


class Leadership:
    def __init__(self, store: Store, name: str, address: str, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.name = name
        self.address = address
        self.lease_s = lease_s
        self.clock = clock
        self.term: int | None = None  # while this server holds the lease
        self.since: float | None = None  # Unix time it took the lease (database clock)
        self.leader: LeaseRecord | None = None  # as last read: this server or another
        self._sure_until = 0.0
        self._paused = False
        self._on_lead: list[Callable[[int], None]] = []
        self._on_deposed: list[Callable[[str], None]] = []
        self._on_servers: list[Callable[[int], None]] = []
        self._servers_up = 1
        self._wake = asyncio.Event()

    def on_lead(self, listener: Callable[[int], None]) -> None:
        """Called with the term each time this server takes the lease."""
        self._on_lead.append(listener)

    def on_deposed(self, listener: Callable[[str], None]) -> None:
        """Called with the reason when another server took the lease from this one."""
        self._on_deposed.append(listener)

    def on_servers(self, listener: Callable[[int], None]) -> None:
        """Called with how many servers are up, each time that changes."""
        self._on_servers.append(listener)

    def servers_up(self) -> int:
        """Servers up, this one included: they share each engine's slots."""
        return self._servers_up

    def leads(self) -> bool:
        return self.term is not None and self.clock() < self._sure_until

    def describe_leader(self) -> str:
        """Who leads, in words: for a refused agent and for operators."""
        leader = self.leader
        if leader is None or not leader.live:
            return "no server leads the cluster right now (one will within "\
                   f"{self.lease_s:g} s)"
        return f"{leader.holder} leads the cluster (at {leader.address})"

    async def start(self) -> None:
        """One try for the lease, before serving: a lone server leads from its start."""
        await self._try()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.lease_s / 4):
                    await self._wake.wait()
            self._wake.clear()
            await self._try()

    async def stop(self) -> None:
        """Hand the lease on at once rather than when it runs out (a clean shutdown)."""
        with contextlib.suppress(StoreError):
            if self.term is not None:
                await self.store.give_up_lead(self.name, self.term)
            await self.store.server_gone(self.name)
        self.term = None

    async def _try(self) -> None:
        sent = self.clock()
        try:
            if self.term is not None:
                await self._renew(sent)
            else:
                await self._take(sent)
            await self.store.server_alive(self.name, self.address, self.lease_s)
            if self.term is None:
                self.leader = await self.store.leader()
            up = max(1, sum(1 for s in await self.store.list_servers() if s.live))
            if up != self._servers_up:
                log.info("%d server(s) up: each routes to an engine with its share of the "
                         "engine's slots", up)
                self._servers_up = up
                for listener in self._on_servers:
                    listener(up)
        except StoreUnavailable:
            pass  # the store logged the outage; leads() turns False when the lease runs out
        except StoreError as err:
            log.warning("leadership: %s", err)
        if self.term is not None and not self.leads() and not self._paused:
            self._paused = True
            log.warning("not sure this server still leads (the store has not renewed its "
                        "lease for %g s): the controller waits until it is", self.lease_s)

    async def _take(self, sent: float) -> None:
        lease = await self.store.take_lead(self.name, self.address, self.lease_s)
        if lease is None:
            return
        self.term, self.since, self.leader = lease.term, lease.since, lease
        self._sure_until = sent + self.lease_s - _MARGIN_S
        self._paused = False
        log.info("this server (%s) leads the cluster, term %d", self.name, lease.term)
        for listener in self._on_lead:
            listener(lease.term)

    async def _renew(self, sent: float) -> None:
        if await self.store.renew_lead(self.name, self.term, self.lease_s):
            self._sure_until = sent + self.lease_s - _MARGIN_S
            if self._paused:
                self._paused = False
                log.info("the store renewed this server's lease: leading again, term %d",
                         self.term)
            return
        term, self.term, self.since = self.term, None, None
        self.leader = await self.store.leader()
        reason = (f"another server took the lead from term {term}: "
                  f"{self.describe_leader()}")
        log.warning("%s; this server follows", reason)
        for listener in self._on_deposed:
            listener(reason)
