"""The store: desired state (models, settings), registered nodes, API keys, and (in
`llmgw.store.accounts`, mixed in) accounts, sessions and invites, (in
`llmgw.store.usage`) the counters behind per-key limits and the usage record, and (in
`llmgw.store.engine_builds`) the engine build an operator chose per node.

Rule of the house: never make a network call inside a transaction. Each Store method is
one short transaction that opens, does its statements and commits; callers talk to agents,
engines or clients before or after, never while a method of this class is running.

Writes that may race (two servers, 50 controller tasks) are single atomic statements:
upserts are INSERT ... ON CONFLICT, the epoch is an upsert with RETURNING.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import delete, event, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    StatementError,
)
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from llmgw.core.usage import check_limit
from llmgw.store import migrate
from llmgw.store.accounts import AccountsMixin, _require_account
from llmgw.store.engine_builds import EngineBuildMixin
from llmgw.store.leases import LeaseMixin
from llmgw.store.pki import PkiMixin
from llmgw.store.records import (
    ApiKeyRecord,
    NodeRecord,
    StoredModel,
    StoreError,
    StoreSchemaMissing,
    StoreUnavailable,
)
from llmgw.store.tables import (
    AccountRow,
    ApiKeyRow,
    CounterRow,
    ModelRow,
    NodeRow,
    SettingRow,
)
from llmgw.store.usage import UsageMixin

SUPPORTED_SCHEMES = ("sqlite+aiosqlite", "postgresql+asyncpg")
EPOCH_COUNTER = "placement_epoch"
SQLITE_BUSY_TIMEOUT_MS = 10_000
PG_CONNECT_TIMEOUT_S = 10
_WRITE_OPTION = "llmgw_write"


def sqlite_url(path: str | Path) -> str:
    """The store URL for a SQLite file at `path` (made absolute)."""
    return f"sqlite+aiosqlite:///{Path(path).expanduser().resolve()}"


async def open_store(url: str) -> Store:
    """Connect to the store at `url`, migrate it to head, and return it."""
    parsed = _parse(url)
    engine = _create_engine(parsed)
    masked = parsed.render_as_string(hide_password=True)
    try:
        await migrate.upgrade(engine)
    except (DBAPIError, OSError) as exc:
        await engine.dispose()
        raise StoreError(f"cannot open the store at {masked}: {_words(exc)}") from exc
    except BaseException:
        await engine.dispose()
        raise
    return Store(engine, url=url)


def _parse(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StoreError(
            f"the store URL could not be parsed ({exc}); use {_schemes_hint()}"
        ) from exc
    if parsed.drivername not in SUPPORTED_SCHEMES:
        raise StoreError(
            f"store URL scheme {parsed.drivername!r} is not supported; use {_schemes_hint()}"
        )
    return parsed


def _schemes_hint() -> str:
    return "sqlite+aiosqlite:///<absolute path> or postgresql+asyncpg://<user>@<host>/<database>"


def _create_engine(url: URL) -> AsyncEngine:
    if url.get_backend_name() == "sqlite":
        _prepare_sqlite_file(url)
        engine = create_async_engine(url)
        event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
        event.listen(engine.sync_engine, "begin", _sqlite_on_begin)
        return engine
    connect_args = {} if "timeout" in url.query else {"timeout": PG_CONNECT_TIMEOUT_S}
    return create_async_engine(url, connect_args=connect_args, pool_pre_ping=True)


def _prepare_sqlite_file(url: URL) -> None:
    """Create the file's directory, and the file itself as 0600: it holds key hashes."""
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return
    path = Path(database)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError as exc:
        raise StoreError(f"cannot create the SQLite store at {path}: {exc}") from exc


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Leave transactions to SQLAlchemy ("begin" below), not to the sqlite3 module, which
    # would otherwise run SELECTs outside any transaction.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.close()


