"""Scale to zero in the controller, against a real store on both backends: a model that
can sleep is not placed before its first request; a request wakes it (on the leader at
once, on a follower through the store); it is unloaded after ``idle_unload_s`` without a
request, never while a request is in flight; and when it was last asked for outlives the
leader."""

from __future__ import annotations

import msgspec

from llmgw import config, wire
from llmgw.core import reconcile
from llmgw.server.activity import SETTING
from llmgw.server.catalog import catalog_of, entries
from llmgw.server.controller import Controller
from llmgw.store import Store
from tests.store.controllers import Clock, controller_on

IDLE_S = 60.0
SETTINGS = msgspec.convert({"models": [
    {"name": "nap", "profiles": [{"engine": "sim"}], "replicas": 1,
     "idle_unload_s": IDLE_S, "wake_timeout_s": 30},
    {"name": "always", "profiles": [{"engine": "sim"}], "replicas": 1},
]}, config.ServerConfig)


async def _controller(store: Store, clock: Clock) -> Controller:
    catalog = catalog_of(await entries(store, SETTINGS))
    return controller_on(store, clock, catalog=catalog, settings=SETTINGS)


async def _leader(store: Store, clock: Clock, holder: str = "a") -> Controller:
    controller = await _controller(store, clock)
    controller.took_lead((await store.take_lead(holder, "x", ttl_s=60)).term)
    await controller.node_registered(wire.Register(
        node_id="node-a", address="10.0.0.1",
        inventory=wire.Inventory(hostname="node-a", cpu_count=8, ram_total_mib=65_536)),
        clock.now)
    return controller


async def _pass(controller: Controller) -> reconcile.Plan:
    """A pass, node-a having just said it is alive (the clock jumps by minutes here)."""
    if controller.sessions.get("node-a") is not None:
        controller.sessions.heartbeat("node-a", wire.Heartbeat(), controller.clock())
    return await controller.pass_once()


def _placed(plan: reconcile.Plan) -> list[str]:
    return sorted(a.placement.model for a in plan.actions if isinstance(a, reconcile.Place))


def _stopped(plan: reconcile.Plan) -> list[str]:
    return sorted(a.replica for a in plan.actions if isinstance(a, reconcile.Stop))


def _ready(controller: Controller, model: str) -> str:
    """Mark ``model``'s replica ready, as its node would report it."""
    [replica] = [r for r in controller.replicas.values() if r.model == model]
    controller.shard_status("node-a", wire.ShardStatus(
        replica=replica.id, rank=0, state="ready", port=replica.shards[0].port,
        epoch=replica.epoch), controller.clock())
    return replica.id


async def test_a_sleeping_model_is_placed_by_its_first_request_and_unloaded_when_idle(
        store: Store) -> None:
    clock = Clock()
    leader = await _leader(store, clock)
    assert _placed(await _pass(leader)) == ["always"]
    assert leader.asleep == {"nap"} and not leader.expecting("nap")
    assert "asleep" in leader.why_not_ready("nap")

    leader.requested("nap")
    assert leader.expecting("nap") and leader.wake_left("nap") == 30
    assert _placed(await _pass(leader)) == ["nap"]
    assert leader.asleep == frozenset()
    rid = _ready(leader, "nap")
    assert not leader.expecting("nap")  # it serves: nothing more to wait for

    # In flight for longer than the idle time: kept.
    leader.load = lambda: {rid: 1}
    clock.now += IDLE_S + 1
    assert _stopped(await _pass(leader)) == []
    leader.load = dict
    clock.now += IDLE_S - 1
    assert _stopped(await _pass(leader)) == []
    clock.now += 1
    assert _stopped(await _pass(leader)) == [rid]
    assert leader.asleep == {"nap"}
    table = await store.get_setting("replica_table")
    assert table["asleep"] == ["nap"]

    # Asleep again: the next request wakes it anew, for a whole wake_timeout_s.
    leader.requested("nap")
    assert leader.expecting("nap") and leader.wake_left("nap") == 30
    assert _placed(await _pass(leader)) == ["nap"]


async def test_a_request_on_a_follower_wakes_the_model_through_the_store(
        store: Store) -> None:
    clock = Clock()
    leader = await _leader(store, clock)
    await _pass(leader)
    follower = await _controller(store, clock)
    follower.leading = lambda: False
    await follower.follow()
    assert follower.asleep == {"nap"}

    follower.requested("nap")
    assert follower.expecting("nap")
    await follower.follow()  # what the woken follow pass does: the store hears of it
    assert (await store.get_setting(SETTING))["nap"] == clock.now

    clock.now += 1  # the leader reads the models and the times once an interval
    assert _placed(await _pass(leader)) == ["nap"]
    _ready(leader, "nap")
    await _pass(leader)
    await follower.follow()
    assert follower.asleep == frozenset()
    assert [r[0] for r in follower.ready_endpoints()["nap"]] == [
        r.id for r in leader.replicas.values() if r.model == "nap"]
    assert not follower.expecting("nap")


async def test_when_a_model_was_last_asked_for_outlives_the_leader(store: Store) -> None:
    clock = Clock()
    first = await _leader(store, clock)
    first.requested("nap")
    assert _placed(await _pass(first)) == ["always", "nap"]
    clock.now += 1
    await _pass(first)  # reads the models again, and writes the times
    await store.give_up_lead("a", first.term)

    clock.now += IDLE_S / 2
    second = await _leader(store, clock, holder="b")
    await _pass(second)
    assert second.asleep == frozenset()  # asked for 31 s ago: awake
    clock.now += IDLE_S / 2
    await _pass(second)
    assert second.asleep == {"nap"}


async def test_a_model_never_asked_for_costs_the_store_nothing(store: Store) -> None:
    """Without a model that can sleep, no server reads or writes the times."""
    clock = Clock()
    plain = msgspec.convert({"models": [{"name": "always", "profiles": [{"engine": "sim"}]}]},
                            config.ServerConfig)
    leader = controller_on(store, clock, catalog=catalog_of(await entries(store, plain)),
                           settings=plain)
    leader.took_lead((await store.take_lead("a", "x", ttl_s=60)).term)
    await _pass(leader)
    assert leader.sleepy == frozenset()
    assert await store.get_setting(SETTING) is None
