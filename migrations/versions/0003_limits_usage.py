"""Per-key limits, the windows that count against them, and usage per key, model and day.

Revision ID: 0003
Revises: 0002
Create Date: 2025-03-01

Types are spelled out here rather than imported from llmgw.store.tables, so that this
revision keeps creating the same schema when the table classes move on.

The limits are nullable columns on api_keys (NULL: unlimited), so keys made before this
revision keep working without limits. Adding nullable columns needs no table copy on
SQLite; batch mode is used anyway, as in 0002, so that the downgrade (dropping them) works
on SQLite versions without DROP COLUMN.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

LIMITS = ("rpm", "tpm", "tokens_per_day", "tokens_per_month")


def _key_id(table: str) -> tuple[sa.Column, sa.ForeignKeyConstraint]:
    return (
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["key_id"], ["api_keys.id"], name=f"fk_{table}_key_id_api_keys", ondelete="CASCADE"
        ),
    )


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        for name in LIMITS:
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=True))
    op.create_table(
        "usage_windows",
        *_key_id("usage_windows"),
        sa.Column("period", sa.String(8), nullable=False),
        sa.Column("start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.CheckConstraint(
            "period IN ('minute', 'day', 'month')", name="ck_usage_windows_period"
        ),
        sa.PrimaryKeyConstraint("key_id", "period", "start", name="pk_usage_windows"),
    )
    op.create_table(
        "usage_days",
        *_key_id("usage_days"),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("key_id", "day", "model", name="pk_usage_days"),
    )


def downgrade() -> None:
    op.drop_table("usage_days")
    op.drop_table("usage_windows")
    with op.batch_alter_table("api_keys") as batch:
        for name in reversed(LIMITS):
            batch.drop_column(name)
