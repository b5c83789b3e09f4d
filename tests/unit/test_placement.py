"""Placement over named hardware shapes: where a replica goes, and why it goes nowhere else."""

from __future__ import annotations

import pytest

from llmgw.core.catalog import Model, Profile
from llmgw.core.inventory import EngineStatus, Gpu, Node, NodeState
from llmgw.core.placement import (
    NodeUsage,
    Placement,
    PlacementResult,
    Refusal,
    ShardPlacement,
    place_model,
)
from llmgw.core.placement import place as _place
from tests.unit.shapes import (
    LLAMA_DOWNLOADING,
    cpu_avx2,
    cpu_only_no_avx2,
    h100_8x80g,
    rtx4090_2x24g,
    two_fabrics_of_four,
)

ALL_8 = frozenset(range(8))


def profile(engine: str = "vllm", **kw) -> Profile:
    return Profile(name=kw.pop("name", "default"), engine=engine, **kw)


def place(prof: Profile, nodes, usage=None, strategy="binpack") -> PlacementResult:
    return _place(Model("m", (prof,)), prof, nodes, usage or {}, strategy)


def refusal_for(result: PlacementResult, node_id: str) -> str:
    reasons = [r.reason for r in result.refusals if r.node_id == node_id]
    assert len(reasons) == 1, result.refusals
    return reasons[0]


# --- single-node fits ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("node", "gpus", "expected_gpus"),
    [
        (rtx4090_2x24g("ws1"), 1, (0,)),
        (rtx4090_2x24g("ws1"), 2, (0, 1)),
        (h100_8x80g("node01"), 1, (0,)),
        (h100_8x80g("node01"), 8, tuple(range(8))),
    ],
    ids=["4090x2-1gpu", "4090x2-2gpu", "h100x8-1gpu", "h100x8-8gpu"],
)
def test_fits_on_one_node(node: Node, gpus: int, expected_gpus: tuple[int, ...]) -> None:
    result = place(profile(gpus=gpus), [node])

    assert result.refusals == ()
    assert result.placement == Placement(
        model="m",
        profile="default",
        shards=(ShardPlacement(0, node.id, node.address, 20000, expected_gpus),),
        fabric=None,
        rendezvous_port=None,
    )


@pytest.mark.parametrize(
    ("node", "prof", "reason"),
    [
        (rtx4090_2x24g("ws1"), profile(gpus=8), "needs 8 GPUs, has 2"),
        (rtx4090_2x24g("ws1"), profile(gpus=3), "needs 3 GPUs, has 2"),
        (cpu_avx2("cpu1"), profile("llama.cpp", gpus=1), "needs 1 GPU, has no GPUs"),
        (
            rtx4090_2x24g("ws1"),
            profile(gpus=1, gpu_memory_mib=40 * 1024),
            "needs 1 GPU with 40 GiB free, has 0",
        ),
        (
            h100_8x80g("node01"),
            profile(gpus=2, gpu_memory_mib=80 * 1024),
            "needs 2 GPUs with 80 GiB free, has 0",
        ),
    ],
    ids=["8-on-2x", "3-on-2x", "gpu-on-cpu", "40GiB-on-4090", "80GiB-on-h100"],
)
def test_refuses_a_node_too_small(node: Node, prof: Profile, reason: str) -> None:
    result = place(prof, [node])

    assert result.placement is None
    assert result.refusals == (Refusal(node.id, reason),)
    assert result.refusals[0].kind == "gpus"  # the class metrics count it by


def test_gpu_memory_counts_free_memory_per_gpu() -> None:
    # GPUs 0 and 2 hold another tenant's memory; only 1 and 3 have 40 GiB free.
    node = Node(
        id="ws1",
        address="10.0.0.9",
        state=NodeState.READY,
        gpus=(
            Gpu(0, "NVIDIA A100", 40960, 2048),
            Gpu(1, "NVIDIA A100", 81920, 80000),
            Gpu(2, "NVIDIA A100", 81920, 30000),
            Gpu(3, "NVIDIA A100", 81920, 81000),
        ),
        engines=(EngineStatus("vllm"),),
    )

    fit = place(profile(gpus=2, gpu_memory_mib=40 * 1024), [node])
    too_many = place(profile(gpus=3, gpu_memory_mib=40 * 1024), [node])

    assert fit.placement is not None
    assert fit.placement.shards[0].gpus == (1, 3)
    assert too_many.refusals == (Refusal("ws1", "needs 3 GPUs with 40 GiB free, has 2"),)