def _sqlite_on_begin(conn: Any) -> None:
    # A transaction that reads before it writes takes the write lock at its start: a
    # deferred one that has read cannot take it once another writer committed, and SQLite
    # then answers "database is locked" at once, busy_timeout or not.
    write = conn.get_execution_options().get(_WRITE_OPTION, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


# PostgreSQL's SQLSTATEs that mean the database is not there to answer, beside the
# connection classes 08 (connection exception) and 57 (operator intervention: shut down,
# terminated): 3D000 it does not exist, 55000 with ALLOW_CONNECTIONS false (among other
# things, all from the connect), 53300 too many connections.
_UNAVAILABLE_STATES = frozenset({"3D000", "55000", "53300"})
_UNDEFINED_TABLE = "42P01"


def _outage_kind(exc: BaseException) -> type[StoreUnavailable] | None:
    """Whether a driver failure means the store did not answer (or answered without its
    tables), rather than refusing what was asked of it."""
    if isinstance(exc, OSError | TimeoutError):
        return StoreUnavailable
    if not isinstance(exc, DBAPIError):
        return None
    state = getattr(exc.orig, "sqlstate", None) or ""
    if state == _UNDEFINED_TABLE or "no such table" in str(exc.orig):
        return StoreSchemaMissing
    if (exc.connection_invalidated or state[:2] in ("08", "57")
            or state in _UNAVAILABLE_STATES):
        return StoreUnavailable
    if not state and isinstance(exc, OperationalError | InterfaceError):
        return StoreUnavailable  # SQLite's: the file cannot be opened, or I/O failed
    return None


def _words(exc: BaseException) -> str:
    """The driver's own message, without SQLAlchemy's wrapping and links."""
    inner = getattr(exc, "orig", None) or exc
    return str(inner).strip() or type(inner).__name__


log = logging.getLogger(__name__)

# Prefixes per query of find_api_keys: well within either backend's bound parameters.
_PREFIXES_PER_READ = 500


class Store(AccountsMixin, UsageMixin, PkiMixin, LeaseMixin, EngineBuildMixin):
    """Async access to the store; one instance per process, shared by all tasks."""

    def __init__(self, engine: AsyncEngine, *, url: str) -> None:
        self.engine = engine
        self.url = url
        self.backend: str = engine.dialect.name
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)
        self._insert = postgresql.insert if self.backend == "postgresql" else sqlite.insert
        self._masked = engine.url.render_as_string(hide_password=True)
        # When the store stopped answering (monotonic), None while it answers: one log
        # line when an outage starts and one when it ends, not one per failed call.
        self.down_since: float | None = None
        self.outage: StoreUnavailable | None = None

    async def close(self) -> None:
        await self.engine.dispose()

    @asynccontextmanager
    async def _tx(self, *, write: bool = False, term: int | None = None
                  ) -> AsyncIterator[AsyncSession]:
        """One short transaction; driver failures come out as StoreError.

        Pass `write=True` when the transaction reads before it writes (SQLite then starts
        it with BEGIN IMMEDIATE); single-statement writes need not. With `term`, the
        controller's writes: refused with `Fenced` unless that term still leads.
        """
        try:
            async with self._sessions() as session, session.begin():
                if write or term is not None:
                    await session.connection(execution_options={_WRITE_OPTION: True})
                if term is not None:
                    await self.fence(session, term)
                yield session
        except (StatementError, OSError) as exc:
            raise self._failed(exc) from exc
        if self.down_since is not None:
            self._answered()

    @asynccontextmanager
    async def _statement(self) -> AsyncIterator[AsyncSession | AsyncConnection]:
        """For one statement that is atomic on its own, on the hot path: on PostgreSQL it
        runs in autocommit, which saves the BEGIN and COMMIT round trips; SQLite, in
        process, gets an ordinary transaction. Use the result's `execute` once."""
        if self.backend != "postgresql":
            async with self._tx() as s:
                yield s
            return
        try:
            async with self.engine.connect() as conn:
                await conn.execution_options(isolation_level="AUTOCOMMIT")
                yield conn
        except (StatementError, OSError) as exc:
            raise self._failed(exc) from exc
        if self.down_since is not None:
            self._answered()

    def _failed(self, exc: StatementError | OSError) -> StoreError:
        if (isinstance(exc, StatementError) and not isinstance(exc, DBAPIError)
                and isinstance(exc.orig, ValueError)):
            return StoreError(str(exc.orig))  # a value we refused to bind
        kind = _outage_kind(exc)
        if kind is None:
            return StoreError(f"store at {self._masked} failed: {_words(exc)}")
        if kind is StoreSchemaMissing:
            err = StoreSchemaMissing(
                f"the store at {self._masked} answers but has no llmgw tables "
                f"({_words(exc)}): it was emptied or made again. Restore a backup "
                "(`llmgw store restore`, docs/operations.md), or restart the server to "
                "start again from an empty store")
        else:
            err = StoreUnavailable(f"the store at {self._masked} does not answer: "
                                   f"{_words(exc)}")
        if self.down_since is None or type(self.outage) is not kind:
            log.warning("%s; what needs the store is answered 503 until it answers", err)
            self.down_since = self.down_since or time.monotonic()
        self.outage = err
        return err

    def _answered(self) -> None:
        log.info("the store at %s answers again, after %.1f s", self._masked,
                    time.monotonic() - self.down_since)
        self.down_since = self.outage = None

    # models ------------------------------------------------------------------------

    async def put_model(self, name: str, spec: dict) -> None:
        """Insert or replace the model `name`; created_at is kept on replace."""
        _check_json(spec, f"spec of model {name!r}")
        now = _now()
        stmt = self._insert(ModelRow).values(name=name, spec=spec, created_at=now, updated_at=now)
        stmt = stmt.on_conflict_do_update(
            index_elements=[ModelRow.name], set_={"spec": spec, "updated_at": now}
        )
        async with self._tx() as s:
            await s.execute(stmt)

    async def get_model(self, name: str) -> StoredModel | None:
        async with self._tx() as s:
            row = await s.get(ModelRow, name)
            return None if row is None else row.to_record()

    async def list_models(self) -> list[StoredModel]:
        async with self._tx() as s:
            rows = await s.scalars(select(ModelRow).order_by(ModelRow.name))
            return [row.to_record() for row in rows]

    async def delete_model(self, name: str) -> bool:
        """Delete the model; False if there was none."""
        async with self._tx() as s:
            result = await s.execute(delete(ModelRow).where(ModelRow.name == name))
            return result.rowcount > 0

    # nodes -------------------------------------------------------------------------

    async def put_node(self, node: NodeRecord, term: int | None = None) -> None:
        """Insert or replace the node with `node.id`, as the agent registered it."""
        _check_json(node.inventory, f"inventory of node {node.id!r}")
        values = {
            "address": node.address,
            "state": node.state,
            "inventory": node.inventory,
            "registered_at": node.registered_at,
            "last_seen_at": node.last_seen_at,
            "state_changed_at": node.state_changed_at,
        }
        stmt = self._insert(NodeRow).values(id=node.id, **values)
        stmt = stmt.on_conflict_do_update(index_elements=[NodeRow.id], set_=values)
        async with self._tx(term=term) as s:
            await s.execute(stmt)

    async def get_node(self, node_id: str) -> NodeRecord | None:
        async with self._tx() as s:
            row = await s.get(NodeRow, node_id)
            return None if row is None else row.to_record()

    async def list_nodes(self) -> list[NodeRecord]:
        async with self._tx() as s:
            rows = await s.scalars(select(NodeRow).order_by(NodeRow.id))
            return [row.to_record() for row in rows]

    async def set_node_state(self, node_id: str, state: str, at: datetime,
                             term: int | None = None) -> None:
        """Record that the node entered `state` at `at`; last_seen_at is left alone."""
        stmt = update(NodeRow).where(NodeRow.id == node_id).values(state=state, state_changed_at=at)
        async with self._tx(term=term) as s:
            result = await s.execute(stmt)
        if result.rowcount == 0:
            raise StoreError(f"no node {node_id!r} in the store; it must register first")

    # settings ----------------------------------------------------------------------

    async def get_setting(self, key: str, default: Any = None) -> Any:
        async with self._tx() as s:
            row = await s.get(SettingRow, key)
            return default if row is None else row.value

    async def put_setting(self, key: str, value: Any, term: int | None = None) -> None:
        _check_json(value, f"setting {key!r}")
        stmt = self._insert(SettingRow).values(key=key, value=value)
        stmt = stmt.on_conflict_do_update(index_elements=[SettingRow.key], set_={"value": value})
        async with self._tx(term=term) as s:
            await s.execute(stmt)

    async def next_epoch(self, term: int | None = None) -> int:
        """The next placement epoch: 1, 2, 3, ... never the same number twice.

        One INSERT ... ON CONFLICT DO UPDATE ... RETURNING: PostgreSQL locks the row for
        the update, SQLite has one writer at a time, so concurrent callers serialise.
        """
        stmt = self._insert(CounterRow).values(name=EPOCH_COUNTER, value=1)
        stmt = stmt.on_conflict_do_update(
            index_elements=[CounterRow.name], set_={"value": CounterRow.value + 1}
        ).returning(CounterRow.value)
        async with self._tx(term=term) as s:
            return (await s.execute(stmt)).scalar_one()

    # API keys ----------------------------------------------------------------------

    async def add_api_key(self, key: ApiKeyRecord) -> ApiKeyRecord:
        """Store a new key (its hash only) and return it with its id set."""
        row = ApiKeyRow(
            prefix=key.prefix,
            secret_hash=key.secret_hash,
            name=key.name,
            allowed_models=key.allowed_models,
            created_at=key.created_at,
            expires_at=key.expires_at,
            revoked_at=key.revoked_at,
            account_id=key.account_id,
            **key.limits.as_dict(),
        )
        async with self._tx(write=True) as s:
            if key.account_id is not None:
                await _require_account(s, key.account_id)
            s.add(row)
            try:
                await s.flush()
            except IntegrityError as exc:
                raise StoreError(
                    f"an API key with prefix {key.prefix!r} already exists; "
                    "generate a new key (prefixes must be unique)"
                ) from exc
            return row.to_record()

    async def find_api_key(self, prefix: str) -> ApiKeyRecord | None:
        """The key with this prefix, revoked or expired ones included: the caller decides."""
        async with self._tx() as s:
            row = await s.scalar(select(ApiKeyRow).where(ApiKeyRow.prefix == prefix))
            return None if row is None else row.to_record()

    async def find_api_keys(self, prefixes: Collection[str]
                            ) -> list[tuple[ApiKeyRecord, bool]]:
        """The keys with these prefixes that exist (revoked or expired ones included), each
        with whether its owner lets it be used: no owner, or an account not disabled. One
        query per `_PREFIXES_PER_READ` prefixes: what the gateway's key cache reads."""
        found = []
        prefixes = list(prefixes)
        async with self._tx() as s:
            for at in range(0, len(prefixes), _PREFIXES_PER_READ):
                rows = await s.execute(
                    select(ApiKeyRow, AccountRow.id, AccountRow.disabled_at)
                    .outerjoin(AccountRow, AccountRow.id == ApiKeyRow.account_id)
                    .where(ApiKeyRow.prefix.in_(prefixes[at:at + _PREFIXES_PER_READ])))
                for key, account, disabled_at in rows:
                    enabled = key.account_id is None or (account is not None
                                                         and disabled_at is None)
                    found.append((key.to_record(), enabled))
        return found

    async def list_api_keys(self, account_id: int | None = None) -> list[ApiKeyRecord]:
        """The keys of the account if given, else every key; by id, revoked ones included."""
        stmt = select(ApiKeyRow).order_by(ApiKeyRow.id)
        if account_id is not None:
            stmt = stmt.where(ApiKeyRow.account_id == account_id)
        async with self._tx() as s:
            rows = await s.scalars(stmt)
            return [row.to_record() for row in rows]

    async def update_api_key_limits(self, prefix: str, **changes: int | None) -> ApiKeyRecord:
        """Set the limits named (rpm=60, tpm=None: None lifts one); the others are kept.

        Returns the key as it is now; a key with no such prefix is a StoreError.
        """
        try:
            for name, value in changes.items():
                check_limit(name, value)
        except ValueError as exc:
            raise StoreError(str(exc)) from exc
        async with self._tx() as s:
            if changes:
                stmt = (update(ApiKeyRow).where(ApiKeyRow.prefix == prefix).values(**changes)
                        .returning(ApiKeyRow))
            else:
                stmt = select(ApiKeyRow).where(ApiKeyRow.prefix == prefix)
            row = await s.scalar(stmt)
            if row is None:
                raise StoreError(f"no API key {prefix!r} in the store; see the list of keys")
            return row.to_record()

    async def revoke_api_key(self, prefix: str, at: datetime) -> bool:
        """Revoke the key; False if no key has this prefix. A second revoke keeps the first time."""
        async with self._tx(write=True) as s:
            found = await s.scalar(select(ApiKeyRow.id).where(ApiKeyRow.prefix == prefix))
            if found is None:
                return False
            await s.execute(
                update(ApiKeyRow)
                .where(ApiKeyRow.id == found, ApiKeyRow.revoked_at.is_(None))
                .values(revoked_at=at)
            )
            return True


def _now() -> datetime:
    return datetime.now(UTC)


def _check_json(value: Any, what: str) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"{what} is not JSON: {exc}") from exc
