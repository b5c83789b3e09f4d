"""How the store tells an outage from a refusal, on both backends: a store that lost its
tables says so (StoreSchemaMissing), logs it once however often it is asked, and says
when it answers again."""

from __future__ import annotations

import logging

import pytest

from llmgw.store import Store, StoreError, StoreSchemaMissing, StoreUnavailable
from llmgw.store.tables import Base
from tests.store.test_store_contract import api_key


async def test_a_store_without_its_tables_is_an_outage_logged_once_until_it_answers(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.store.store")
    async with store.engine.begin() as conn:
        await conn.run_sync(Base.metadata.drop_all)
    try:
        for _ in range(3):
            with pytest.raises(StoreSchemaMissing, match="has no llmgw tables"):
                await store.get_model("m")
        assert isinstance(store.outage, StoreSchemaMissing)
        assert store.down_since is not None
        lost = [r for r in caplog.records if "has no llmgw tables" in r.getMessage()]
        assert len(lost) == 1 and "llmgw store restore" in lost[0].getMessage()
    finally:
        async with store.engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
    assert await store.get_model("m") is None
    assert store.outage is None and store.down_since is None
    assert any("answers again" in r.getMessage() for r in caplog.records)


async def test_a_refusal_is_not_an_outage(store: Store) -> None:
    # A value the store refuses (here: a second key with one prefix) is a StoreError of
    # its own: the server answers it, and nothing is logged as an outage.
    await store.add_api_key(api_key("dup"))
    with pytest.raises(StoreError) as refused:
        await store.add_api_key(api_key("dup"))
    assert not isinstance(refused.value, StoreUnavailable)
    assert store.outage is None
