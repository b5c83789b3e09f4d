"""Leases in the store: which server leads the cluster, and which servers are alive.

One row, ``controller``, is the leader's lease: its holder (a server's name), the term
(bumped by one each time the lease changes hands or is taken again), and when it runs
out. A lease row rather than an advisory lock, because a lock lives as long as its
connection does: a leader that is paused (SIGSTOP, a frozen VM) keeps its connection open
and would lead forever without leading. Times are the database's own clock, so servers
with skewed clocks still agree on when a lease has run out.

Fencing: a write of what the cluster should run carries the leader's term (``term=`` on
the store's methods), and its transaction first touches the lease row where the term
still matches. A deposed
leader's write finds no such row and is refused with `Fenced`; on PostgreSQL the touch
also holds the row's lock until commit, so a takeover cannot slip in between the check
and the write. A row per server (``server:<name>``) says which servers are alive, for
`ctl status` and for sharing an engine's slots among the servers that route to it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import msgspec
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    String,
    case,
    literal_column,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from llmgw.store.records import StoreError
from llmgw.store.tables import Base

LEADER_LEASE = "controller"
_SERVER_PREFIX = "server:"


class Fenced(StoreError):
    """A write carried a term that no longer leads: another server took the lease."""


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A lease as the database sees it now: ``expires_in_s`` is negative once it ran out."""

    name: str
    holder: str
    address: str
    term: int
    since: float  # Unix time, by the database's clock
    expires_in_s: float

    @property
    def live(self) -> bool:
        return bool(self.holder) and self.expires_in_s > 0


class LeaseRow(Base):
    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255), default="")
    address: Mapped[str] = mapped_column(String(1024), default="")
    term: Mapped[int] = mapped_column(BigInteger, default=0)
    since: Mapped[float] = mapped_column(Float, default=0.0)
    expires_at: Mapped[float] = mapped_column(Float, default=0.0)


class LeaseMixin:
    """Leader election and server liveness; mixed into `Store`, which provides `_tx`,
    `_insert` and `backend`."""

    _tx: Callable[..., AbstractAsyncContextManager[AsyncSession]]
    _insert: Callable
    backend: str

    def _db_now(self) -> ColumnElement[float]:
        """The database's clock as Unix seconds, with sub-second precision."""
        if self.backend == "postgresql":
            return literal_column("extract(epoch from clock_timestamp())::float8")
        return literal_column("((julianday('now') - 2440587.5) * 86400.0)")

    async def take_lead(self, holder: str, address: str, ttl_s: float) -> LeaseRecord | None:
        """Take the leader's lease if it ran out, or if ``holder`` already holds it (the same
        server, restarted), with a new term. None when another server holds it."""
        now = self._db_now()
        stmt = (update(LeaseRow)
                .where(LeaseRow.name == LEADER_LEASE,
                       (LeaseRow.expires_at < now) | (LeaseRow.holder == holder))
                .values(holder=holder, address=address, term=LeaseRow.term + 1, since=now,
                        expires_at=now + ttl_s)
                .returning(LeaseRow.term))
        async with self._tx(write=True) as s:
            await self._ensure_row(s, LEADER_LEASE)
            term = (await s.execute(stmt)).scalar_one_or_none()
        return None if term is None else await self.leader()

    async def renew_lead(self, holder: str, term: int, ttl_s: float) -> bool:
        """Extend the lease ``term`` holds; False once another server took it."""
        now = self._db_now()
        stmt = (update(LeaseRow)
                .where(LeaseRow.name == LEADER_LEASE, LeaseRow.holder == holder,
                       LeaseRow.term == term)
                .values(expires_at=now + ttl_s))
        async with self._tx() as s:
            return (await s.execute(stmt)).rowcount == 1

    async def give_up_lead(self, holder: str, term: int) -> None:
        """Let the lease run out now (a server stopping): another server leads at once."""
        stmt = (update(LeaseRow)
                .where(LeaseRow.name == LEADER_LEASE, LeaseRow.holder == holder,
                       LeaseRow.term == term)
                .values(expires_at=0.0))
        async with self._tx() as s:
            await s.execute(stmt)

    async def leader(self) -> LeaseRecord | None:
        """The leader's lease, live or run out; None if no server ever led."""
        found = await self._leases(LeaseRow.name == LEADER_LEASE)
        return found[0] if found and found[0].holder else None

    async def server_alive(self, name: str, address: str, ttl_s: float) -> None:
        """Say that server ``name`` is up for ``ttl_s`` more seconds."""
        key, now = _SERVER_PREFIX + name, self._db_now()
        async with self._tx(write=True) as s:
            await self._ensure_row(s, key)
            await s.execute(update(LeaseRow).where(LeaseRow.name == key).values(
                holder=name, address=address, expires_at=now + ttl_s,
                # Since it last came up, not since it was first seen.
                since=case((LeaseRow.expires_at < now, now), else_=LeaseRow.since)))

    async def server_gone(self, name: str) -> None:
        async with self._tx() as s:
            await s.execute(update(LeaseRow).where(LeaseRow.name == _SERVER_PREFIX + name)
                            .values(expires_at=0.0))

    async def list_servers(self) -> list[LeaseRecord]:
        """Every server that said it was up, live or not, by name."""
        found = await self._leases(LeaseRow.name.startswith(_SERVER_PREFIX))
        return [msgspec.structs.replace(r, name=r.name.removeprefix(_SERVER_PREFIX))
                for r in found]

    async def _leases(self, where: ColumnElement[bool]) -> list[LeaseRecord]:
        stmt = (select(LeaseRow, (LeaseRow.expires_at - self._db_now()).label("left"))
                .where(where).order_by(LeaseRow.name))
        async with self._tx() as s:
            return [LeaseRecord(name=row.name, holder=row.holder, address=row.address,
                                term=row.term, since=row.since, expires_in_s=left)
                    for row, left in await s.execute(stmt)]

    async def _ensure_row(self, s: AsyncSession, name: str) -> None:
        await s.execute(self._insert(LeaseRow).values(name=name).on_conflict_do_nothing(
            index_elements=[LeaseRow.name]))

    @staticmethod
    async def fence(s: AsyncSession, term: int) -> None:
        """First statement of a fenced write: refuse it unless ``term`` still leads."""
        touched = await s.execute(update(LeaseRow).where(
            LeaseRow.name == LEADER_LEASE, LeaseRow.term == term).values(term=LeaseRow.term))
        if touched.rowcount != 1:
            raise Fenced(f"term {term} no longer leads the cluster: another server took the "
                         "lead, and this server's write was refused")
