"""What /metrics reads of a real store (a SQLite file): the names of the accounts that own
the keys counted, read when a new owner shows up, kept through an outage; and
``llmgw_store_up``, which follows the store's own account of its outage."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from types import SimpleNamespace

import msgspec
import pytest

from llmgw.config import Model
from llmgw.core.catalog import catalog_from_config
from llmgw.core.inventory import Timeouts
from llmgw.server.agents.sessions import NodeSessions
from llmgw.server.metrics import Metrics
from llmgw.server.openai.router import Router
from llmgw.store import AccountRecord, ApiKeyRecord, Store, open_store, sqlite_url
from llmgw.store.tables import Base

NOW = dt.datetime(2026, 1, 5, tzinfo=dt.UTC)


@pytest.fixture
async def store(tmp_path) -> AsyncIterator[Store]:
    opened = await open_store(sqlite_url(tmp_path / "llmgw.db"))
    try:
        yield opened
    finally:
        await opened.close()


async def _account(store: Store, name: str) -> int:
    made = await store.add_account(AccountRecord(username=name, password_hash="x",
                                                 role="user", created_at=NOW))
    assert made.id is not None
    return made.id


def _key(account_id: int | None) -> ApiKeyRecord:
    return ApiKeyRecord(prefix="k", secret_hash="00", name="k", created_at=NOW,
                        account_id=account_id)


def _owners(m: Metrics) -> dict[str, float]:
    return {sample.labels["owner"]: sample.value
            for family in m.collect() if family.name == "llmgw_requests_by_owner"
            for sample in family.samples if sample.labels["status"] == "2xx"}


async def test_owners_are_named_from_the_store_and_kept_through_an_outage(store):
    models = [msgspec.convert({"name": "m1", "profiles": [{"engine": "sim"}]}, Model)]
    controller = SimpleNamespace(catalog=catalog_from_config(models), replicas={},
                                 sessions=NodeSessions(Timeouts()))
    m = Metrics(controller, Router(), process=False, store=store)  # type: ignore[arg-type]
    alice = await _account(store, "alice")
    m.request_done("m1", "chat", 200, 0.1, _key(alice))
    assert _owners(m) == {"other": 1}  # counted; not named before a scrape asks
    await m.name_owners()
    assert _owners(m) == {"alice": 1}
    assert m.registry.get_sample_value("llmgw_store_up") == 1

    # A new owner is named at the next scrape, with no wait.
    bob = await _account(store, "bob")
    m.request_done("m1", "chat", 200, 0.1, _key(bob))
    m.request_done("m1", "chat", 200, 0.1, None)
    m.request_done("m1", "chat", 200, 0.1, _key(None))
    await m.name_owners()
    assert _owners(m) == {"alice": 1, "bob": 1, "anonymous": 1, "unowned": 1}

    # The store loses its tables: an outage. The scrape still answers, with the names
    # it had; the owner it cannot name yet counts as "other".
    async with store.engine.begin() as conn:
        await conn.run_sync(Base.metadata.drop_all)
    m.request_done("m1", "chat", 200, 0.1, _key(bob + 1))
    await m.name_owners()
    assert store.outage is not None
    assert m.registry.get_sample_value("llmgw_store_up") == 0
    assert _owners(m) == {"alice": 1, "bob": 1, "anonymous": 1, "unowned": 1, "other": 1}
