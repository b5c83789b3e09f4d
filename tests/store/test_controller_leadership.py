"""The controller across leaders and lost nodes, against a real store on both backends:
a follower routes by the leader's replica table; a deposed leader's writes are refused
and its nodes sent away; a lost node's ready replica stays routed until its replacement
serves, and is stopped when the node returns."""

from __future__ import annotations

import msgspec
import pytest

from llmgw import config, wire
from llmgw.core import reconcile
from llmgw.server.agents.sessions import Close
from llmgw.server.catalog import catalog_of, entries
from llmgw.server.controller import CLOSE_NOT_LEADER, Controller
from llmgw.store import Store
from llmgw.store.leases import Fenced
from tests.store.controllers import Clock, controller_on

SETTINGS = msgspec.convert({"models": [{"name": "m", "profiles": [{"engine": "sim"}],
                                        "replicas": 1}]}, config.ServerConfig)


async def _controller(store: Store, clock: Clock) -> Controller:
    catalog = catalog_of(await entries(store, SETTINGS))
    return controller_on(store, clock, catalog=catalog, settings=SETTINGS)


def _register(node_id: str, running: list[wire.RunningShard] = ()) -> wire.Register:
    return wire.Register(node_id=node_id, address=f"10.0.0.{ord(node_id[-1]) - 96}",
                         inventory=wire.Inventory(hostname=node_id, cpu_count=8,
                                                  ram_total_mib=65_536),
                         running=list(running))


def _running(replica: str, epoch: int) -> wire.RunningShard:
    return wire.RunningShard(replica=replica, rank=0, world_size=1, epoch=epoch, model="m",
                             profile="default", engine="sim", port=20001, state="ready")


def _sent(controller: Controller, node_id: str) -> list:
    outbox = controller.sessions.get(node_id).outbox
    items = []
    while not outbox.empty():
        items.append(outbox.get_nowait())
    return items


async def _leader(store: Store, clock: Clock, holder: str = "a") -> Controller:
    controller = await _controller(store, clock)
    controller.took_lead((await store.take_lead(holder, "x", ttl_s=60)).term)
    return controller


async def test_a_follower_routes_by_the_leader_s_table(store: Store) -> None:
    clock = Clock()
    leader = await _leader(store, clock)
    await leader.node_registered(_register("node-a", [_running("m-e7", 7)]), clock.now)
    await leader.pass_once()  # takes over: waits for nodes, publishes what it has
    assert leader.ready_endpoints() == {"m": [("m-e7", "10.0.0.1", 20001, 64)]}

    follower = await _controller(store, clock)
    follower.leading = lambda: False
    await follower.follow()
    assert follower.ready_endpoints() == leader.ready_endpoints()
    assert follower.unsure == frozenset()  # node-a is ready, as the leader saw it
    assert await follower.pass_once() == reconcile.Plan()  # a follower plans nothing


async def test_a_deposed_leader_s_write_is_refused_and_its_nodes_sent_away(
        store: Store) -> None:
    clock = Clock()
    leader = await _leader(store, clock)
    await leader.node_registered(_register("node-a"), clock.now)
    outbox = leader.sessions.get("node-a").outbox
    await store.give_up_lead("a", leader.term)
    await store.take_lead("b", "y", ttl_s=60)

    leader.sessions.heartbeat("node-a", wire.Heartbeat(), clock.now)
    with pytest.raises(Fenced):
        await leader.pass_once()
    leader.deposed("another server took the lead")
    assert leader.term is None and leader.sessions.get("node-a") is None
    *_, closed = [outbox.get_nowait() for _ in range(outbox.qsize())]
    assert isinstance(closed, Close) and closed.code == CLOSE_NOT_LEADER


async def test_a_lost_node_s_replica_serves_until_replaced_and_is_stopped_on_return(
        store: Store) -> None:
    clock = Clock()
    leader = await _leader(store, clock)
    await leader.node_registered(_register("node-a", [_running("m-e7", 7)]), clock.now)
    await leader.node_registered(_register("node-b"), clock.now)
    await leader.pass_once()
    _sent(leader, "node-b")

    # node-a falls silent: unreachable (checked by the probe), then lost.
    clock.now += 4
    leader.sessions.heartbeat("node-b", wire.Heartbeat(), clock.now)
    await leader.pass_once()
    assert leader.unsure == {"m-e7"}
    assert set(leader.unsure_endpoints()) == {"m-e7"}
    clock.now += 6
    leader.sessions.heartbeat("node-b", wire.Heartbeat(), clock.now)
    await leader.pass_once()
    # Replaced on node-b at once (no crash-loop backoff), still routed meanwhile.
    [start] = [m for m in _sent(leader, "node-b") if isinstance(m, wire.StartShard)]
    assert start.term == leader.term
    assert leader.ready_endpoints() == {"m": [("m-e7", "10.0.0.1", 20001, 64)]}
    assert leader.backoffs.get("m", reconcile.Backoff()).failures == 0
    # ... unless its engine does not answer the gateway's own check either.
    leader.set_probe_failed(frozenset({"m-e7"}))
    assert leader.ready_endpoints() == {}
    assert "did not answer this server's health check" in leader.why_not_ready("m")
    leader.set_probe_failed(frozenset())

    leader.shard_status("node-b", wire.ShardStatus(replica=start.replica, rank=0,
                                                   epoch=start.epoch, state="ready",
                                                   port=start.port), clock.now)
    await leader.pass_once()
    assert leader.ready_endpoints() == {"m": [(start.replica, "10.0.0.2", start.port, 64)]}

    # node-a returns still running it: it is stopped, not adopted.
    await leader.node_registered(_register("node-a", [_running("m-e7", 7)]), clock.now)
    [stop] = [m for m in _sent(leader, "node-a") if isinstance(m, wire.StopShard)]
    assert (stop.replica, stop.reason) == ("m-e7", "replaced while its node was lost")
    assert set(leader.replicas) == {start.replica} and leader.orphans == {}
