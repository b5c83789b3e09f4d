"""Which replica serves a request, and the wait when every replica is busy.

The controller publishes the ready replicas after every change (:meth:`Router.update`),
and with them each model's static endpoints (servers someone else runs, by URL:
``server.endpoints``), which are routed to as replicas are; an endpoint's
:class:`Endpoint` holds its ``remote``, None for a replica.
A request takes a :class:`Lease` on one replica's slot before it is forwarded and gives
it back when its answer is done, streamed or not; the choice itself is
:func:`llmgw.core.routing.choose` (affinity with bounded load, then the power of two
choices), over leases counted here.

When every replica of the model is at its slot limit, the request waits in that model's
FIFO queue, bounded in length and in time. A freed slot is handed straight to the first
waiter that may use it (not to whoever asks next), so a waiter is never overtaken by a
newcomer and nobody polls. A waiter that gives up (timeout, client gone) leaves the queue
at once; a slot handed to it in that same instant is passed on, not lost.

Everything here runs on the event loop thread: the counts need no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import weakref
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmgw.core import routing

if TYPE_CHECKING:
    from llmgw.server.endpoints import Remote

log = logging.getLogger(__name__)
DEFAULT_SLOTS = 64
DEFAULT_QUEUE_MAX = 1024
DEFAULT_QUEUE_WAIT_S = 30.0
DEFAULT_RETRY_AFTER_S = 2


class Saturated(Exception):
    """Every replica of the model is busy: answer 429 with ``Retry-After``.

    Saturated
     ├── QueueFull     the queue was full; refused without waiting
     └── QueueTimeout  waited ``wait_s`` in the queue without a slot freeing
    """

    code = "model_overloaded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(Saturated):
    code = "queue_full"


class QueueTimeout(Saturated):
    code = "queue_timeout"


@dataclass(slots=True, eq=False, weakref_slot=True)
class Endpoint:
    replica: str
    host: str
    port: int
    slots: int = DEFAULT_SLOTS
    # Leases held: what routing counts and bounds by ``slots``.
    outstanding: int = 0
    # The model's pool while this replica is in the table; None once it left.
    pool: _Pool | None = field(default=None, repr=False)
    # A static endpoint's URL, key and upstream name for the model; None for a replica.
    remote: Remote | None = field(default=None, repr=False)


class Lease:
    """One slot on one replica, held from routing until the answer is done."""

    __slots__ = ("_released", "endpoint")

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._released = False

    @property
    def replica(self) -> str:
        return self.endpoint.replica

    def release(self) -> None:
        """Free the slot and hand it to the next waiter; a second call does nothing."""
        if self._released:
            return
        self._released = True
        endpoint = self.endpoint
        endpoint.outstanding -= 1
        pool = endpoint.pool
        if pool is not None:
            pool.total -= 1
            if pool.waiters:  # else nobody to hand the slot to
                pool.hand_off(endpoint)

    def __del__(self) -> None:
        # The safety net for a lease nobody released: a stream whose generator never
        # started (the client left before the first chunk) runs no ``finally``. Without
        # this its slot would stay taken for good. Deferred to the loop, so that a
        # collection in the middle of a hand-off does not reenter it.
        if self._released:
            return
        log.warning("a lease on %s was dropped without release; releasing it", self.replica)
        try:
            asyncio.get_running_loop().call_soon(self.release)
        except RuntimeError:
            self.release()

    def __repr__(self) -> str:
        return f"Lease({self.replica}{', released' if self._released else ''})"


@dataclass(slots=True, eq=False)
class _Waiter:
    future: asyncio.Future[Lease | None]
    exclude: frozenset[str]


class _Pool:
    """One model's ready replicas, their ring and the model's queue; kept across table
    updates while the model is in the table, so its waiters stay in line."""

    __slots__ = ("endpoints", "ring", "total", "waiters")

    def __init__(self) -> None:
        self.endpoints: list[Endpoint] = []
        self.ring = routing.Ring(())
        self.total = 0  # sum of the endpoints' outstanding
        self.waiters: OrderedDict[_Waiter, None] = OrderedDict()

    def lease(self, endpoint: Endpoint) -> Lease:
        endpoint.outstanding += 1
        self.total += 1
        return Lease(endpoint)

    def reachable(self, exclude: Collection[str]) -> bool:
        return any(e.replica not in exclude for e in self.endpoints)

    def hand_off(self, endpoint: Endpoint) -> None:
        """A slot of ``endpoint`` is free: give it to the first waiter that may use it."""
        if not self.waiters or endpoint.outstanding >= endpoint.slots:
            return
        chosen = next((w for w in self.waiters
                       if not w.future.done() and endpoint.replica not in w.exclude), None)
        if chosen is not None:
            del self.waiters[chosen]
            chosen.future.set_result(self.lease(endpoint))

    def drain(self, rng: random.Random) -> None:
        """After a table change: serve the waiters that now fit, in order, and tell those
        whose every replica is gone."""
        for waiter in list(self.waiters):
            if waiter.future.done():
                continue
            endpoint = routing.two_choices(self.endpoints, rng, waiter.exclude)
            if endpoint is not None:
                del self.waiters[waiter]
                waiter.future.set_result(self.lease(endpoint))
            elif not self.reachable(waiter.exclude):
                del self.waiters[waiter]
                waiter.future.set_result(None)


class Router:
    """The per-process routing table: ready replicas per model, their leases, the queues."""

    def __init__(self, *, default_slots: int = DEFAULT_SLOTS,
                 queue_max: int = DEFAULT_QUEUE_MAX,
                 queue_wait_s: float = DEFAULT_QUEUE_WAIT_S,
                 epsilon: float = routing.DEFAULT_EPSILON,
                 retry_after_s: int = DEFAULT_RETRY_AFTER_S,
                 rng: random.Random | None = None) -> None:
        if default_slots < 1 or queue_max < 0 or queue_wait_s < 0 or epsilon < 0:
            raise ValueError("slots must be positive; queue length, wait and ε not negative")
        self.default_slots = default_slots
        self.queue_max = queue_max
        self.queue_wait_s = queue_wait_s
        self.epsilon = epsilon
        self.retry_after_s = retry_after_s
        self._rng = rng or random.Random()
        self._pools: dict[str, _Pool] = {}
        self._updated = asyncio.Event()  # set (and made anew) at each update()
        # Replicas that left the table with leases still out, so that one coming back
        # (a brief health-check failure) keeps its count. Gone with their last lease.
        self._departed: weakref.WeakValueDictionary[str, Endpoint] = (
            weakref.WeakValueDictionary())

    async def changed(self, timeout_s: float) -> None:
        """Wait until the table is next replaced, at most ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._updated.wait()

    def update(self, ready: Mapping[str, Iterable[tuple]]) -> None:
        """Replace the table: per model, ``(replica, address, port)`` or
        ``(replica, address, port, slots)`` of each ready replica, and
        ``(name, host, port, slots, remote)`` of each static endpoint to route to.

        Replicas that stay keep their counts; leases on replicas that left still release
        safely. Waiters are served when the change freed room, and answered ``None`` when
        no replica they may use is left."""
        current = {e.replica: e for pool in self._pools.values() for e in pool.endpoints}
        pools: dict[str, _Pool] = {}
        for model, replicas in ready.items():
            pool = self._pools.get(model) or _Pool()
            endpoints = []
            for replica, address, port, *rest in sorted(replicas):
                endpoint = current.get(replica) or self._departed.get(replica)
                if endpoint is None or (endpoint.host, endpoint.port) != (address, port):
                    endpoint = Endpoint(replica, address, port)
                endpoint.slots = rest[0] if rest and rest[0] else self.default_slots
                endpoint.remote = rest[1] if len(rest) > 1 else None
                endpoint.pool = pool
                endpoints.append(endpoint)
            if [e.replica for e in endpoints] != [e.replica for e in pool.endpoints]:
                pool.ring = routing.Ring([e.replica for e in endpoints])
            pool.endpoints = endpoints
            pool.total = sum(e.outstanding for e in endpoints)
            pools[model] = pool
        staying = {id(e) for pool in pools.values() for e in pool.endpoints}
        for model, pool in self._pools.items():
            for endpoint in pool.endpoints:
                if id(endpoint) not in staying:
                    endpoint.pool = None
                    if endpoint.outstanding > 0:
                        self._departed[endpoint.replica] = endpoint
            if model not in pools:
                pool.endpoints = []
                pool.drain(self._rng)  # answers every waiter None
        self._pools = pools
        for pool in pools.values():
            if pool.waiters:
                pool.drain(self._rng)
        # Wake whoever waits for a change (a new event for the next one).
        self._updated.set()
        self._updated = asyncio.Event()

    def pick(self, model: str, affinity_key: str | bytes | None = None,
             exclude: Collection[str] = ()) -> Lease | None:
        """A lease on a replica with a free slot now, without waiting; ``None`` if none."""
        pool = self._pools.get(model)
        if pool is None:
            return None
        endpoints = pool.endpoints
        if len(endpoints) == 1:  # nothing to choose between: no draw, no ring
            endpoint = endpoints[0]
            return pool.lease(endpoint) if routing.is_eligible(endpoint, exclude) else None
        endpoint = routing.choose(endpoints, self._rng, ring=pool.ring, key=affinity_key,
                                  total=pool.total, epsilon=self.epsilon, exclude=exclude)
        return None if endpoint is None else pool.lease(endpoint)

    def choices(self, model: str) -> int:
        """How many ready replicas ``model`` has: with one, an affinity key would choose
        nothing (a caller need not work it out)."""
        pool = self._pools.get(model)
        return 0 if pool is None else len(pool.endpoints)

    def reachable(self, model: str, exclude: Collection[str] = ()) -> bool:
        """Whether ``model`` has a ready replica outside ``exclude``, busy or not."""
        pool = self._pools.get(model)
        return pool is not None and pool.reachable(exclude)

    async def acquire(self, model: str, affinity_key: str | bytes | None = None,
                      exclude: Collection[str] = (), wait_s: float | None = None
                      ) -> Lease | None:
        """A lease on one of ``model``'s ready replicas not in ``exclude``, waiting up to
        ``wait_s`` (default: the router's) in the model's queue while all are full.

        ``None``: the model has no ready replica outside ``exclude`` (answer 503).
        Raises :class:`QueueFull` or :class:`QueueTimeout` (answer 429). The caller must
        ``release()`` the lease when the answer is done."""
        lease = self.pick(model, affinity_key, exclude)
        if lease is not None:
            return lease
        pool = self._pools.get(model)
        if pool is None or not pool.reachable(exclude):
            return None
        wait_s = self.queue_wait_s if wait_s is None else wait_s
        if len(pool.waiters) >= self.queue_max or wait_s <= 0:
            raise QueueFull(f"every replica of {model!r} is busy and "
                            f"{len(pool.waiters)} request(s) are already waiting",
                            self.retry_after_s)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), frozenset(exclude))
        pool.waiters[waiter] = None
        try:
            async with asyncio.timeout(wait_s):
                return await waiter.future
        except TimeoutError:
            if _settled(waiter.future):
                return waiter.future.result()  # a slot came in the same instant: take it
            raise QueueTimeout(f"every replica of {model!r} stayed busy for {wait_s:g} s",
                               self.retry_after_s) from None
        except asyncio.CancelledError:
            if _settled(waiter.future) and (granted := waiter.future.result()) is not None:
                granted.release()
            raise
        finally:
            pool.waiters.pop(waiter, None)

    def queue_lengths(self) -> dict[str, int]:
        """Per model with replicas, the requests waiting for a slot (a gauge)."""
        return {model: len(pool.waiters) for model, pool in self._pools.items()}

    def in_flight(self) -> dict[str, int]:
        """Requests each ready replica is serving (the controller reads it as load)."""
        return {e.replica: e.outstanding
                for pool in self._pools.values() for e in pool.endpoints}


def _settled(future: asyncio.Future) -> bool:
    return future.done() and not future.cancelled()
