"""Leases: which server leads the cluster, and which servers are up.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04

Expand only: a new table, which servers of earlier releases never read. Times are Unix
seconds from the database's own clock (floats), so that servers with skewed clocks agree
on when a lease has run out.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("address", sa.String(1024), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("since", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_leases"),
    )


def downgrade() -> None:
    op.drop_table("leases")
