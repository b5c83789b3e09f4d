"""Cluster identity in the store: one-time join tokens and the node certificates issued.

`PkiMixin` is inherited by `Store`; the house rules of store.py hold here too: each
method is one short transaction with no network call inside, and races are settled by
single atomic statements. A join token is redeemed by one
``UPDATE ... WHERE used_at IS NULL AND expires_at > now``, in the same transaction that
records the certificate, so of two joins with one token exactly one gets a certificate.

The store sees a token's SHA-256 only; certificates are recorded by serial (decimal
text), never their keys, so that revocation can be checked by serial at each handshake.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime

import msgspec
from sqlalchemy import String, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from llmgw.store.records import StoreError
from llmgw.store.tables import Base, UTCDateTime

# --- records -------------------------------------------------------------------------------


class JoinTokenRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A one-time token that lets one node get its first certificate. `created_by` is
    who made it, as shown to operators (a username, or "(admin token)")."""

    token_hash: str
    node: str
    created_at: datetime
    expires_at: datetime
    created_by: str
    used_at: datetime | None = None


class NodeCertRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A node certificate the cluster CA issued; `serial` is its serial number in decimal."""

    serial: str
    node: str
    not_before: datetime
    not_after: datetime
    revoked_at: datetime | None = None


class JoinTokenUnusable(StoreError):
    """`redeem_join_token`: the token is unknown, used or expired; `reason` says which
    ("unknown", "used" or "expired") and the message says what to do."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# --- tables --------------------------------------------------------------------------------


