"""The leader's lease and fencing, on SQLite and PostgreSQL: one leader at a time, a new
term each time the lease changes hands, and a deposed leader's writes refused."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from llmgw.store import NodeRecord, Store, open_store
from llmgw.store.leases import Fenced

T0 = datetime(2026, 12, 4, tzinfo=UTC)


async def _run_out(store: Store) -> None:
    """Wait, by the database's clock, until the leader's lease has run out."""
    async with asyncio.timeout(10):
        while True:
            if not (await store.leader()).live:
                return
            await asyncio.sleep(0.05)  # the database's clock has no event to wait on


async def test_one_leader_at_a_time_and_a_new_term_when_it_changes_hands(store: Store) -> None:
    assert await store.leader() is None

    first = await store.take_lead("a", "10.0.0.1:8080", ttl_s=0.5)
    assert (first.holder, first.address, first.term) == ("a", "10.0.0.1:8080", 1)
    assert first.live and 0 < first.expires_in_s <= 0.5
    assert await store.take_lead("b", "10.0.0.2:8080", ttl_s=0.5) is None
    assert await store.renew_lead("a", 1, ttl_s=0.5)

    await _run_out(store)
    second = await store.take_lead("b", "10.0.0.2:8080", ttl_s=30)
    assert (second.holder, second.term) == ("b", 2)
    # The deposed leader can neither renew nor write.
    assert not await store.renew_lead("a", 1, ttl_s=30)
    with pytest.raises(Fenced, match="term 1 no longer leads"):
        await store.put_setting("replicas", ["stale"], term=1)
    with pytest.raises(Fenced):
        await store.next_epoch(term=1)
    with pytest.raises(Fenced):
        await store.put_node(NodeRecord(id="n", address="10.0.0.9", state="ready",
                                        inventory={}, registered_at=T0, last_seen_at=T0),
                             term=1)
    assert await store.get_setting("replicas") is None
    assert await store.get_node("n") is None

    await store.put_setting("replicas", ["current"], term=2)
    assert await store.get_setting("replicas") == ["current"]
    assert await store.next_epoch(term=2) == 1


async def test_a_restarted_leader_takes_its_lease_back_at_once_with_a_new_term(
        store: Store) -> None:
    await store.take_lead("a", "x", ttl_s=30)
    again = await store.take_lead("a", "x", ttl_s=30)
    assert again.term == 2
    with pytest.raises(Fenced):
        await store.put_setting("k", 1, term=1)


async def test_a_leader_that_gives_up_is_followed_at_once(store: Store) -> None:
    lead = await store.take_lead("a", "x", ttl_s=30)
    await store.give_up_lead("a", lead.term)
    assert (await store.take_lead("b", "y", ttl_s=30)).term == lead.term + 1


async def test_of_many_servers_racing_exactly_one_leads(backend_url: str, store: Store) -> None:
    stores = [await open_store(backend_url) for _ in range(6)]
    try:
        won = await asyncio.gather(*(s.take_lead(f"s{i}", "x", ttl_s=30)
                                     for i, s in enumerate(stores)))
    finally:
        for s in stores:
            await s.close()
    leaders = [lease for lease in won if lease is not None]
    assert len(leaders) == 1 and leaders[0].term == 1
    assert (await store.leader()).holder == leaders[0].holder


async def test_servers_say_they_are_up_until_they_stop(store: Store) -> None:
    await store.server_alive("a", "10.0.0.1:8080", ttl_s=30)
    await store.server_alive("b", "10.0.0.2:8080", ttl_s=30)
    first = {s.name: s for s in await store.list_servers()}
    await store.server_alive("a", "10.0.0.1:8080", ttl_s=30)
    await store.server_gone("b")

    servers = {s.name: s for s in await store.list_servers()}
    assert sorted(servers) == ["a", "b"]
    assert servers["a"].live and not servers["b"].live
    assert servers["a"].since == first["a"].since  # up since it came up, not since renewed
    assert servers["a"].address == "10.0.0.1:8080"
