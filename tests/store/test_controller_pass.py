"""The controller's view of the nodes: its pass against a real store, on both backends
(one node's failure to be recorded does not drop the pass for the others; a node is timed
from its Welcome), and the node views the pass reads, made again only when they change."""

from __future__ import annotations

from datetime import UTC, datetime

from llmgw import wire
from llmgw.core import reconcile
from llmgw.core.inventory import Timeouts
from llmgw.server.agents.sessions import NodeSessions
from llmgw.server.controller import Controller
from llmgw.store import NodeRecord, Store
from tests.store.controllers import Clock, controller_on


def _controller(store: Store, clock: Clock) -> Controller:
    """A controller with no models, nodes unreachable after 3 s and lost after 8 s."""
    return controller_on(store, clock, policy=reconcile.Policy())


def _register(node_id: str) -> wire.Register:
    return wire.Register(node_id=node_id, address="127.0.0.1",
                         inventory=wire.Inventory(hostname=node_id))


async def test_a_node_not_yet_in_the_store_does_not_drop_the_pass_for_the_others(
        store: Store) -> None:
    clock = Clock()
    controller = _controller(store, clock)
    sessions = controller.sessions
    at = datetime.fromtimestamp(clock.now, UTC)
    await store.put_node(NodeRecord(id="stored", address="127.0.0.1", state="ready",
                                    inventory={}, registered_at=at, last_seen_at=at,
                                    state_changed_at=at))
    # "racing" registered on its stream, its store write not made yet (a reconnect storm).
    sessions.attach(_register("stored"), clock.now)
    sessions.attach(_register("racing"), clock.now)

    clock.now += 4  # both silent past unreachable_after_s
    await controller.pass_once()

    [stored] = [n for n in await store.list_nodes() if n.id == "stored"]
    assert stored.state == "unreachable"
    assert {n.id: n.state.value for n in sessions.nodes()} == {
        "stored": "unreachable", "racing": "unreachable"}


async def test_a_node_is_timed_from_its_welcome_not_from_its_register(store: Store) -> None:
    # A pass in progress and the store write can stand between a node's Register and its
    # Welcome; it heartbeats only once welcomed.
    clock = Clock()
    controller = _controller(store, clock)
    sessions = controller.sessions
    registered_at = clock.now
    await controller.node_registered(_register("slow"), registered_at)
    clock.now += 2.5  # the Welcome went out late
    controller.node_welcomed("slow", clock.now)
    clock.now += 2  # 4.5 s after its Register, 2 s after its Welcome
    await controller.pass_once()
    assert {n.id: n.state.value for n in sessions.nodes()} == {"slow": "ready"}


def test_a_node_s_placement_view_is_made_again_only_when_what_it_reads_changed() -> None:
    sessions = NodeSessions(Timeouts(unreachable_after_s=3, lost_after_s=8))
    gpu = wire.Gpu(index=0, name="H100", memory_total_mib=81_559, memory_free_mib=81_000)
    sessions.attach(wire.Register(node_id="b", address="10.0.0.2",
                                  inventory=wire.Inventory(hostname="b", gpus=[gpu])), 0.0)
    sessions.attach(_register("a"), 0.0)
    first = sessions.nodes()
    assert [n.id for n in first] == ["a", "b"]
    # Nothing placement reads changed: the same views.
    sessions.heartbeat("b", wire.Heartbeat(gpu_memory_free_mib=[81_000]), 1.0)
    again = sessions.nodes()
    sessions.heartbeat("b", wire.Heartbeat(gpu_memory_free_mib=[81_000]), 2.0)
    assert sessions.nodes()[1] is again[1]
    # Free memory, busy ports, the state and the inventory each make it again.
    sessions.heartbeat("b", wire.Heartbeat(gpu_memory_free_mib=[40_000], ports_busy=[22]), 3.0)
    [_, b] = sessions.nodes()
    assert b.gpus[0].memory_free_mib == 40_000 and b.ports_busy == frozenset({22})
    sessions.refresh(7.0)
    assert sessions.nodes()[1].state.value == "unreachable"
    sessions.update_inventory("b", wire.Inventory(hostname="b", gpus=[gpu], fabric="ib-a"), 7.5)
    assert sessions.nodes()[1].fabric == "ib-a"
    sessions.attach(_register("0"), 8.0)  # a new node joins the order
    assert [n.id for n in sessions.nodes()] == ["0", "a", "b"]


async def test_a_node_registering_while_the_store_has_no_tables_is_welcomed_and_written_later(
        store: Store) -> None:
    from llmgw.store.tables import Base

    clock = Clock()
    controller = _controller(store, clock)
    sessions = controller.sessions
    async with store.engine.begin() as conn:
        await conn.run_sync(Base.metadata.drop_all)
    try:
        session, _ = await controller.node_registered(_register("during"), clock.now)
        assert session.node_id == "during"  # welcomed: it serves from memory
        assert [n.id for n in sessions.nodes()] == ["during"]
    finally:
        async with store.engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
    assert await store.list_nodes() == []
    clock.now += 4  # silent past unreachable_after_s, while the store answers again
    await controller.pass_once()  # the node is written, with the state it has now
    assert [(n.id, n.state) for n in await store.list_nodes()] == [("during", "unreachable")]
