"""Engine builds: the build an operator chose per node and engine (auto, a name, none).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-11

Expand only: a new table, which servers of earlier releases never read. Types are spelled
out here rather than imported from llmgw.store.engine_builds, so that this revision keeps
creating the same schema when the table class moves on.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "engine_builds",
        sa.Column("node_id", sa.String(255), nullable=False),
        sa.Column("engine", sa.String(64), nullable=False),
        sa.Column("build", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("node_id", "engine", name="pk_engine_builds"),
    )


def downgrade() -> None:
    op.drop_table("engine_builds")
