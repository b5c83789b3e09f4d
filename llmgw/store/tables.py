"""Table definitions (SQLAlchemy 2 declarative), private to the store.

Rows never leave the store: `to_record()` turns each into its plain frozen record.

One schema for SQLite and PostgreSQL: constraint names come from a naming convention so
that the migration chain in `migrations/` names them the same way on both backends.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Date,
    DateTime,
    ForeignKey,
    Integer,
    MetaData,
    String,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from llmgw.core.usage import PERIODS, Limits
from llmgw.store.records import (
    ACCOUNT_ROLES,
    AccountRecord,
    ApiKeyRecord,
    InviteRecord,
    NodeRecord,
    SessionRecord,
    StoredModel,
)

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in and out on both backends.

    SQLite keeps no offset and hands back naive values; PostgreSQL hands back the session's
    zone. Naive input is refused: its meaning depends on the caller's machine.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value.isoformat()}: pass an aware UTC datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def json_type(*, nullable: bool = False) -> JSON:
    """JSON, as JSONB on PostgreSQL; a nullable column keeps Python None as SQL NULL."""
    return JSON(none_as_null=nullable).with_variant(JSONB(none_as_null=nullable), "postgresql")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ModelRow(Base):
    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    spec: Mapped[dict[str, Any]] = mapped_column(json_type())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())

    def to_record(self) -> StoredModel:
        return StoredModel(
            name=self.name, spec=self.spec, created_at=self.created_at, updated_at=self.updated_at
        )


class NodeRow(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    address: Mapped[str] = mapped_column(String(1024))
    state: Mapped[str] = mapped_column(String(32))
    inventory: Mapped[dict[str, Any]] = mapped_column(json_type())
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime())
    state_changed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    def to_record(self) -> NodeRecord:
        return NodeRecord(
            id=self.id,
            address=self.address,
            state=self.state,
            inventory=self.inventory,
            registered_at=self.registered_at,
            last_seen_at=self.last_seen_at,
            state_changed_at=self.state_changed_at,
        )


class SettingRow(Base):
    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[Any] = mapped_column(json_type())


class CounterRow(Base):
    """Monotonic counters (the placement epoch), bumped by one atomic upsert."""

    __tablename__ = "counters"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    prefix: Mapped[str] = mapped_column(String(64), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(255))
    name: Mapped[str] = mapped_column(String(255))
    allowed_models: Mapped[list[str] | None] = mapped_column(
        json_type(nullable=True), nullable=True
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # A deleted account takes its keys with it: a key must never outlive its owner.
    account_id: Mapped[int | None] = mapped_column(
        ForeignKey("accounts.id", ondelete="CASCADE"), nullable=True, index=True
    )
    # Limits (llmgw.core.usage.Limits); NULL is unlimited.
    rpm: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tpm: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_per_day: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_per_month: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    def to_record(self) -> ApiKeyRecord:
        return ApiKeyRecord(
            id=self.id,
            prefix=self.prefix,
            secret_hash=self.secret_hash,
            name=self.name,
            allowed_models=self.allowed_models,
            created_at=self.created_at,
            expires_at=self.expires_at,
            revoked_at=self.revoked_at,
            account_id=self.account_id,
            limits=Limits(
                rpm=self.rpm,
                tpm=self.tpm,
                tokens_per_day=self.tokens_per_day,
                tokens_per_month=self.tokens_per_month,
            ),
        )


class UsageWindowRow(Base):
    """A key's requests and tokens in one fixed UTC window (a minute, a day, a month).

    Bumped by atomic upserts, so every server sharing the store counts into one row;
    windows that have ended are pruned.
    """

    __tablename__ = "usage_windows"
    __table_args__ = (CheckConstraint(f"period IN {PERIODS!r}", name="period"),)

    key_id: Mapped[int] = mapped_column(
        ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True
    )
    period: Mapped[str] = mapped_column(String(8), primary_key=True)
    start: Mapped[datetime] = mapped_column(UTCDateTime(), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int] = mapped_column(BigInteger)


class UsageDayRow(Base):
    """What a key used of a model on a UTC day: the record kept for reporting."""

    __tablename__ = "usage_days"

    key_id: Mapped[int] = mapped_column(
        ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True
    )
    day: Mapped[date] = mapped_column(Date, primary_key=True)
    model: Mapped[str] = mapped_column(String(255), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)


class AccountRow(Base):
    __tablename__ = "accounts"
    __table_args__ = (CheckConstraint(f"role IN {ACCOUNT_ROLES!r}", name="role"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    username: Mapped[str] = mapped_column(String(255), unique=True)
    password_hash: Mapped[str] = mapped_column(String(255))
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    disabled_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    def to_record(self) -> AccountRecord:
        return AccountRecord(
            id=self.id,
            username=self.username,
            password_hash=self.password_hash,
            role=self.role,
            created_at=self.created_at,
            disabled_at=self.disabled_at,
        )


class SessionRow(Base):
    __tablename__ = "sessions"

    token_hash: Mapped[str] = mapped_column(String(255), primary_key=True)
    account_id: Mapped[int] = mapped_column(
        ForeignKey("accounts.id", ondelete="CASCADE"), index=True
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())

    def to_record(self) -> SessionRecord:
        return SessionRecord(
            token_hash=self.token_hash,
            account_id=self.account_id,
            created_at=self.created_at,
            expires_at=self.expires_at,
        )


class InviteRow(Base):
    """A signup code; who made and who used it survive as NULL if that account goes."""

    __tablename__ = "invites"

    code_hash: Mapped[str] = mapped_column(String(255), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    created_by: Mapped[int | None] = mapped_column(
        ForeignKey("accounts.id", ondelete="SET NULL"), nullable=True
    )
    used_by: Mapped[int | None] = mapped_column(
        ForeignKey("accounts.id", ondelete="SET NULL"), nullable=True
    )
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    def to_record(self) -> InviteRecord:
        return InviteRecord(
            code_hash=self.code_hash,
            created_at=self.created_at,
            expires_at=self.expires_at,
            created_by=self.created_by,
            used_by=self.used_by,
            used_at=self.used_at,
        )
