"""Accounts, sessions and invites; API keys get an owning account.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01

Types are spelled out here rather than imported from llmgw.store.tables, so that this
revision keeps creating the same schema when the table classes move on.

api_keys is altered in batch mode: SQLite cannot add a foreign key to an existing table,
so there alembic copies the table into a new one (rows included); PostgreSQL gets plain
ALTER TABLE statements. Keys that existed before this revision get account_id NULL:
they were made with the admin token.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _when() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("username", sa.String(255), nullable=False),
        sa.Column("password_hash", sa.String(255), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("created_at", _when(), nullable=False),
        sa.Column("disabled_at", _when(), nullable=True),
        sa.CheckConstraint("role IN ('admin', 'user')", name="ck_accounts_role"),
        sa.PrimaryKeyConstraint("id", name="pk_accounts"),
        sa.UniqueConstraint("username", name="uq_accounts_username"),
    )
    op.create_table(
        "sessions",
        sa.Column("token_hash", sa.String(255), nullable=False),
        sa.Column("account_id", sa.Integer(), nullable=False),
        sa.Column("created_at", _when(), nullable=False),
        sa.Column("expires_at", _when(), nullable=False),
        sa.ForeignKeyConstraint(
            ["account_id"],
            ["accounts.id"],
            name="fk_sessions_account_id_accounts",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("token_hash", name="pk_sessions"),
    )
    op.create_index("ix_sessions_account_id", "sessions", ["account_id"])
    op.create_table(
        "invites",
        sa.Column("code_hash", sa.String(255), nullable=False),
        sa.Column("created_at", _when(), nullable=False),
        sa.Column("expires_at", _when(), nullable=False),
        sa.Column("created_by", sa.Integer(), nullable=True),
        sa.Column("used_by", sa.Integer(), nullable=True),
        sa.Column("used_at", _when(), nullable=True),
        sa.ForeignKeyConstraint(
            ["created_by"],
            ["accounts.id"],
            name="fk_invites_created_by_accounts",
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["used_by"],
            ["accounts.id"],
            name="fk_invites_used_by_accounts",
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("code_hash", name="pk_invites"),
    )
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("account_id", sa.Integer(), nullable=True))
        batch.create_index("ix_api_keys_account_id", ["account_id"])
        batch.create_foreign_key(
            "fk_api_keys_account_id_accounts",
            "accounts",
            ["account_id"],
            ["id"],
            ondelete="CASCADE",
        )


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_constraint("fk_api_keys_account_id_accounts", type_="foreignkey")
        batch.drop_index("ix_api_keys_account_id")
        batch.drop_column("account_id")
    op.drop_table("invites")
    op.drop_index("ix_sessions_account_id", table_name="sessions")
    op.drop_table("sessions")
    op.drop_table("accounts")
