"""Initial schema: models, nodes, settings, counters, api_keys.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Types are spelled out here rather than imported from llmgw.store.tables, so that this
revision keeps creating the same schema when the table classes move on.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _when() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("spec", _json(), nullable=False),
        sa.Column("created_at", _when(), nullable=False),
        sa.Column("updated_at", _when(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_models"),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.String(255), nullable=False),
        sa.Column("address", sa.String(1024), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("inventory", _json(), nullable=False),
        sa.Column("registered_at", _when(), nullable=False),
        sa.Column("last_seen_at", _when(), nullable=False),
        sa.Column("state_changed_at", _when(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_nodes"),
    )
    op.create_table(
        "settings",
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("value", _json(), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_settings"),
    )
    op.create_table(
        "counters",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_counters"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("prefix", sa.String(64), nullable=False),
        sa.Column("secret_hash", sa.String(255), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("allowed_models", _json(), nullable=True),
        sa.Column("created_at", _when(), nullable=False),
        sa.Column("expires_at", _when(), nullable=True),
        sa.Column("revoked_at", _when(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("prefix", name="uq_api_keys_prefix"),
    )


def downgrade() -> None:
    for table in ("api_keys", "counters", "settings", "nodes", "models"):
        op.drop_table(table)
