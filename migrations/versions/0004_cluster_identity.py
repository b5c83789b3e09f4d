"""Cluster identity: one-time join tokens, and the node certificates the CA issued.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29

Types are spelled out here rather than imported from llmgw.store.pki, so that this
revision keeps creating the same schema when the table classes move on.

A join token is kept as its SHA-256 only. A certificate's serial is decimal text: X.509
serials run to 159 bits, past any integer column. Both tables name the node as text,
with no foreign key to nodes: a node gets its token and its first certificate before it
has ever registered.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _when() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "join_tokens",
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("created_at", _when(), nullable=False),
        sa.Column("expires_at", _when(), nullable=False),
        sa.Column("used_at", _when(), nullable=True),
        sa.Column("created_by", sa.String(255), nullable=False),
        sa.PrimaryKeyConstraint("token_hash", name="pk_join_tokens"),
    )
    op.create_index("ix_join_tokens_node", "join_tokens", ["node"])
    op.create_table(
        "node_certs",
        sa.Column("serial", sa.String(64), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("not_before", _when(), nullable=False),
        sa.Column("not_after", _when(), nullable=False),
        sa.Column("revoked_at", _when(), nullable=True),
        sa.PrimaryKeyConstraint("serial", name="pk_node_certs"),
    )
    op.create_index("ix_node_certs_node", "node_certs", ["node"])


def downgrade() -> None:
    op.drop_index("ix_node_certs_node", table_name="node_certs")
    op.drop_table("node_certs")
    op.drop_index("ix_join_tokens_node", table_name="join_tokens")
    op.drop_table("join_tokens")