def test_used_gpus_are_never_given_again() -> None:
    node = h100_8x80g("node01")
    usage = {"node01": NodeUsage(gpus=frozenset({0, 1, 2}), ports=frozenset({20000}), shards=1)}

    one = place(profile(gpus=1), [node], usage)
    five = place(profile(gpus=5), [node], usage)
    six = place(profile(gpus=6), [node], usage)

    assert one.placement is not None and one.placement.shards[0].gpus == (3,)
    assert five.placement is not None and five.placement.shards[0].gpus == (3, 4, 5, 6, 7)
    assert six.refusals == (Refusal("node01", "needs 6 GPUs, has 5"),)


def test_all_gpus_used_refuses_even_one() -> None:
    usage = {"node01": NodeUsage(gpus=ALL_8)}

    result = place(profile(gpus=1), [h100_8x80g("node01")], usage)

    assert result.refusals == (Refusal("node01", "needs 1 GPU, has 0"),)


# --- strategy --------------------------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "chosen"), [("binpack", "node02"), ("spread", "node01")])
def test_binpack_fills_the_fuller_node_spread_the_emptier(strategy: str, chosen: str) -> None:
    nodes = [h100_8x80g("node01"), h100_8x80g("node02")]
    usage = {"node02": NodeUsage(gpus=frozenset(range(6)), ports=frozenset({20000}), shards=1)}

    result = place(profile(gpus=1), nodes, usage, strategy)

    assert result.placement is not None
    assert result.placement.shards[0].node_id == chosen


@pytest.mark.parametrize(("strategy", "chosen"), [("binpack", "cpu2"), ("spread", "cpu1")])
def test_gpu_less_shards_are_packed_by_shard_count(strategy: str, chosen: str) -> None:
    nodes = [cpu_avx2("cpu1"), cpu_avx2("cpu2")]
    usage = {"cpu2": NodeUsage(ports=frozenset({20000, 20001}), shards=2)}

    result = place(profile("llama.cpp"), nodes, usage, strategy)

    assert result.placement is not None
    assert result.placement.shards[0].node_id == chosen


def test_ties_break_by_node_id_whatever_the_input_order() -> None:
    nodes = [h100_8x80g("node03"), h100_8x80g("node01"), h100_8x80g("node02")]

    forward = place(profile(gpus=8), nodes)
    backward = place(profile(gpus=8), list(reversed(nodes)))

    assert forward == backward
    assert forward.placement is not None
    assert forward.placement.shards[0].node_id == "node01"


# --- node state and engines ----------------------------------------------------------------


@pytest.mark.parametrize(
    "state",
    [NodeState.REGISTERING, NodeState.UNREACHABLE, NodeState.LOST, NodeState.DRAINING],
)
def test_a_node_that_is_not_ready_is_refused_with_its_state(state: NodeState) -> None:
    result = place(profile(gpus=1), [h100_8x80g("node01", state=state)])

    assert result.refusals == (Refusal("node01", f"not ready ({state.value})"),)


def test_missing_engine_is_refused_by_name() -> None:
    result = place(profile("vllm"), [cpu_avx2("cpu1")])

    assert result.refusals == (Refusal("cpu1", "vllm is not installed"),)
    assert result.refusals[0].kind == "engine"


def test_installing_engine_is_refused_in_the_nodes_own_words() -> None:
    result = place(profile("llama.cpp"), [h100_8x80g("node01")])

    assert result.refusals == (Refusal("node01", LLAMA_DOWNLOADING),)


def test_failed_engine_is_refused_with_its_name_and_detail() -> None:
    broken = EngineStatus("vllm", "0.11.0", "failed", "exit 127: libcuda.so.1 not found")
    node = h100_8x80g("node01", engines=(broken,))

    result = place(profile("vllm", gpus=1), [node])

    assert result.refusals == (Refusal("node01", "vllm exit 127: libcuda.so.1 not found"),)


def test_configured_engine_is_usable() -> None:
    node = h100_8x80g("node01", engines=(EngineStatus("sglang", state="configured"),))

    assert place(profile("sglang", gpus=1), [node]).placement is not None


@pytest.mark.parametrize(
    "node",
    [cpu_only_no_avx2("old1"), cpu_avx2("cpu1"), rtx4090_2x24g("ws1"), h100_8x80g("node01")],
    ids=["no-avx2", "avx2", "4090", "h100"],
)
def test_sim_runs_anywhere(node: Node) -> None:
    bare = Node(node.id, node.address, node.state, node.gpus, engines=())

    result = place(profile("sim"), [bare])

    assert result.placement is not None
    assert result.placement.shards[0].node_id == node.id


