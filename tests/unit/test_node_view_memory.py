"""A node's view shows GPU memory and weights space free as of its last heartbeat (what
placement reads), the inventory's until one came or when the lists do not match."""

from __future__ import annotations

from llmgw import wire
from llmgw.core.inventory import Timeouts
from llmgw.server.admin.nodes import node_view
from llmgw.server.agents.sessions import NodeSessions


def test_gpu_memory_free_is_the_last_heartbeat_s() -> None:
    gpus = [wire.Gpu(index=i, name="NVIDIA H100 80GB HBM3", memory_total_mib=81_559,
                     memory_free_mib=81_000) for i in range(2)]
    sessions = NodeSessions(Timeouts())
    session, _ = sessions.attach(wire.Register(
        node_id="gpu-1", address="10.0.0.1",
        inventory=wire.Inventory(hostname="gpu-1", gpus=gpus)), 0.0)
    assert [g.memory_free_mib for g in node_view(session, []).gpus] == [81_000, 81_000]
    sessions.heartbeat("gpu-1", wire.Heartbeat(gpu_memory_free_mib=[1_200, 40_000]), 1.0)
    assert [g.memory_free_mib for g in node_view(session, []).gpus] == [1_200, 40_000]
    # A heartbeat that does not list every GPU (one fell off the bus): the inventory's.
    sessions.heartbeat("gpu-1", wire.Heartbeat(gpu_memory_free_mib=[5]), 2.0)
    assert [g.memory_free_mib for g in node_view(session, []).gpus] == [81_000, 81_000]
