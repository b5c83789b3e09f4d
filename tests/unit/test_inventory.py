"""Nodes: their state follows from when they were last heard from."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw import wire
from llmgw.core.catalog import Model, Profile
from llmgw.core.inventory import (
    EngineStatus,
    Gpu,
    NodeLiveness,
    NodeState,
    Timeouts,
    inventory_changes,
    node_from_register,
    node_state,
)
from llmgw.core.placement import newly_qualified, qualifications
from tests.unit.shapes import LLAMA_DOWNLOADING, h100_8x80g

TIMEOUTS = Timeouts(unreachable_after_s=15.0, lost_after_s=60.0)


@pytest.mark.parametrize(
    ("silent", "live", "state"),
    [
        (0.0, {}, NodeState.READY),
        (14.9, {}, NodeState.READY),
        (15.0, {}, NodeState.UNREACHABLE),
        (59.9, {}, NodeState.UNREACHABLE),
        (60.0, {}, NodeState.LOST),
        (0.0, {"connected": False}, NodeState.UNREACHABLE),
        (0.0, {"draining": True}, NodeState.DRAINING),
        (20.0, {"draining": True}, NodeState.UNREACHABLE),
        (0.0, {"lost": True}, NodeState.LOST),
        (0.0, {"lost": True, "connected": False}, NodeState.LOST),
    ],
)
def test_node_state_follows_from_silence(silent: float, live: dict, state: NodeState) -> None:
    liveness = NodeLiveness(last_seen=1000.0, **live)

    assert node_state(liveness, 1000.0 + silent, TIMEOUTS) is state


@pytest.mark.parametrize(
    ("state", "usable"),
    [("installed", True), ("configured", True), ("installing", False), ("failed", False)],
)
def test_engine_usable(state: str, usable: bool) -> None:
    assert EngineStatus("vllm", state=state).usable is usable


def test_node_engine_lookup() -> None:
    node = h100_8x80g("node01")

    assert node.engine("llama.cpp").detail == LLAMA_DOWNLOADING
    assert node.engine("sglang") is None


def test_node_from_register() -> None:
    msg = wire.Register(
        node_id="node05",
        address="10.0.0.6",
        inventory=wire.Inventory(
            hostname="node05",
            cpu_flags=["avx2", "fma"],
            ram_total_mib=2_063_731,
            gpus=[wire.Gpu(index=1, name="NVIDIA H100 80GB HBM3", memory_total_mib=81559,
                           memory_free_mib=80000, uuid="GPU-1")],
            engines=[wire.Engine(name="llama.cpp", version="b10991", state="installing",
                                 detail=LLAMA_DOWNLOADING)],
            fabric="ib-b",
            labels={"zone": "b", "rack": "r12"},
        ),
        port_range=(21000, 21099),
    )

    node = node_from_register(msg, NodeState.READY, last_seen=42.0)

    assert node.id == "node05"
    assert node.address == "10.0.0.6"
    assert node.state is NodeState.READY
    assert node.gpus == (Gpu(1, "NVIDIA H100 80GB HBM3", 81559, 80000),)
    assert node.engines == (EngineStatus("llama.cpp", "b10991", "installing", LLAMA_DOWNLOADING),)
    assert node.cpu_flags == frozenset({"avx2", "fma"})
    assert node.ram_total_mib == 2_063_731
    assert node.fabric == "ib-b"
    assert node.labels == (("rack", "r12"), ("zone", "b"))
    assert node.port_range == (21000, 21099)
    assert node.last_seen == 42.0


def test_the_latest_heartbeat_updates_free_gpu_memory_and_busy_ports():
    msg = wire.Register(
        node_id="node01", address="10.0.0.1", ports_busy=[20001],
        inventory=wire.Inventory(hostname="node01", gpus=[
            wire.Gpu(index=i, name="NVIDIA H100 80GB HBM3", memory_total_mib=81559,
                     memory_free_mib=81000) for i in range(2)]),
    )
    beat = wire.Heartbeat(gpu_memory_free_mib=[81000, 1200], ports_busy=[20005])

    node = node_from_register(msg, NodeState.READY, 0.0, beat)

    assert [g.memory_free_mib for g in node.gpus] == [81000, 1200]
    assert node.ports_busy == frozenset({20005})
    # A heartbeat that does not line up with the inventory (a GPU fell off the bus) is not
    # trusted for memory: the registration's figures stand until the node registers again.
    odd = node_from_register(msg, NodeState.READY, 0.0,
                             wire.Heartbeat(gpu_memory_free_mib=[5], ports_busy=[]))
    assert [g.memory_free_mib for g in odd.gpus] == [81000, 81000]
    assert node_from_register(msg, NodeState.READY, 0.0).ports_busy == frozenset({20001})


# --- inventory changes and "now qualifies" ------------------------------------------------

def _inventory(**fields) -> wire.Inventory:
    base = dict(hostname="node05", ram_total_mib=31 * 1024, ram_available_mib=20_000,
                cpu_count=8, cpu_flags=["avx", "avx2"])
    return wire.Inventory(**{**base, **fields})


def test_what_moves_every_heartbeat_is_not_a_change() -> None:
    old = _inventory(gpus=[wire.Gpu(index=0, name="NVIDIA L4", memory_total_mib=23034,
                                    memory_free_mib=22000)],
                     weights_dirs=[wire.WeightsDir(path="/w", free_mib=100)])
    new = _inventory(ram_available_mib=1_000,
                     gpus=[wire.Gpu(index=0, name="NVIDIA L4", memory_total_mib=23034,
                                    memory_free_mib=10)],
                     weights_dirs=[wire.WeightsDir(path="/w", free_mib=5)])

    assert inventory_changes(old, new) == []


def test_changes_are_said_in_words() -> None:
    old = _inventory(engines=[wire.Engine(name="llama.cpp", version="b10991")])
    new = _inventory(ram_total_mib=64 * 1024,
                     engines=[wire.Engine(name="llama.cpp", version="b11000"),
                              wire.Engine(name="vllm", version="0.11.0")],
                     weights=["org/q@main"])

    assert inventory_changes(old, new) == [
        "RAM 31 GiB -> 64 GiB",
        "engine llama.cpp b10991 -> llama.cpp b11000",
        "engine +vllm 0.11.0",
        "weights +org/q@main",
    ]


def _register(inventory: wire.Inventory) -> wire.Register:
    return wire.Register(node_id="node05", address="10.0.0.5", inventory=inventory)


def test_a_node_given_an_engine_now_qualifies_and_says_what_stopped_it() -> None:
    model = Model("qwen-7b", (Profile("gpu", "vllm", gpus=1),))
    gpu = wire.Gpu(index=0, name="NVIDIA L4", memory_total_mib=23034, memory_free_mib=22000)
    before = node_from_register(_register(_inventory(gpus=[gpu])), NodeState.READY, 0)
    after = node_from_register(
        _register(_inventory(gpus=[gpu], engines=[wire.Engine(name="vllm", version="0.11")])),
        NodeState.READY, 0)

    assert newly_qualified([model], before, after) == [
        "node05 now qualifies for qwen-7b (before: vllm is not installed)"]
    assert newly_qualified([model], after, after) == []
    # A node seen for the first time is not news.
    assert newly_qualified([model], None, after) == []


def test_qualifying_ignores_what_runs_and_the_nodes_state() -> None:
    model = Model("big", (Profile("tp8", "vllm", gpus=8),))
    node = h100_8x80g("node1", state=NodeState.UNREACHABLE)

    assert qualifications([model], node) == {"big": None}
    assert qualifications([model], replace(node, gpus=node.gpus[:4])) == {
        "big": "needs 8 GPUs, has 4"}