def test_a_successful_placement_carries_no_refusals() -> None:
    nodes = [cpu_only_no_avx2("old1"), rtx4090_2x24g("ws1"), h100_8x80g("node01")]

    result = place(profile(gpus=4), nodes)

    assert result.placement is not None and result.placement.shards[0].node_id == "node01"
    assert result.refusals == ()


# --- multi-node ------------------------------------------------------------------------------


def test_multi_node_takes_both_nodes_from_one_fabric() -> None:
    result = place(profile(nodes=2, gpus=8), two_fabrics_of_four())

    placement = result.placement
    assert placement is not None
    assert [s.rank for s in placement.shards] == [0, 1]
    assert [s.node_id for s in placement.shards] == ["node01", "node02"]
    assert placement.fabric == "ib-a"
    assert all(s.gpus == tuple(range(8)) for s in placement.shards)


def test_multi_node_moves_to_the_fabric_that_can_hold_all_of_it() -> None:
    full = NodeUsage(gpus=ALL_8, ports=frozenset({20000}), shards=1)
    # ib-a keeps only node04 free; ib-b has all four.
    usage = {n: full for n in ("node01", "node02", "node03")}

    result = place(profile(nodes=2, gpus=8), two_fabrics_of_four(), usage)

    assert result.placement is not None
    assert result.placement.fabric == "ib-b"
    assert [s.node_id for s in result.placement.shards] == ["node05", "node06"]
    assert result.placement.describe() == "placed on node05+node06 (ib-b)"


def test_multi_node_never_spans_fabrics() -> None:
    full = NodeUsage(gpus=ALL_8, ports=frozenset({20000}), shards=1)
    # One free node on each fabric: two free nodes in all, but never on one fabric.
    usage = {n: full for n in ("node01", "node02", "node03", "node05", "node06", "node07")}

    result = place(profile(nodes=2, gpus=8), two_fabrics_of_four(), usage)

    assert result.placement is None
    assert refusal_for(result, "fabric ib-a") == "has 1 of 2 nodes that fit"
    assert refusal_for(result, "fabric ib-b") == "has 1 of 2 nodes that fit"
    assert "fabric ib-a: has 1 of 2 nodes" in result.describe()


def test_multi_node_refuses_nodes_without_a_fabric() -> None:
    nodes = [rtx4090_2x24g("ws1"), rtx4090_2x24g("ws2"), h100_8x80g("node01", "ib-a")]

    result = place(profile(nodes=2, gpus=1), nodes)

    assert result.placement is None
    for node_id in ("ws1", "ws2"):
        assert "no fabric" in refusal_for(result, node_id)
    assert refusal_for(result, "fabric ib-a") == "has 1 of 2 nodes that fit"


def test_multi_node_binpack_uses_the_partly_filled_node() -> None:
    usage = {"node03": NodeUsage(gpus=frozenset({0, 1, 2, 3}), ports=frozenset({20000}), shards=1)}

    result = place(profile(nodes=2, gpus=4), two_fabrics_of_four(), usage)

    assert result.placement is not None
    nodes = [s.node_id for s in result.placement.shards]
    assert nodes[0] == "node03"
    assert result.placement.shards[0].gpus == (4, 5, 6, 7)
    assert result.placement.fabric == "ib-a"


def test_leader_gets_a_rendezvous_port_distinct_from_its_http_port() -> None:
    usage = {"node01": NodeUsage(ports=frozenset({20000, 20002}))}

    result = place(profile("sim", nodes=2), two_fabrics_of_four(), usage)

    placement = result.placement
    assert placement is not None
    leader = placement.shards[0]
    assert leader.node_id == "node01"
    assert leader.port == 20001
    assert placement.rendezvous_port == 20003
    assert placement.rendezvous_port not in usage["node01"].ports


def test_a_follower_needs_only_one_port() -> None:
    nodes = [
        h100_8x80g("node01", "ib-a"),
        h100_8x80g("node02", "ib-a", port_range=(30000, 30000)),
    ]

    result = place(profile("sim", nodes=2), nodes)

    assert result.placement is not None, result.describe()
    assert [(s.node_id, s.port) for s in result.placement.shards] == [
        ("node01", 20000),
        ("node02", 30000),
    ]


def test_single_node_replica_has_no_rendezvous_port() -> None:
    result = place(profile("sim"), [cpu_avx2("cpu1")])

    assert result.placement is not None
    assert result.placement.rendezvous_port is None


