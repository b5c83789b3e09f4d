"""Which operations of a migration would break a server of an earlier release.

Migrations are expand-then-contract (docs/development.md, "Migrations"): a server of the
release before keeps running on a store a newer server migrated, until it is replaced.
So a migration may add (tables, nullable columns, columns with a server default, indexes,
constraints on what it adds itself) and relax (drop an index or a constraint), but not take
away or tighten what an older server reads and writes, unless it declares itself a
contract step: a module-level ``CONTRACT = "<revision>"`` naming the oldest revision whose
servers no longer read or write what it takes away. Servers older than that must be gone
before a server carrying the migration starts.

A migration's ``upgrade()`` runs here against alembic's own ``Operations`` with no
database: every call arrives as alembic's operation object (``AddColumnOp``,
``DropTableOp``, ...), recorded instead of executed, batch mode included.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa
from alembic.operations import BatchOperations, Operations
from alembic.operations import ops as alembic_ops
from alembic.runtime.migration import MigrationContext

_names = itertools.count()


class _Recorder(Operations):
    def __init__(self) -> None:
        super().__init__(MigrationContext.configure(dialect_name="postgresql",
                                                    opts={"as_sql": True}))
        self.recorded: list[alembic_ops.MigrateOperation] = []

    def invoke(self, operation: alembic_ops.MigrateOperation) -> Any:
        self.recorded.append(operation)
        # create_table returns the Table; a migration may bulk_insert into it.
        if isinstance(operation, alembic_ops.CreateTableOp):
            return operation.to_table()
        return None

    @contextlib.contextmanager
    def batch_alter_table(self, table_name: str, schema: str | None = None,
                          **_how: Any) -> Iterator[BatchOperations]:
        batch = _BatchRecorder(self.migration_context,
                               impl=SimpleNamespace(table_name=table_name, schema=schema))
        batch.recorded = self.recorded
        yield batch


class _BatchRecorder(BatchOperations):
    recorded: list[alembic_ops.MigrateOperation]

    def invoke(self, operation: alembic_ops.MigrateOperation) -> Any:
        self.recorded.append(operation)


@dataclass(frozen=True)
class Migration:
    path: Path
    revision: str
    down_revision: str | None
    contract: str | None  # its CONTRACT, when it declares one
    operations: list[alembic_ops.MigrateOperation]


def load(path: Path) -> Migration:
    """Import the migration at ``path`` on its own and record what its upgrade() does."""
    spec = importlib.util.spec_from_file_location(f"_migration_{next(_names)}", path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    recorder = _Recorder()
    module.op = recorder  # what `from alembic import op` bound in it
    module.upgrade()
    return Migration(path, module.revision, module.down_revision,
                     getattr(module, "CONTRACT", None), recorder.recorded)


def contractions(operations: Iterable[alembic_ops.MigrateOperation]) -> list[str]:
    """What in ``operations`` takes away or tightens something an older server uses,
    in words; empty for a migration that only expands."""
    made_tables: set[str] = set()
    made_columns: set[tuple[str, str]] = set()
    found = []

    def new(table: str, columns: Iterable[Any] = ()) -> bool:
        """Whether the table is made here, or every column is added here."""
        columns = list(columns)
        return table in made_tables or (bool(columns) and all(
            (table, str(c)) in made_columns for c in columns))

    for op in operations:
        match op:
            case alembic_ops.CreateTableOp():
                made_tables.add(op.table_name)
            case alembic_ops.AddColumnOp():
                column = op.column
                made_columns.add((op.table_name, column.name))
                if (not new(op.table_name) and not column.nullable
                        and column.server_default is None):
                    found.append(f"adds {op.table_name}.{column.name} NOT NULL with no "
                                 "server default: an older server's INSERT leaves it out")
            case alembic_ops.DropTableOp() if not new(op.table_name):
                found.append(f"drops table {op.table_name}")
            case alembic_ops.RenameTableOp():
                found.append(f"renames table {op.table_name} to {op.new_table_name}")
            case alembic_ops.DropColumnOp() if not new(op.table_name, [op.column_name]):
                found.append(f"drops column {op.table_name}.{op.column_name}")
            case alembic_ops.AlterColumnOp() if not new(op.table_name, [op.column_name]):
                found.extend(_altered(op))
            case alembic_ops.CreateIndexOp() if op.unique and not new(op.table_name,
                                                                      op.columns):
                found.append(f"adds unique index {op.index_name} on {op.table_name}: "
                             "an older server's writes may break it")
            case alembic_ops.AddConstraintOp() if not new(*_constrained(op)):
                found.append(f"adds {op.constraint_type} constraint {op.constraint_name} "
                             f"on {_constrained(op)[0]}: an older server's writes may break it")
            case alembic_ops.ExecuteSQLOp() if not _fills_in(op.sqltext):
                found.append(f"runs SQL this check cannot read: {str(op.sqltext)[:60]!r}; "
                             "only INSERT and UPDATE (filling in) pass")
    return found


def _altered(op: alembic_ops.AlterColumnOp) -> list[str]:
    where = f"{op.table_name}.{op.column_name}"
    found = []
    if op.modify_name is not None:
        found.append(f"renames column {where} to {op.modify_name}")
    if op.modify_nullable is False and not (op.modify_server_default
                                            or op.existing_server_default):
        found.append(f"makes {where} NOT NULL with no server default: an older server's "
                     "INSERT leaves it out")
    if op.modify_type is not None and not _widens(op.existing_type, op.modify_type):
        found.append(f"changes the type of {where} to {op.modify_type!r}: an older server "
                     "reads and writes the old one")
    return found


def _widens(old: Any, new: Any) -> bool:
    """A longer string of the same kind: what an older server writes still fits."""
    return (isinstance(old, sa.String) and type(new) is type(old)
            and (new.length is None or (old.length is not None and new.length >= old.length)))


def _constrained(op: alembic_ops.AddConstraintOp) -> tuple[str, list[str]]:
    """The table a new constraint is on, and its columns (none known for a CHECK)."""
    if isinstance(op, alembic_ops.CreateForeignKeyOp):
        return op.source_table, list(op.local_cols)
    return op.table_name, list(getattr(op, "columns", []))


def _fills_in(sql: Any) -> bool:
    """An INSERT or UPDATE, as a statement or as text: rows filled in, nothing taken."""
    if isinstance(sql, sa.Insert | sa.Update):
        return True
    text = sql.text if isinstance(sql, sa.TextClause) else sql
    words = text.split(maxsplit=1) if isinstance(text, str) else []
    return bool(words) and words[0].upper() in ("INSERT", "UPDATE")


def problems(chain: list[Migration]) -> list[str]:
    """Every migration of ``chain`` (oldest first) that contracts without saying so, or
    says so wrongly."""
    found = []
    older: list[str] = []
    for migration in chain:
        taken = contractions(migration.operations)
        name = migration.path.name
        if taken and migration.contract is None:
            found.append(f"{name} " + "; ".join(taken) + ". Split it: expand in this "
                         "release, contract in a later one with CONTRACT = \"<the oldest "
                         "revision whose servers no longer use it>\" (docs/development.md)")
        elif migration.contract is not None and not taken:
            found.append(f"{name} declares CONTRACT but takes nothing away: drop CONTRACT, "
                         "it makes upgrades stop servers for nothing")
        elif migration.contract is not None and migration.contract not in older:
            found.append(f"{name} has CONTRACT = {migration.contract!r}, which is no "
                         f"revision before it (those are {older})")
        older.append(migration.revision)
    return found
