"""A build chosen for a node reaches it through the leader, against a real store on both
backends: at once where the choice is made on the leader, within the leader's next
controller interval where it is made on another server, and from the store when a
server starts."""

from __future__ import annotations

from llmgw import wire
from llmgw.server.controller import Controller
from llmgw.store import Store
from tests.store.controllers import Clock, controller_on

INTERVAL_S = 1.0


def _controller(store: Store, clock: Clock) -> Controller:
    return controller_on(store, clock, interval_s=INTERVAL_S)


def _register(node_id: str) -> wire.Register:
    return wire.Register(node_id=node_id, address="10.0.0.1",
                         inventory=wire.Inventory(hostname=node_id),
                         installable_engines=["llama.cpp"])


def _asked(controller: Controller, node_id: str) -> list[dict[str, str]]:
    """Each engine list the node was sent since last looked, as engine -> build."""
    outbox = controller.sessions.get(node_id).outbox
    sent = [outbox.get_nowait() for _ in range(outbox.qsize())]
    return [{e.name: e.build for e in m.engines} for m in sent
            if isinstance(m, wire.InstallEngines)]


async def test_a_choice_made_on_any_server_reaches_the_leaders_node(store: Store) -> None:
    clock = Clock()
    leader = _controller(store, clock)
    leader.took_lead((await store.take_lead("a", "x", ttl_s=60)).term)
    await leader.node_registered(_register("node-a"), clock.now)
    await leader.pass_once()
    assert _asked(leader, "node-a") == [{"llama.cpp": "auto"}]

    follower = _controller(store, clock)
    follower.leading = lambda: False
    follower.holds_lead = False
    words = await follower.set_engine_build("node-a", "llama.cpp", "vulkan")
    assert words == "this server does not lead; the leader tells node-a within 1 s"
    assert _asked(leader, "node-a") == []  # the leader has not read the store yet

    clock.now += INTERVAL_S
    await leader.pass_once()
    assert _asked(leader, "node-a") == [{"llama.cpp": "vulkan"}]

    # On the leader, at once; and none keeps the engine off the node.
    assert await leader.set_engine_build("node-a", "llama.cpp", "none") == (
        "node-a was told now")
    assert _asked(leader, "node-a") == [{}]
    assert await leader.set_engine_build("node-a", "llama.cpp", "none") == (
        "what node-a is asked for is unchanged: nothing to tell it")
    assert await leader.set_engine_build("node-a", "vllm", "cu129") == (
        "what node-a is asked for is unchanged: nothing to tell it (it is asked for no "
        "vllm: server.yaml does not name it for this node, or its agent cannot install "
        "it or disables it)")
    # A pass that reads the store again changes nothing the node was told.
    clock.now += INTERVAL_S
    await leader.pass_once()
    assert _asked(leader, "node-a") == []


async def test_a_starting_server_asks_its_first_nodes_for_the_kept_choice(
        store: Store) -> None:
    await store.put_engine_build("node-a", "llama.cpp", "cpu")
    clock = Clock()
    leader = _controller(store, clock)
    await leader.load_table()
    leader.took_lead((await store.take_lead("a", "x", ttl_s=60)).term)
    await leader.node_registered(_register("node-a"), clock.now)
    assert _asked(leader, "node-a") == [{"llama.cpp": "cpu"}]
    assert await leader.set_engine_build("node-b", "llama.cpp", "cpu") == (
        "node-b is not connected: it is told when it registers")
