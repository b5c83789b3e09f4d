"""Routing: the pure choice (two choices, bounded-load affinity) and the router's queue."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from llmgw.core import routing
from llmgw.core.routing import Ring, by_affinity, choose, load_bound, two_choices
from llmgw.server.openai import routes
from llmgw.server.openai.admission import Ask
from llmgw.server.openai.proxy import ends_an_event
from llmgw.server.openai.router import QueueFull, QueueTimeout, Router, Saturated


@dataclass
class R:
    replica: str
    outstanding: int = 0
    slots: int = 4


def replicas(*loads: int, slots: int = 4) -> list[R]:
    return [R(f"r{i}", load, slots) for i, load in enumerate(loads)]


class FixedRng(random.Random):
    """Draws the given values in turn (randrange only)."""

    def __init__(self, *values: int) -> None:
        super().__init__(0)
        self.values = list(values)

    def randrange(self, *args, **kwargs) -> int:  # type: ignore[override]
        return self.values.pop(0)


# --- power of two choices -------------------------------------------------------------------


def test_no_replicas_none_one_replica_it_unless_full_or_excluded():
    rng = random.Random(1)
    assert two_choices([], rng) is None
    (only,) = replicas(3)
    assert two_choices([only], rng) is only
    assert two_choices([R("r0", 4, 4)], rng) is None, "at its slot limit"
    assert two_choices([only], rng, exclude={"r0"}) is None


def test_of_the_two_drawn_the_less_loaded_wins_whatever_the_order():
    a, b = replicas(1, 3)
    assert two_choices([a, b], FixedRng(0, 0)) is a  # draws a, then b
    assert two_choices([a, b], FixedRng(1, 0)) is a  # draws b, then a


def test_ties_go_to_more_slots_then_to_the_first_drawn():
    small, big = R("small", 2, 4), R("big", 2, 8)
    assert two_choices([small, big], FixedRng(0, 0)) is big
    assert two_choices([small, big], FixedRng(1, 0)) is big
    a, b = replicas(2, 2)
    assert two_choices([a, b], FixedRng(0, 0)) is a
    assert two_choices([a, b], FixedRng(1, 0)) is b


def test_a_full_replica_is_never_picked_and_all_full_is_none():
    rng = random.Random(7)
    targets = [R("full-a", 4, 4), R("free", 3, 4), R("full-b", 9, 8)]
    assert {two_choices(targets, rng).replica for _ in range(500)} == {"free"}
    assert two_choices([R("a", 4, 4), R("b", 1, 1)], rng) is None


def test_the_less_loaded_wins_as_often_as_the_pairs_it_is_in():
    rng = random.Random(42)
    targets = replicas(0, 2, 3)
    picks = Counter(two_choices(targets, rng).replica for _ in range(3000))
    assert picks["r2"] == 0, "the most loaded never beats the one it is drawn with"
    assert picks["r0"] / 3000 == pytest.approx(2 / 3, abs=0.04)


def test_the_draw_stays_uniform_over_the_eligible_when_some_are_full():
    rng = random.Random(3)
    targets = [R("a", 1), R("full-1", 4), R("b", 1), R("full-2", 4), R("c", 1)]
    picks = Counter(two_choices(targets, rng).replica for _ in range(6000))
    assert set(picks) == {"a", "b", "c"}
    for name in "abc":
        # Equal loads: the first drawn wins, so each is picked a third of the time.
        assert picks[name] / 6000 == pytest.approx(1 / 3, abs=0.04)


def test_exclude_sends_a_retry_elsewhere():
    rng = random.Random(5)
    targets = replicas(0, 3)
    assert {two_choices(targets, rng, exclude={"r0"}).replica for _ in range(50)} == {"r1"}
    assert two_choices(targets, rng, exclude={"r0", "r1"}) is None


# --- bounded-load affinity ------------------------------------------------------------------


def test_the_bound_is_ceil_of_one_plus_epsilon_times_the_average_with_this_request():
    assert load_bound(0, 4) == 1
    assert load_bound(7, 4) == 3  # 1.25 * 8 / 4 = 2.5
    assert load_bound(15, 4) == 5  # 1.25 * 16 / 4 = 5, not rounded up by float noise
    assert load_bound(9, 11, epsilon=0.1) == 1  # 1.1 * 10 / 11 is 1.0000000000000002
    assert load_bound(3, 1, epsilon=0) == 4
    assert load_bound(5, 0) == 0


def test_a_key_stays_on_its_replica_until_it_passes_the_bound_then_walks_clockwise():
    targets = replicas(0, 0, 0, 0, slots=100)
    ring = Ring([t.replica for t in targets])
    order = [targets[i] for i in ring.walk(b"user:alice")]
    assert len(order) == 4 and len({t.replica for t in order}) == 4
    home, next_one = order[0], order[1]
    assert ring.owner(b"user:alice") == home.replica

    def pick() -> R:
        total = sum(t.outstanding for t in targets)
        return by_affinity(targets, ring, b"user:alice", total)

    for t in targets:
        t.outstanding = 4
    assert pick() is home, "at the average, the key stays home"
    home.outstanding = load_bound(16 - 1, 4)  # 5: the bound with this request counted
    assert pick() is home, "one under the bound, it still fits"
    home.outstanding += 1
    assert pick() is next_one, "over the bound, it moves to the next replica clockwise"
    home.outstanding = 4
    assert pick() is home, "and comes back once home is no longer overloaded"


def test_affinity_respects_slots_and_exclude():
    targets = replicas(0, 0, 0, slots=1)
    ring = Ring([t.replica for t in targets])
    order = [targets[i] for i in ring.walk("k")]
    order[0].outstanding = 1
    assert by_affinity(targets, ring, "k", 1) is order[1], "home is at its slot limit"
    assert by_affinity(targets, ring, "k", 1, exclude={order[1].replica}) is order[2]
    for t in targets:
        t.outstanding = 1
    assert by_affinity(targets, ring, "k", 3) is None


def test_a_hot_key_spreads_but_no_replica_passes_the_bound():
    targets = replicas(0, 0, 0, 0, slots=1000)
    ring = Ring([t.replica for t in targets])
    rng = random.Random(0)
    for total in range(200):
        bound = load_bound(total, 4)
        chosen = choose(targets, rng, ring=ring, key="hot", total=total)
        assert chosen.outstanding < bound
        chosen.outstanding += 1
    assert max(t.outstanding for t in targets) <= load_bound(199, 4)


def test_removing_one_of_four_replicas_moves_only_its_keys():
    keys = [f"user-{i}".encode() for i in range(4000)]
    names = ["replica-a", "replica-b", "replica-c", "replica-d"]
    ring = Ring(names)
    before = {k: ring.owner(k) for k in keys}
    shares = Counter(before.values())
    assert all(0.15 < shares[n] / len(keys) < 0.35 for n in names), shares

    shrunk = Ring(["replica-a", "replica-b", "replica-d"])
    after = {k: shrunk.owner(k) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "replica-c"}
    assert len(moved) / len(keys) < 0.35

    grown_ring = Ring([*names, "replica-e"])
    grown = {k: grown_ring.owner(k) for k in keys}
    moved_on_add = [k for k in keys if before[k] != grown[k]]
    assert all(grown[k] == "replica-e" for k in moved_on_add)
    assert len(moved_on_add) / len(keys) < 0.3


def test_the_ring_is_the_same_in_every_process():
    assert routing.stable_hash("user:alice") == routing.stable_hash(b"user:alice")
    assert routing.stable_hash("x") == 0x4ADF4367F96E584F, "blake2b, not the salted hash()"
    assert Ring(["a", "b"]).owner("k") == Ring(["a", "b"]).owner("k")
    assert Ring([]).owner("k") is None


def test_choose_without_a_key_or_with_nothing_under_the_bound_uses_two_choices():
    targets = replicas(3, 0)
    ring = Ring([t.replica for t in targets])
    assert choose(targets, random.Random(0)) is targets[1]
    home = targets[next(ring.walk("k"))]
    other = targets[1] if home is targets[0] else targets[0]
    home.outstanding, other.outstanding = 0, 3
    assert choose(targets, random.Random(0), ring=ring, key="k", total=3,
                  exclude={home.replica}) is other, "excluded home; the rest is over the bound"


def test_one_replica_is_chosen_with_a_key_as_without_and_the_key_is_not_hashed(monkeypatch):
    def no_hash(data):
        raise AssertionError("a key hashed with one replica to choose from")

    targets = replicas(0)
    ring = Ring([t.replica for t in targets])  # hashed here, before the patch
    monkeypatch.setattr(routing, "stable_hash", no_hash)
    rng = random.Random(0)
    assert choose(targets, rng, ring=ring, key="k") is targets[0]
    assert choose(targets, rng, ring=ring, key="k", exclude={targets[0].replica}) is None
    targets[0].outstanding = targets[0].slots
    assert choose(targets, rng, ring=ring, key="k", total=targets[0].slots) is None


def test_the_affinity_key_is_the_user_else_the_start_of_the_conversation():
    assert routing.affinity_key("alice", b'[{"role":"user"}]') == b"user:alice"
    long = b'[{"role":"system","content":"' + b"x" * 1000 + b'"}]'
    assert routing.affinity_key(None, long, prefix_bytes=64) == b"conv:" + long[:64]
    assert routing.affinity_key(b'"alice"', b"[]") == b'user:"alice"', "raw JSON will do"
    assert routing.affinity_key(b"null", b"[1]") == b"conv:[1]"
    assert routing.affinity_key("", b"") is None
    assert routing.affinity_key(None, b"null") is None



@pytest.mark.parametrize("fields", [
    {"user": "alice", "messages": [{"role": "user", "content": "hi"}]},
    {"user": None, "messages": [{"role": "user", "content": "x" * 1_000_000}]},
    {"messages": [], "prompt": "once upon a time " * 100},
    {"prompt": ["a", "b"]},
    {"user": "", "messages": None},
    {},
])
def test_a_requests_affinity_key_reads_only_the_start_of_its_conversation(fields):
    # The gateway copies only what the key reads of a conversation (it can be megabytes),
    # and gets the key the whole conversation gives.
    body = json.dumps({"model": "m", **fields}).encode()
    head = routes._parse(body, None)
    whole = routing.affinity_key(bytes(head.user),
                                 bytes(head.messages) or bytes(head.prompt))
    two = Router()
    two.update({"m": [("a", "127.0.0.1", 1), ("b", "127.0.0.1", 2)]})
    assert Ask("/v1/completions", "completions", head, body, b"", None).affinity(two) == whole


def test_a_model_with_one_replica_has_no_affinity_key_to_work_out():
    head = routes._parse(b'{"model": "m", "user": "alice"}', None)
    one = Router()
    one.update({"m": [("a", "127.0.0.1", 1)]})
    assert Ask("/v1/completions", "completions", head, b"", b"", None).affinity(one) is None

# --- the router: leases and the queue -------------------------------------------------------


def router(*replica_slots: tuple[str, int], **kw) -> Router:
    r = Router(rng=random.Random(0), **kw)
    r.update({"m": [(name, "10.0.0.1", 8000 + i, slots)
                    for i, (name, slots) in enumerate(replica_slots)]})
    return r


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_leases_count_per_replica_and_release_is_idempotent():
    r = router(("a", 2), ("b", 2))
    leases = [await r.acquire("m") for _ in range(4)]
    assert r.in_flight() == {"a": 2, "b": 2}
    assert leases[0].endpoint.host == "10.0.0.1" and leases[0].endpoint.port in (8000, 8001)
    leases[0].release()
    leases[0].release()
    assert sum(r.in_flight().values()) == 3
    for lease in leases:
        lease.release()
    assert r.in_flight() == {"a": 0, "b": 0}


async def test_unknown_model_or_every_replica_excluded_is_none_at_once():
    r = router(("a", 1))
    assert await r.acquire("other") is None
    assert await r.acquire("m", exclude={"a"}) is None


async def test_one_replica_is_leased_while_it_has_a_slot_and_counted_as_the_only_choice():
    r = router(("a", 2))
    assert (r.choices("m"), r.choices("other")) == (1, 0)
    first, second = r.pick("m"), r.pick("m")
    assert first.endpoint.replica == second.endpoint.replica == "a"
    assert r.pick("m") is None, "both its slots are taken"
    assert r.in_flight() == {"a": 2}
    first.release()
    assert r.pick("m", exclude={"a"}) is None
    third = r.pick("m")
    assert third is not None and r.in_flight() == {"a": 2}
    second.release()
    third.release()
    assert router(("a", 1), ("b", 1)).choices("m") == 2


async def test_slots_default_when_the_controller_gives_none():
    r = Router(default_slots=2)
    r.update({"m": [("a", "fd00::1", 8000)]})
    first, second = await r.acquire("m"), await r.acquire("m")
    assert (first.endpoint.host, first.endpoint.port) == ("fd00::1", 8000)
    with pytest.raises(QueueFull):
        await r.acquire("m", wait_s=0)
    first.release()
    second.release()


async def test_waiters_are_served_in_order_as_slots_free():
    r = router(("a", 1))
    held = await r.acquire("m")
    served: list[int] = []

    async def wait(i: int) -> None:
        lease = await r.acquire("m", wait_s=5)
        served.append(i)
        await asyncio.sleep(0)
        lease.release()

    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(wait(i)))
        await settle()
    assert r.queue_lengths().get("m", 0) == 3 and sum(r.queue_lengths().values()) == 3
    assert r.pick("m") is None, "a newcomer does not overtake the queue"
    held.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert served == [0, 1, 2]
    assert r.queue_lengths() == {"m": 0}
    assert r.in_flight() == {"a": 0}


async def test_a_waiter_gives_up_after_its_wait_with_a_retry_hint():
    r = router(("a", 1), retry_after_s=3)
    held = await r.acquire("m")
    started = time.monotonic()
    with pytest.raises(QueueTimeout) as caught:
        await r.acquire("m", wait_s=0.05)
    assert 0.04 <= time.monotonic() - started < 1.0
    assert isinstance(caught.value, Saturated) and caught.value.retry_after_s == 3
    assert r.queue_lengths().get("m", 0) == 0
    held.release()
    assert r.in_flight() == {"a": 0}


async def test_a_full_queue_refuses_at_once():
    r = router(("a", 1), queue_max=1)
    held = await r.acquire("m")
    waiting = asyncio.create_task(r.acquire("m", wait_s=5))
    await settle()
    started = time.monotonic()
    with pytest.raises(QueueFull):
        await asyncio.wait_for(r.acquire("m", wait_s=5), 1)
    assert time.monotonic() - started < 0.5
    held.release()
    (await asyncio.wait_for(waiting, 1)).release()
    assert r.in_flight() == {"a": 0} and sum(r.queue_lengths().values()) == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_gets_nothing():
    r = router(("a", 1))
    held = await r.acquire("m")
    gone = asyncio.create_task(r.acquire("m", wait_s=5))
    await settle()
    assert r.queue_lengths().get("m", 0) == 1
    gone.cancel()
    await settle()
    assert gone.cancelled() and r.queue_lengths().get("m", 0) == 0
    held.release()
    assert r.in_flight() == {"a": 0}, "the freed slot went to nobody"


async def test_a_slot_handed_to_a_waiter_as_it_is_cancelled_goes_to_the_next():
    r = router(("a", 1))
    held = await r.acquire("m")
    first = asyncio.create_task(r.acquire("m", wait_s=5))
    await settle()
    second = asyncio.create_task(r.acquire("m", wait_s=5))
    await settle()
    held.release()  # handed to ``first``, which has not run yet
    first.cancel()
    await settle()
    assert first.cancelled()
    lease = await asyncio.wait_for(second, 1)
    assert r.in_flight() == {"a": 1}
    lease.release()
    assert r.in_flight() == {"a": 0} and sum(r.queue_lengths().values()) == 0


async def test_a_waiter_with_an_exclusion_waits_for_another_replica():
    r = router(("a", 1), ("b", 1))
    on_a, on_b = await r.acquire("m"), await r.acquire("m")
    if on_a.replica != "a":
        on_a, on_b = on_b, on_a
    retry = asyncio.create_task(r.acquire("m", exclude={"a"}, wait_s=5))
    await settle()
    on_a.release()
    await settle()
    assert not retry.done(), "a slot on the excluded replica does not serve it"
    on_b.release()
    lease = await asyncio.wait_for(retry, 1)
    assert lease.replica == "b"
    lease.release()


async def test_a_replica_removed_while_leased_releases_cleanly():
    r = router(("a", 1), ("b", 1))
    leases = [await r.acquire("m"), await r.acquire("m")]
    r.update({"m": [("b", "10.0.0.1", 8001, 1)]})
    assert set(r.in_flight()) == {"b"}
    for lease in leases:
        lease.release()
        lease.release()
    assert r.in_flight() == {"b": 0}
    again = await r.acquire("m")
    assert again.replica == "b"
    again.release()


async def test_a_replica_back_in_the_table_keeps_the_count_of_its_open_leases():
    r = router(("a", 1))
    lease = await r.acquire("m")
    r.update({})
    r.update({"m": [("a", "10.0.0.1", 8000, 1)]})
    assert r.in_flight() == {"a": 1}
    assert r.pick("m") is None, "its one slot is still taken"
    lease.release()
    assert r.in_flight() == {"a": 0}


async def test_a_new_replica_serves_the_waiters_and_a_vanished_model_answers_none():
    r = router(("a", 1))
    held = await r.acquire("m")
    waiter = asyncio.create_task(r.acquire("m", wait_s=5))
    await settle()
    r.update({"m": [("a", "10.0.0.1", 8000, 1), ("b", "10.0.0.2", 8000, 1)]})
    lease = await asyncio.wait_for(waiter, 1)
    assert lease.replica == "b"

    stranded = asyncio.create_task(r.acquire("m", wait_s=5))
    await settle()
    r.update({})
    assert await asyncio.wait_for(stranded, 1) is None, "no replica left: the caller says 503"
    held.release()
    lease.release()
    assert r.in_flight() == {} and sum(r.queue_lengths().values()) == 0


async def test_the_same_key_returns_to_the_same_replica():
    r = router(("a", 8), ("b", 8), ("c", 8), ("d", 8))
    seen = set()
    for _ in range(20):
        lease = await r.acquire("m", affinity_key=b"user:alice")
        seen.add(lease.replica)
        lease.release()
    assert len(seen) == 1
    spread = set()
    for i in range(40):
        lease = await r.acquire("m", affinity_key=f"user:{i}".encode())
        spread.add(lease.replica)
        lease.release()
    assert spread == {"a", "b", "c", "d"}, "different keys land on different replicas"


async def test_a_lease_dropped_without_release_frees_its_slot(caplog):
    r = router(("a", 1))
    lease = await r.acquire("m")
    waiter = asyncio.create_task(r.acquire("m", wait_s=5))
    await settle()
    del lease  # as a stream generator that never started is dropped
    served = await asyncio.wait_for(waiter, 1)
    assert served.replica == "a" and "dropped without release" in caplog.text
    caplog.clear()  # on purpose here (tests/conftest.py fails any other test for it)
    served.release()
    assert r.in_flight() == {"a": 0}


@pytest.mark.parametrize(("last", "between"), [
    (b"", True),  # nothing written yet
    (b'data: {"a":1}\n\n', True),
    (b'data: {"a":1}\r\n\r\n', True),
    (b'data: {"a":1}\r\r', True),
    (b'data: {"a":1}\n\r\n', True),
    (b'data: {"a":1}\r\r\n', True),
    (b'data: {"a":1}\r\n\n', True),
    (b'data: {"a":1}\n\r', True),  # a lone CR ends a line
    (b'data: {"a":1}', False),
    (b'data: {"a":1}\n', False),  # a line, not yet the event
    (b'data: {"a":1}\r\n', False),
    (b'data: {"a":1}\r', False),
    (b'data: {"a":1}\n\ndata: {"b"', False),
])
def test_a_stream_is_ended_by_an_event_of_ours_only_between_two_events(last, between):
    assert ends_an_event(last) is between