# --- ports -----------------------------------------------------------------------------------


def test_ports_come_from_the_nodes_range_and_skip_used_ones() -> None:
    node = h100_8x80g("node01", port_range=(30000, 30005))
    usage = {"node01": NodeUsage(ports=frozenset({30000, 30001, 30003}))}

    result = place(profile(gpus=1), [node], usage)

    assert result.placement is not None
    assert result.placement.shards[0].port == 30002


@pytest.mark.parametrize(
    ("prof", "port_range", "used"),
    [
        (profile(gpus=1), (30000, 30001), {30000, 30001}),
        (profile(gpus=1), (30000, 30000), {30000}),
    ],
    ids=["two-used", "one-used"],
)
def test_no_free_port(prof: Profile, port_range: tuple[int, int], used: set[int]) -> None:
    node = h100_8x80g("node01", "ib-a", port_range=port_range)

    result = place(prof, [node], {"node01": NodeUsage(ports=frozenset(used))})

    low, high = port_range
    assert refusal_for(result, "node01") == f"no free port left in {low}-{high}"
    assert {r.kind for r in result.refusals} == {"ports"}


def test_a_group_needs_a_leader_with_two_free_ports() -> None:
    # The leader binds its HTTP port and the group's rendezvous port; workers need one.
    nodes = [h100_8x80g(n, "ib-a", port_range=(30000, 30001)) for n in ("node01", "node02")]
    usage = {n.id: NodeUsage(ports=frozenset({30001})) for n in nodes}

    result = place(profile("sim", nodes=2), nodes, usage)

    assert result.placement is None
    assert refusal_for(result, "fabric ib-a") == "no node has two free ports for the group's leader"


# --- profiles in order -----------------------------------------------------------------------

TP8 = profile("vllm", name="tp8", gpus=8)
CPU = profile("llama.cpp", name="cpu")
TWO = Model("Qwen/Qwen2.5-72B", (TP8, CPU))


def test_place_model_tries_profiles_in_order() -> None:
    nodes = [h100_8x80g("node01", engines=(EngineStatus("vllm"), EngineStatus("llama.cpp")))]

    result = place_model(TWO, nodes, {})

    assert result.placement is not None
    assert result.placement.profile == "tp8"


def test_place_model_falls_back_to_the_second_profile() -> None:
    result = place_model(TWO, [rtx4090_2x24g("ws1")], {})

    assert result.placement is not None
    assert result.placement.profile == "cpu"
    assert result.placement.model == "Qwen/Qwen2.5-72B"
    assert result.placement.shards[0].gpus == ()


def test_place_model_names_the_profile_in_each_refusal() -> None:
    nodes = [h100_8x80g("node01"), rtx4090_2x24g("ws1", engines=(EngineStatus("vllm"),))]
    usage = {"node01": NodeUsage(gpus=ALL_8)}

    result = place_model(TWO, nodes, usage)

    assert result.placement is None
    assert result.refusals == (
        Refusal("node01", "[tp8] needs 8 GPUs, has 0"),
        Refusal("ws1", "[tp8] needs 8 GPUs, has 2"),
        Refusal("node01", "[cpu] " + LLAMA_DOWNLOADING),
        Refusal("ws1", "[cpu] llama.cpp is not installed"),
    )


def test_place_model_with_one_profile_adds_no_prefix() -> None:
    model = Model("m", (TP8,))

    result = place_model(model, [rtx4090_2x24g("ws1")], {})

    assert result.refusals == (Refusal("ws1", "needs 8 GPUs, has 2"),)


# --- describe --------------------------------------------------------------------------------


def test_describe_a_multi_node_placement() -> None:
    full = NodeUsage(gpus=ALL_8, ports=frozenset({20000}), shards=1)
    usage = {"node01": full, "node02": full}

    result = place(profile(nodes=2, gpus=8), two_fabrics_of_four(), usage)

    assert result.describe() == "placed on node03+node04 (ib-a)"


def test_describe_a_single_node_placement_without_fabric() -> None:
    assert place(profile(gpus=1), [rtx4090_2x24g("ws1")]).describe() == "placed on ws1"


def test_describe_refusals_and_an_empty_cluster() -> None:
    refused = place(profile(gpus=8), [rtx4090_2x24g("ws1"), cpu_avx2("cpu1")])

    assert refused.describe() == "cpu1: vllm is not installed; ws1: needs 8 GPUs, has 2"
    assert place(profile(gpus=1), []).describe() == "no nodes have registered"
