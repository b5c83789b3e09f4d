"""Migrations are expand-then-contract: none takes away or tightens what a server of an
earlier release reads or writes, unless it declares itself a contract step
(expand_contract.py says how, docs/development.md why)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from llmgw.store import migrate
from tests.upgrade import expand_contract


def chain() -> list[expand_contract.Migration]:
    """migrations/versions in order, oldest first, as alembic reads the chain."""
    scripts = ScriptDirectory.from_config(migrate.alembic_config()).walk_revisions()
    return [expand_contract.load(Path(s.path)) for s in reversed(list(scripts))]


def test_every_migration_expands_or_declares_its_contract():
    migrations = chain()
    assert [m.revision for m in migrations][-1] == migrate.head_revision()
    found = expand_contract.problems(migrations)
    assert not found, "\n".join(found)


def write(where: Path, body: str, revision: str = "0101", down: str | None = "0100",
          contract: str | None = None) -> Path:
    path = where / f"{revision}_case.py"
    path.write_text(textwrap.dedent(f"""\
        import sqlalchemy as sa
        from alembic import op

        revision = {revision!r}
        down_revision = {down!r}
        {f"CONTRACT = {contract!r}" if contract else ""}

        def upgrade():
        """) + textwrap.indent(textwrap.dedent(body), "    "))
    return path


@pytest.mark.parametrize(("body", "finding"), [
    ('op.drop_table("models")', "drops table models"),
    ('op.drop_column("nodes", "address")', "drops column nodes.address"),
    ('with op.batch_alter_table("nodes") as batch:\n    batch.drop_column("address")',
     "drops column nodes.address"),
    ('op.rename_table("nodes", "machines")', "renames table nodes to machines"),
    ('op.alter_column("nodes", "address", new_column_name="addr")',
     "renames column nodes.address to addr"),
    ('op.alter_column("nodes", "state_changed_at", nullable=False)',
     "makes nodes.state_changed_at NOT NULL with no server default"),
    ('op.alter_column("nodes", "state", type_=sa.Integer(), existing_type=sa.String(32))',
     "changes the type of nodes.state"),
    ('op.add_column("nodes", sa.Column("zone", sa.String(64), nullable=False))',
     "adds nodes.zone NOT NULL with no server default"),
    ('op.create_index("ix_nodes_address", "nodes", ["address"], unique=True)',
     "adds unique index ix_nodes_address on nodes"),
    ('op.create_unique_constraint("uq_nodes_address", "nodes", ["address"])',
     "adds unique constraint uq_nodes_address on nodes"),
    ('op.create_check_constraint("ck_nodes_state", "nodes", "state <> \'\'")',
     "adds check constraint ck_nodes_state on nodes"),
    ('op.execute("DELETE FROM sessions")', "runs SQL this check cannot read"),
])
def test_what_breaks_an_older_server_is_found(tmp_path, body, finding):
    migration = expand_contract.load(write(tmp_path, body))
    [found] = expand_contract.contractions(migration.operations)
    assert found.startswith(finding)


def test_what_only_expands_passes(tmp_path):
    migration = expand_contract.load(write(tmp_path, """\
        op.create_table("zones", sa.Column("name", sa.String(64), primary_key=True),
                        sa.Column("note", sa.Text(), nullable=False))
        op.create_check_constraint("ck_zones_name", "zones", "name <> ''")
        op.add_column("nodes", sa.Column("note", sa.Text(), nullable=True))
        op.add_column("nodes", sa.Column("weight", sa.Integer(), nullable=False,
                                         server_default="1"))
        with op.batch_alter_table("nodes") as batch:
            batch.add_column(sa.Column("zone", sa.String(64), nullable=True))
            batch.create_foreign_key("fk_nodes_zone_zones", "zones", ["zone"], ["name"])
            batch.create_index("ix_nodes_zone", ["zone"], unique=True)
        op.create_index("ix_nodes_state", "nodes", ["state"])
        op.drop_index("ix_sessions_account_id", table_name="sessions")
        op.alter_column("nodes", "address", type_=sa.String(2048),
                        existing_type=sa.String(1024))
        op.alter_column("nodes", "state", nullable=True)
        op.execute("UPDATE nodes SET weight = 2 WHERE state = 'ready'")
        op.execute(sa.text("INSERT INTO zones (name, note) VALUES ('a', 'b')"))
        """))
    assert [type(o).__name__ for o in migration.operations][:3] == [
        "CreateTableOp", "CreateCheckConstraintOp", "AddColumnOp"]
    assert expand_contract.contractions(migration.operations) == []


def test_a_contract_step_names_an_older_revision(tmp_path):
    first = expand_contract.load(write(tmp_path, 'op.add_column("nodes", sa.Column('
                                                 '"zone", sa.Text()))', "0100", None))
    drop = 'op.drop_column("nodes", "address")'
    assert expand_contract.problems([first, expand_contract.load(
        write(tmp_path, drop, contract="0100"))]) == []

    [undeclared] = expand_contract.problems([first, expand_contract.load(
        write(tmp_path, drop))])
    assert undeclared.startswith("0101_case.py drops column nodes.address. Split it")
    [unknown] = expand_contract.problems([first, expand_contract.load(
        write(tmp_path, drop, contract="0101"))])
    assert "CONTRACT = '0101', which is no revision before it" in unknown
    [needless] = expand_contract.problems([first, expand_contract.load(
        write(tmp_path, 'op.create_index("ix_nodes_state", "nodes", ["state"])',
              contract="0100"))])
    assert "declares CONTRACT but takes nothing away" in needless
