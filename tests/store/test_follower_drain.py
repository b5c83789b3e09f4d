"""Draining over the admin API on a server that does not lead, against a real store on
both backends: the node is found in the leader's records, the drain is kept in the store,
and the leader drains the node at its next read; a node never registered is refused."""

from __future__ import annotations

import pytest

from llmgw import wire
from llmgw.server.admin.nodes import drain_node
from llmgw.server.errors import ApiError
from llmgw.store import Store
from tests.store.controllers import Clock, controller_on


async def test_a_follower_keeps_the_drain_for_the_leader(store: Store) -> None:
    clock = Clock()
    leader = controller_on(store, clock)
    leader.took_lead((await store.take_lead("a", "x", ttl_s=60)).term)
    await leader.node_registered(wire.Register(
        node_id="node-a", address="10.0.0.1",
        inventory=wire.Inventory(hostname="node-a", cpu_count=8)), clock.now)
    await leader.pass_once()
    follower = controller_on(store, clock)
    follower.leading = lambda: False
    follower.holds_lead = False

    shown = await drain_node(follower, "node-a", True)
    assert shown.id == "node-a"
    clock.now += 1  # the leader reads the drains once an interval
    await leader.pass_once()
    assert leader.sessions.get("node-a").state.value == "draining"

    with pytest.raises(ApiError) as refused:
        await drain_node(follower, "node-zz", True)
    assert refused.value.status == 404 and refused.value.message.startswith(
        "no node 'node-zz' has registered")