class JoinTokenRow(Base):
    __tablename__ = "join_tokens"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    node: Mapped[str] = mapped_column(String(255), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_by: Mapped[str] = mapped_column(String(255))

    def to_record(self) -> JoinTokenRecord:
        return JoinTokenRecord(token_hash=self.token_hash, node=self.node,
                               created_at=self.created_at, expires_at=self.expires_at,
                               created_by=self.created_by, used_at=self.used_at)


class NodeCertRow(Base):
    __tablename__ = "node_certs"

    serial: Mapped[str] = mapped_column(String(64), primary_key=True)
    node: Mapped[str] = mapped_column(String(255), index=True)
    not_before: Mapped[datetime] = mapped_column(UTCDateTime())
    not_after: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    def to_record(self) -> NodeCertRecord:
        return NodeCertRecord(serial=self.serial, node=self.node, not_before=self.not_before,
                              not_after=self.not_after, revoked_at=self.revoked_at)


def _when(at: datetime) -> str:
    return f"{at:%Y-%m-%d %H:%M:%S} UTC"


def unusable(token: JoinTokenRecord | None, at: datetime) -> JoinTokenUnusable | None:
    """Why `token` cannot be redeemed at `at`, or None when it can."""
    if token is None:
        return JoinTokenUnusable("unknown", "this join token is not known to the cluster; "
                                 "copy the whole command that `llmgw ctl nodes add NAME` "
                                 "printed, or make a new one")
    if token.used_at is not None:
        return JoinTokenUnusable("used", f"this join token was already used at "
                                 f"{_when(token.used_at)}; make a new one with "
                                 f"llmgw ctl nodes add {token.node}")
    if token.expires_at <= at:
        return JoinTokenUnusable("expired", f"this join token expired at "
                                 f"{_when(token.expires_at)}; make a new one with "
                                 f"llmgw ctl nodes add {token.node}")
    return None


class PkiMixin:
    """Join tokens and node certificates; mixed into `Store`, which provides `_tx`."""

    _tx: Callable[..., AbstractAsyncContextManager[AsyncSession]]

    # join tokens -------------------------------------------------------------------

    async def add_join_token(self, token: JoinTokenRecord) -> JoinTokenRecord:
        if token.expires_at <= token.created_at:
            raise StoreError("a join token must expire after it is made; give a positive ttl")
        row = JoinTokenRow(token_hash=token.token_hash, node=token.node,
                           created_at=token.created_at, expires_at=token.expires_at,
                           created_by=token.created_by, used_at=None)
        async with self._tx() as s:
            s.add(row)
            try:
                await s.flush()
            except IntegrityError as exc:
                raise StoreError("this join token exists already; make a new one") from exc
            return row.to_record()

    async def find_join_token(self, token_hash: str) -> JoinTokenRecord | None:
        async with self._tx() as s:
            row = await s.get(JoinTokenRow, token_hash)
            return None if row is None else row.to_record()

    async def list_join_tokens(self, node: str | None = None) -> list[JoinTokenRecord]:
        stmt = select(JoinTokenRow).order_by(JoinTokenRow.created_at)
        if node is not None:
            stmt = stmt.where(JoinTokenRow.node == node)
        async with self._tx() as s:
            return [row.to_record() for row in await s.scalars(stmt)]

    async def redeem_join_token(self, token_hash: str, cert: NodeCertRecord,
                                at: datetime) -> JoinTokenRecord:
        """Use the token at `at` and record `cert`, issued for the token's node, in one
        transaction: both happen or neither. Raises JoinTokenUnusable (unknown, used,
        expired) or StoreError when `cert` names another node than the token."""
        async with self._tx(write=True) as s:
            row = await s.scalar(
                update(JoinTokenRow)
                .where(JoinTokenRow.token_hash == token_hash, JoinTokenRow.used_at.is_(None),
                       JoinTokenRow.expires_at > at)
                .values(used_at=at).returning(JoinTokenRow))
            if row is None:
                found = await s.get(JoinTokenRow, token_hash)
                refusal = unusable(None if found is None else found.to_record(), at)
                raise refusal or StoreError("the join token could not be used; try again")
            if cert.node != row.node:
                raise StoreError(f"the certificate names node {cert.node!r} but the token "
                                 f"is for {row.node!r}; it must be signed for the token's node")
            await _add_cert(s, cert)
            return row.to_record()

    # node certificates -------------------------------------------------------------

    async def add_node_cert(self, cert: NodeCertRecord) -> None:
        """Record a certificate issued outside a join (a renewal over the stream)."""
        async with self._tx() as s:
            await _add_cert(s, cert)

    async def get_node_cert(self, serial: str) -> NodeCertRecord | None:
        async with self._tx() as s:
            row = await s.get(NodeCertRow, serial)
            return None if row is None else row.to_record()

    async def list_node_certs(self, node: str | None = None) -> list[NodeCertRecord]:
        stmt = select(NodeCertRow).order_by(NodeCertRow.node, NodeCertRow.not_before)
        if node is not None:
            stmt = stmt.where(NodeCertRow.node == node)
        async with self._tx() as s:
            return [row.to_record() for row in await s.scalars(stmt)]

    async def revoke_node_certs(self, node: str, at: datetime) -> list[str]:
        """Revoke every certificate of `node` that has not expired at `at` and is not
        revoked yet; returns their serials (empty when there were none)."""
        async with self._tx() as s:
            serials = await s.scalars(
                update(NodeCertRow)
                .where(NodeCertRow.node == node, NodeCertRow.revoked_at.is_(None),
                       NodeCertRow.not_after > at)
                .values(revoked_at=at).returning(NodeCertRow.serial))
            return sorted(serials)

    async def revoked_serials(self, at: datetime) -> set[str]:
        """Serials revoked and not yet expired at `at`: what a handshake must refuse."""
        stmt = select(NodeCertRow.serial).where(NodeCertRow.revoked_at.is_not(None),
                                                NodeCertRow.not_after > at)
        async with self._tx() as s:
            return set(await s.scalars(stmt))


async def _add_cert(s: AsyncSession, cert: NodeCertRecord) -> None:
    if not cert.serial.isdigit():
        raise StoreError(f"certificate serial {cert.serial!r} is not decimal digits; "
                         "record str(cert.serial_number)")
    s.add(NodeCertRow(serial=cert.serial, node=cert.node, not_before=cert.not_before,
                      not_after=cert.not_after, revoked_at=cert.revoked_at))
    try:
        await s.flush()
    except IntegrityError as exc:
        raise StoreError(f"a certificate with serial {cert.serial} is recorded already; "
                         "sign it again (serials are random)") from exc
