"""Scenarios over named hardware for the newer behaviour of placement and planning: node
selectors, disabled engines, CPUs without AVX2, weights locality, placing several replicas
at once, priority and eviction, draining, scale-down order, held room, lost nodes and what
a healed partition or a control-plane restart leaves behind.

Each table row is one cluster and one question; the expected text is the text an operator
reads in `llmgw ctl status`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from llmgw.core.catalog import Catalog, Model, Profile, Selector
from llmgw.core.inventory import Node, NodeState
from llmgw.core.placement import (
    NodeUsage,
    Placement,
    PlacementResult,
    Refusal,
    place,
    place_model,
    place_replicas,
)
from llmgw.core.reconcile import Evict, Place, Plan, Policy, Reap, Stop, plan
from llmgw.core.replicas import Replica, ReplicaState, Shard, adopt, new_replica
from tests.unit.shapes import (
    LLAMA,
    VLLM,
    address_of,
    cpu_avx2,
    cpu_only_no_avx2,
    disabling,
    graviton3,
    h100_8x80g,
    holding,
    labelled,
    raspberry_pi_32bit,
    rtx4090_2x24g,
    two_fabrics_of_four,
)

NOW = 1000.0
ALL_8 = frozenset(range(8))
FULL = NodeUsage(gpus=ALL_8, ports=frozenset({20000}), shards=1)

TP1 = Profile("tp1", "vllm", gpus=1)
TP2 = Profile("tp2", "vllm", gpus=2)
TP4 = Profile("tp4", "vllm", gpus=4)
TP8 = Profile("tp8", "vllm", gpus=8)
CPU = Profile("cpu", "llama.cpp")
CPU_AVX2 = Profile("cpu", "llama.cpp", require_avx2=True)
SIM = Profile("sim", "sim")
PAIR = Profile("pair", "vllm", nodes=2, gpus=8)
SIM_PAIR = Profile("pair", "sim", nodes=2)

ANY_NODE = Selector()
NO_AVX2_WARNING = "old1's CPU has no AVX2: a CPU engine runs several times slower there"


def model(name: str = "m", *profiles: Profile, replicas: int = 1, priority: int = 0,
          selector: Selector = ANY_NODE) -> Model:
    return Model(name, profiles or (TP1,), replicas, priority=priority, selector=selector)


def catalog(*models: Model) -> Catalog:
    return Catalog(tuple(models))


def running(
    id: str,
    *shards: tuple[str, tuple[int, ...], int],
    model: str = "m",
    profile: str = "tp1",
    state: ReplicaState = ReplicaState.READY,
    created_at: float = 0.0,
    epoch: int = 1,
    rendezvous_port: int | None = None,
) -> Replica:
    """A replica with one shard per (node, gpus, port), ranks in the order given."""
    shard_state = "ready" if state is ReplicaState.READY else "starting"
    return Replica(
        id=id,
        model=model,
        profile=profile,
        epoch=epoch,
        world_size=len(shards),
        shards=tuple(Shard(rank, node, address_of(node), port, gpus, shard_state)
                     for rank, (node, gpus, port) in enumerate(shards)),
        state=state,
        created_at=created_at,
        ready_since=created_at if state is ReplicaState.READY else None,
        rendezvous_port=rendezvous_port,
    )


def of_type(result: Plan, kind: type) -> list:
    return [a for a in result.actions if isinstance(a, kind)]


def placed(result: PlacementResult) -> Placement:
    assert result.placement is not None, result.describe()
    return result.placement


def nodes_of(placement: Placement) -> list[str]:
    return [s.node_id for s in placement.shards]


def add(usage: dict[str, NodeUsage], placement: Placement) -> None:
    """What the planner does with a placement it keeps."""
    for shard in placement.shards:
        usage[shard.node_id] = usage.get(shard.node_id, NodeUsage()).plus(
            shard.gpus, placement.ports_on(shard.node_id))


# --- node selector -----------------------------------------------------------------------------

EU = Selector(labels=(("zone", "eu-west"),))
EU_PROD = Selector(labels=(("tier", "prod"), ("zone", "eu-west")))


@pytest.mark.parametrize(
    ("node", "selector", "refusal"),
    [
        (labelled(h100_8x80g("node01"), zone="eu-west"), EU, None),
        (labelled(h100_8x80g("node01"), zone="eu-west", rack="r7"), EU, None),
        (labelled(h100_8x80g("node01"), zone="eu-west", tier="prod"), EU_PROD, None),
        (labelled(h100_8x80g("node01"), zone="us-east"), EU,
         "does not match the selector zone=eu-west (has zone=us-east)"),
        (h100_8x80g("node01"), EU, "does not match the selector zone=eu-west (has no zone label)"),
        (labelled(h100_8x80g("node01"), zone="eu-west", tier="dev"), EU_PROD,
         "does not match the selector tier=prod (has tier=dev)"),
        (labelled(h100_8x80g("node01"), zone="eu-west"), EU_PROD,
         "does not match the selector tier=prod (has no tier label)"),
        (h100_8x80g("node01"), Selector(gpu_class="H100"), None),
        (h100_8x80g("node01"), Selector(gpu_class="h100"), None),
        (h100_8x80g("node01"), Selector(gpu_class="80GB HBM3"), None),
        (rtx4090_2x24g("ws1"), Selector(gpu_class="RTX 4090"), None),
        (rtx4090_2x24g("ws1"), Selector(gpu_class="H100"), "has no H100 GPU"),
        (h100_8x80g("node01"), Selector(gpu_class="a100"), "has no a100 GPU"),
        (cpu_avx2("cpu1"), Selector(gpu_class="H100"), "has no H100 GPU"),
        (labelled(h100_8x80g("node01"), zone="eu-west"),
         Selector(EU.labels, gpu_class="H100"), None),
        (labelled(rtx4090_2x24g("ws1"), zone="eu-west"),
         Selector(EU.labels, gpu_class="H100"), "has no H100 GPU"),
        (rtx4090_2x24g("ws1"), Selector(EU.labels, gpu_class="H100"),
         "does not match the selector zone=eu-west (has no zone label)"),
    ],
    ids=[
        "label-match", "label-match-extra-labels", "two-labels-match", "label-differs",
        "label-missing", "second-label-differs", "second-label-missing", "class-exact",
        "class-lowercase", "class-substring", "class-4090", "class-h100-on-4090",
        "class-a100-on-h100", "class-on-cpu-only", "labels-and-class", "labels-not-class",
        "labels-checked-first",
    ],
)
def test_node_selector(node: Node, selector: Selector, refusal: str | None) -> None:
    m = model("m", TP1, selector=selector)

    result = place_model(m, [node], {})

    if refusal is None:
        assert nodes_of(placed(result)) == [node.id]
    else:
        assert result.refusals == (Refusal(node.id, refusal),)


def test_selector_wins_over_binpack_and_its_refusals_reach_unplaced() -> None:
    eu = labelled(h100_8x80g("node01"), zone="eu-west")
    us = labelled(h100_8x80g("node02"), zone="us-east")
    # Binpack alone would pick node02, the fuller one.
    usage_us = running("other-e1", ("node02", (0, 1, 2, 3, 4, 5), 20000), model="other")
    declared = catalog(model("m", TP1, replicas=9, selector=EU), model("other", TP1))

    result = plan(declared, [eu, us], [usage_us], {}, NOW)

    assert {nodes_of(a.placement)[0] for a in of_type(result, Place)} == {"node01"}
    assert len(of_type(result, Place)) == 8
    assert result.unplaced == {
        "m": "node02: does not match the selector zone=eu-west (has zone=us-east); "
             "node01: needs 1 GPU, has 0"
    }


# --- disabled engines --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("node", "prof", "refusal"),
    [
        (disabling(h100_8x80g("node01"), "vllm"), TP1, "vllm is disabled on this node"),
        (disabling(cpu_avx2("cpu1"), "sim"), SIM, "sim is disabled on this node"),
        # Disabled is said before "not installed": it is what the operator must change.
        (disabling(cpu_avx2("cpu1"), "vllm"), TP1, "vllm is disabled on this node"),
        (disabling(h100_8x80g("node01"), "llama.cpp", "sglang"), TP1, None),
        (disabling(cpu_avx2("cpu1"), "vllm"), CPU, None),
    ],
    ids=["vllm", "builtin-sim", "disabled-and-missing", "others-disabled", "cpu-engine-ok"],
)
def test_disabled_engine(node: Node, prof: Profile, refusal: str | None) -> None:
    result = place_model(model("m", prof), [node], {})

    if refusal is None:
        assert nodes_of(placed(result)) == [node.id]
    else:
        assert result.refusals == (Refusal(node.id, refusal),)


def test_a_disabled_engine_sends_the_replica_to_another_node() -> None:
    nodes = [disabling(h100_8x80g("node01"), "vllm"), h100_8x80g("node02")]

    result = plan(catalog(model()), nodes, [], {}, NOW)

    [action] = of_type(result, Place)
    assert nodes_of(action.placement) == ["node02"]


# --- CPUs without AVX2 -------------------------------------------------------------------------


def _unknown_flags(node: Node) -> Node:
    return replace(node, cpu_flags=frozenset())


def _h100_without_avx2(node_id: str) -> Node:
    return replace(h100_8x80g(node_id), cpu_flags=cpu_only_no_avx2("x").cpu_flags)


@pytest.mark.parametrize(
    ("node", "prof", "warnings", "refusal"),
    [
        (cpu_only_no_avx2("old1"), CPU, (NO_AVX2_WARNING,), None),
        (cpu_only_no_avx2("old1"), SIM, (NO_AVX2_WARNING,), None),
        (cpu_only_no_avx2("old1"), CPU_AVX2, None,
         "its CPU has no AVX2, which this profile requires"),
        (cpu_avx2("cpu1"), CPU, (), None),
        (cpu_avx2("cpu1"), CPU_AVX2, (), None),
        (graviton3("arm1"), CPU, (), None),
        (raspberry_pi_32bit("pi1"), CPU, (), None),
        # Arm's SIMD is what llama.cpp uses there: the requirement is about slow x86 CPUs.
        (graviton3("arm1"), CPU_AVX2, (), None),
        # A node that reported no flags at all is not called slow.
        (_unknown_flags(cpu_only_no_avx2("old1")), CPU_AVX2, (), None),
        # A GPU profile does not care what the CPU can do.
        (_h100_without_avx2("node01"), TP1, (), None),
    ],
    ids=["warns", "warns-for-sim", "required", "avx2", "avx2-required", "arm-asimd",
         "arm-neon", "arm-required", "no-flags-reported", "gpu-profile"],
)
def test_cpu_without_avx2(node: Node, prof: Profile, warnings: tuple[str, ...] | None,
                          refusal: str | None) -> None:
    result = place_model(model("m", prof), [node], {})

    if refusal is not None:
        assert result.refusals == (Refusal(node.id, refusal),)
        return
    placement = placed(result)
    assert placement.warnings == warnings
    assert placement.describe() == f"placed on {node.id}" + "".join(
        f"; warning: {w}" for w in warnings)


def test_the_warning_travels_with_the_place_action_into_the_replica() -> None:
    result = plan(catalog(model("m", CPU)), [cpu_only_no_avx2("old1")], [], {}, NOW)

    [action] = of_type(result, Place)
    assert action.placement.warnings == (NO_AVX2_WARNING,)
    assert new_replica("m-e1", action.placement, 1, NOW).reason == (
        f"placed on old1; warning: {NO_AVX2_WARNING}")


def test_a_multi_node_cpu_replica_warns_once_per_slow_node() -> None:
    nodes = [replace(cpu_only_no_avx2(n), fabric="eth-a") for n in ("old1", "old2")]
    nodes.append(replace(cpu_avx2("cpu3"), fabric="eth-b"))

    placement = placed(place_model(model("m", SIM_PAIR), nodes, {}))

    assert nodes_of(placement) == ["old1", "old2"]
    assert placement.warnings == (
        NO_AVX2_WARNING, NO_AVX2_WARNING.replace("old1", "old2"))


def test_avx2_nodes_are_not_preferred_over_slow_ones() -> None:
    # A warning, not a rank: binpack still fills the fuller node, slow or not.
    nodes = [cpu_avx2("cpu1"), cpu_only_no_avx2("old1")]
    usage = {"old1": NodeUsage(ports=frozenset({20000}), shards=1)}

    assert nodes_of(placed(place_model(model("m", CPU), nodes, usage))) == ["old1"]


# --- weights locality --------------------------------------------------------------------------

PARTLY = NodeUsage(gpus=frozenset(range(6)), ports=frozenset({20000}), shards=1)


@pytest.mark.parametrize(
    ("nodes", "usage", "strategy", "chosen"),
    [
        # Binpack alone picks the fuller node02; the weights on node01 win.
        ([holding(h100_8x80g("node01"), "m"), h100_8x80g("node02")], {"node02": PARTLY},
         "binpack", "node01"),
        # Spread alone picks the emptier node01; the weights on node02 win.
        ([h100_8x80g("node01"), holding(h100_8x80g("node02"), "m")], {"node02": PARTLY},
         "spread", "node02"),
        # Another model's weights are no reason.
        ([holding(h100_8x80g("node01"), "other"), h100_8x80g("node02")], {"node02": PARTLY},
         "binpack", "node02"),
        # Among several holders, binpack decides.
        ([holding(h100_8x80g(n), "m") for n in ("node01", "node02", "node03")],
         {"node03": PARTLY}, "binpack", "node03"),
        # A preference, never a filter: a full holder leaves the replica to a node that
        # must fetch the weights.
        ([holding(h100_8x80g("node01"), "m"), h100_8x80g("node02")], {"node01": FULL},
         "binpack", "node02"),
        ([holding(h100_8x80g("node01", state=NodeState.DRAINING), "m"), h100_8x80g("node02")],
         {}, "binpack", "node02"),
        ([holding(disabling(h100_8x80g("node01"), "vllm"), "m"), h100_8x80g("node02")],
         {}, "binpack", "node02"),
        ([holding(rtx4090_2x24g("ws1"), "m"), h100_8x80g("node02")], {"ws1": NodeUsage(
            gpus=frozenset({0, 1}))}, "binpack", "node02"),
    ],
    ids=["over-binpack", "over-spread", "other-model", "binpack-among-holders", "holder-full",
         "holder-draining", "holder-engine-disabled", "holder-4090-full"],
)
def test_a_node_holding_the_weights_is_preferred(
    nodes: list[Node], usage: dict[str, NodeUsage], strategy: str, chosen: str
) -> None:
    result = place_model(model("m", TP1), nodes, usage, strategy)

    assert nodes_of(placed(result)) == [chosen]


def test_more_replicas_than_the_holder_takes_spill_onto_other_nodes() -> None:
    nodes = [h100_8x80g("node01"), holding(h100_8x80g("node02"), "m")]

    placements, _ = place_replicas(model("m", TP4), nodes, {}, "binpack", 3)

    assert [nodes_of(p) for p in placements] == [["node02"], ["node02"], ["node01"]]


def _fabrics(weights_on: tuple[str, ...] = ()) -> list[Node]:
    return [holding(n, "m") if n.id in weights_on else n for n in two_fabrics_of_four()]


@pytest.mark.parametrize(
    ("weights_on", "usage", "fabric", "chosen"),
    [
        ((), {}, "ib-a", ["node01", "node02"]),
        (("node07",), {}, "ib-b", ["node07", "node05"]),
        (("node06", "node08"), {}, "ib-b", ["node06", "node08"]),
        # Binpack would fill ib-a's partly used node03; the weights in ib-b win.
        (("node05",), {"node03": NodeUsage(gpus=frozenset({0, 1, 2, 3}), shards=1)}, "ib-b",
         ["node05", "node06"]),
        # A preference, never a filter: ib-b holds the weights but has one node free.
        (("node05",), {"node06": FULL, "node07": FULL, "node08": FULL}, "ib-a",
         ["node01", "node02"]),
    ],
    ids=["no-weights", "one-holder", "two-holders", "over-binpack", "holder-fabric-full"],
)
def test_a_fabric_holding_the_weights_is_preferred(
    weights_on: tuple[str, ...], usage: dict[str, NodeUsage], fabric: str, chosen: list[str]
) -> None:
    placement = placed(place_model(model("m", PAIR), _fabrics(weights_on), usage))

    assert placement.fabric == fabric
    assert nodes_of(placement) == chosen


def test_a_full_node_still_makes_its_fabric_hold_the_weights() -> None:
    # The first replica runs on node05+node06, which now hold the weights and are full;
    # ib-b still has node07 and node08 free.
    usage = {"node05": FULL, "node06": FULL}

    placement = placed(place_model(model("m", PAIR), _fabrics(("node05", "node06")), usage))

    assert placement.fabric == "ib-b"
    assert nodes_of(placement) == ["node07", "node08"]


# --- several replicas in one call --------------------------------------------------------------


def _one_at_a_time(m: Model, nodes: list[Node], usage: dict[str, NodeUsage], strategy: str,
                   count: int) -> list[Placement]:
    usage = dict(usage)
    out: list[Placement] = []
    for _ in range(count):
        result = place_model(m, nodes, usage, strategy)
        if result.placement is None:
            break
        out.append(result.placement)
        add(usage, result.placement)
    return out


_BOTH_ENGINES = (VLLM, LLAMA)

BATCHES = {
    "tp1-fills-two-nodes": (model("m", TP1), [h100_8x80g("node01"), h100_8x80g("node02")],
                            {"node02": PARTLY}, "binpack", 16),
    "tp1-spread": (model("m", TP1), [h100_8x80g(f"node0{i}") for i in range(1, 4)],
                   {"node02": PARTLY}, "spread", 7),
    "tp2-weights": (model("m", TP2), [h100_8x80g("node01"), holding(h100_8x80g("node02"), "m")],
                    {"node01": PARTLY}, "binpack", 6),
    "more-than-fits": (model("m", TP4), [h100_8x80g("node01"), rtx4090_2x24g("ws1")], {},
                       "binpack", 5),
    "profile-fallback": (
        model("m", TP8, CPU),
        [h100_8x80g("node01", engines=_BOTH_ENGINES), cpu_avx2("cpu1"),
         cpu_only_no_avx2("old1")],
        {}, "binpack", 5),
    "few-ports": (model("m", TP1), [h100_8x80g("node01", port_range=(30000, 30002)),
                                    h100_8x80g("node02")], {}, "binpack", 12),
    "busy-ports": (model("m", TP1), [replace(h100_8x80g("node01"),
                                             ports_busy=frozenset({20000, 20002}))],
                   {}, "binpack", 4),
    "multi-node": (model("m", PAIR), _fabrics(("node06",)), {"node01": FULL}, "binpack", 4),
    "multi-node-sim": (model("m", SIM_PAIR), two_fabrics_of_four(), {}, "spread", 6),
    "selector": (model("m", TP1, selector=Selector(gpu_class="4090")),
                 [h100_8x80g("node01"), rtx4090_2x24g("ws1"), rtx4090_2x24g("ws2")], {},
                 "binpack", 5),
}


@pytest.mark.parametrize("case", list(BATCHES))
def test_place_replicas_equals_placing_one_at_a_time(case: str) -> None:
    m, nodes, usage, strategy, count = BATCHES[case]

    batch, refusals = place_replicas(m, nodes, usage, strategy, count)

    assert batch == _one_at_a_time(m, nodes, usage, strategy, count)
    assert batch, "every case places something"
    held: Counter[tuple[str, object]] = Counter()
    for placement in batch:
        for shard in placement.shards:
            held.update([(shard.node_id, f"gpu{g}") for g in shard.gpus])
            held[(shard.node_id, shard.port)] += 1
        if placement.rendezvous_port is not None:
            held[(placement.shards[0].node_id, placement.rendezvous_port)] += 1
    for node_id, usage_now in usage.items():
        held.update([(node_id, f"gpu{g}") for g in usage_now.gpus])
        held.update([(node_id, p) for p in usage_now.ports])
    assert [k for k, n in held.items() if n > 1] == []
    if len(batch) < count:
        assert refusals, "what was not placed is explained"


def test_place_replicas_leaves_the_callers_usage_alone() -> None:
    usage = {"node01": PARTLY}

    place_replicas(model("m", TP1), [h100_8x80g("node01")], usage, "binpack", 2)

    assert usage == {"node01": PARTLY}


# --- priority and eviction ---------------------------------------------------------------------


def _tp1s(name: str, count: int, priority: int, node: str = "node01") -> tuple[Model, list]:
    """``count`` ready one-GPU replicas of ``name`` on ``node``, the later ones younger."""
    reps = [running(f"{name}-e{i}", (node, (i,), 20000 + i), model=name, created_at=float(i))
            for i in range(count)]
    return model(name, TP1, replicas=count, priority=priority), reps


def _tp4(name: str, gpus_from: int, priority: int, created_at: float = 0.0,
         node: str = "node01") -> tuple[Model, list]:
    gpus = tuple(range(gpus_from, gpus_from + 4))
    rep = running(f"{name}-e1", (node, gpus, 20000 + gpus_from), model=name, profile="tp4",
                  created_at=created_at)
    return model(name, TP4, priority=priority), [rep]


def _scenario(*parts: tuple[Model, list]) -> tuple[Catalog, list[Replica]]:
    return (catalog(*(m for m, _ in parts)), [r for _, reps in parts for r in reps])


EVICTIONS = {
    # id: (wanted model, what runs, nodes, evicted in order)
    "one-of-eight-suffices": (
        model("chat", TP1, priority=10), [_tp1s("batch", 8, 1)], [h100_8x80g("node01")],
        ["batch-e7"]),
    "lowest-priority-first": (
        model("top", TP4, priority=10),
        [_tp4("mid", 0, 5, created_at=50.0), _tp4("low", 4, 1, created_at=10.0)],
        [h100_8x80g("node01")], ["low-e1"]),
    "fewest-before-lowest": (
        # Four priority-1 replicas would do, but one priority-2 replica does too.
        model("top", TP4, priority=10), [_tp1s("low", 4, 1), _tp4("mid", 4, 2)],
        [h100_8x80g("node01")], ["mid-e1"]),
    "two-needed": (
        model("top", TP2, priority=10), [_tp1s("low", 8, 1)], [h100_8x80g("node01")],
        ["low-e7", "low-e6"]),
    "two-needed-on-one-node": (
        # One GPU freed on each node would not do: both victims come from one node.
        model("top", TP2, priority=10),
        [_tp1s("low", 8, 1), _tp1s("more", 8, 1, node="node02")],
        [h100_8x80g("node01"), h100_8x80g("node02")], ["low-e7", "low-e6"]),
}


@pytest.mark.parametrize("case", list(EVICTIONS))
def test_a_high_priority_model_evicts_the_fewest_lowest(case: str) -> None:
    wanted, parts, nodes, evicted = EVICTIONS[case]
    declared, reps = _scenario(*parts, (wanted, []))

    result = plan(declared, nodes, reps, {}, NOW)

    lower = {m.name: m.priority for m in declared.models}
    assert result.actions == tuple(
        Evict(r, f"evicted for {wanted.name} (priority {wanted.priority} over "
                 f"{lower[r.rsplit('-', 1)[0]]})") for r in evicted)
    assert result.unplaced[wanted.name] == "making room: " + ", ".join(evicted)
    # The victims' models say why they are short now; they do not evict in this pass.
    for victim_model in {r.rsplit("-", 1)[0] for r in evicted}:
        assert result.unplaced[victim_model].startswith("node")

    # Next pass, the victims are gone: the room they left is the wanted model's.
    left = [r for r in reps if r.id not in evicted]
    after = plan(declared, nodes, left, {}, NOW + 5)

    [action] = [a for a in of_type(after, Place) if a.placement.model == wanted.name]
    freed = {(s.node_id, g) for r in reps if r.id in evicted for s in r.shards for g in s.gpus}
    assert {(s.node_id, g) for s in action.placement.shards for g in s.gpus} <= freed
    assert not [e for e in of_type(after, Evict) if "for " + wanted.name in e.reason]
    assert wanted.name not in after.unplaced


NO_EVICTIONS = {
    # id: (wanted model, what runs, nodes, unplaced)
    "equal-priority": (
        model("top", TP4, priority=10), [_tp4("peer", 0, 10), _tp4("peer2", 4, 10)],
        [h100_8x80g("node01")], "node01: needs 4 GPUs, has 0"),
    "higher-priority": (
        model("top", TP4, priority=10), [_tp4("vip", 0, 20), _tp4("vip2", 4, 20)],
        [h100_8x80g("node01")], "node01: needs 4 GPUs, has 0"),
    "lower-only-off-the-selector": (
        model("top", TP4, priority=10, selector=Selector(gpu_class="H100")),
        [_tp4("peer", 0, 10), _tp4("peer2", 4, 10),
         (model("low", TP1, replicas=2, priority=1),
          [running(f"low-e{i}", ("ws1", (i,), 20000 + i), model="low") for i in range(2)])],
        [h100_8x80g("node01"), rtx4090_2x24g("ws1")],
        "node01: needs 4 GPUs, has 0; ws1: has no H100 GPU"),
    "lower-only-where-the-engine-is-missing": (
        model("top", TP1, priority=10), [_tp1s("peer", 8, 10),
                                          (model("low", SIM, priority=1),
                                           [running("low-e1", ("cpu1", (), 20000),
                                                    model="low", profile="sim")])],
        [h100_8x80g("node01"), cpu_avx2("cpu1")],
        "cpu1: vllm is not installed; node01: needs 1 GPU, has 0"),
    "evicting-all-lower-is-not-enough": (
        model("top", TP8, priority=10), [_tp4("peer", 0, 10), _tp4("low", 4, 1)],
        [h100_8x80g("node01")], "node01: needs 8 GPUs, has 0"),
}


def test_priority_zero_evicts_a_negative_priority_scavenger() -> None:
    declared, reps = _scenario(_tp1s("scavenger", 8, -5), (model("plain", TP1), []))

    result = plan(declared, [h100_8x80g("node01")], reps, {}, NOW)

    [evict] = of_type(result, Evict)
    assert evict.reason == "evicted for plain (priority 0 over -5)"


@pytest.mark.parametrize("case", list(NO_EVICTIONS))
def test_no_eviction(case: str) -> None:
    wanted, parts, nodes, why = NO_EVICTIONS[case]
    declared, reps = _scenario(*parts, (wanted, []))

    result = plan(declared, nodes, reps, {}, NOW)

    assert result.actions == ()
    assert result.unplaced == {wanted.name: why}


def test_eviction_counts_what_this_pass_already_placed() -> None:
    low, top, big = (model("low", TP4, priority=1), model("top", TP4, priority=10),
                     model("big", TP8, priority=5))
    running_low = running("low-e1", ("node01", (0, 1, 2, 3), 20000), model="low",
                          profile="tp4")

    result = plan(catalog(low, top, big), [h100_8x80g("node01")], [running_low], {}, NOW)

    assert [nodes_of(a.placement) for a in of_type(result, Place)] == [["node01"]]
    assert of_type(result, Evict) == []
    assert result.unplaced == {"big": "node01: needs 8 GPUs, has 0"}


@pytest.mark.parametrize("load", [{}, {"low-e2": 5}], ids=["same-victim", "second-victim"])
def test_an_evicted_replica_is_not_also_counted_by_its_own_model(load: dict[str, int]) -> None:
    # low wants one replica and runs two (it was just scaled down); top needs one's room.
    low = model("low", TP4, priority=1)
    top = model("top", TP4, priority=10)
    reps = [running("low-e1", ("node01", (0, 1, 2, 3), 20000), model="low", profile="tp4",
                    created_at=1.0),
            running("low-e2", ("node01", (4, 5, 6, 7), 20001), model="low", profile="tp4",
                    created_at=2.0)]

    result = plan(catalog(low, top), [h100_8x80g("node01")], reps, {}, NOW, load=load)

    acted = [a.replica for a in result.actions if not isinstance(a, Place)]
    assert len(acted) == 1, result.actions


# --- draining ----------------------------------------------------------------------------------


def test_a_drained_replica_serves_until_its_replacement_is_ready() -> None:
    draining = h100_8x80g("node01", state=NodeState.DRAINING)
    other = h100_8x80g("node02")
    old = running("m-e1", ("node01", (0,), 20000))
    declared = catalog(model())

    alone = plan(declared, [draining], [old], {}, NOW)
    moving = plan(declared, [draining, other], [old], {}, NOW)
    new = running("m-e2", ("node02", (0,), 20000), state=ReplicaState.STARTING, created_at=NOW)
    starting = plan(declared, [draining, other], [old, new], {}, NOW + 10)
    ready = plan(declared, [draining, other], [old, replace(
        new, state=ReplicaState.READY, ready_since=NOW + 20,
        shards=tuple(replace(s, state="ready") for s in new.shards))], {}, NOW + 20)

    assert alone == Plan((), {"m": "node01: not ready (draining)"},
                         {"m": (Refusal("node01", "not ready (draining)"),)}), "nowhere to go"
    assert alone.refusals["m"][0].kind == "node_state"
    [place_] = of_type(moving, Place)
    assert nodes_of(place_.placement) == ["node02"]
    assert of_type(moving, Stop) == []
    assert starting == Plan((), {}), "the replacement is not serving yet"
    assert ready == Plan((Stop("m-e1", "node node01 is draining"),), {})


def test_draining_one_of_two_replaces_it_and_keeps_both_until_then() -> None:
    nodes = [h100_8x80g("node01", state=NodeState.DRAINING), h100_8x80g("node02")]
    reps = [running("m-e1", ("node01", (0,), 20000)), running("m-e2", ("node02", (0,), 20000))]

    result = plan(catalog(model(replicas=2)), nodes, reps, {}, NOW)

    [place_] = of_type(result, Place)
    assert [(s.node_id, s.gpus) for s in place_.placement.shards] == [("node02", (1,))]
    assert of_type(result, Stop) == []


def test_a_multi_node_replica_with_one_shard_draining_moves_as_a_whole() -> None:
    nodes = _fabrics()
    nodes[0] = replace(nodes[0], state=NodeState.DRAINING)
    pair = running("m-e1", ("node01", tuple(range(8)), 20000),
                   ("node02", tuple(range(8)), 20000), profile="pair", rendezvous_port=20001)
    declared = catalog(model("m", PAIR))

    moving = plan(declared, nodes, [pair], {}, NOW)
    new = running("m-e2", ("node03", tuple(range(8)), 20000),
                  ("node04", tuple(range(8)), 20000), profile="pair", rendezvous_port=20001)
    done = plan(declared, nodes, [pair, new], {}, NOW)

    [place_] = of_type(moving, Place)
    assert nodes_of(place_.placement) == ["node03", "node04"], "node02 is still taken"
    assert done == Plan((Stop("m-e1", "node node01 is draining"),), {})


# --- scale-down order --------------------------------------------------------------------------

R, S = ReplicaState.READY, ReplicaState.STARTING


@pytest.mark.parametrize(
    ("have", "keep", "load", "stopped"),
    [
        # (id, state, created_at)
        ([("m-e1", R, 10), ("m-e2", S, 5)], 1, {"m-e2": 9}, ["m-e2"]),
        ([("m-e1", R, 10), ("m-e2", R, 10)], 1, {"m-e1": 3, "m-e2": 1}, ["m-e2"]),
        ([("m-e1", R, 10), ("m-e2", R, 20)], 1, {"m-e1": 0, "m-e2": 5}, ["m-e1"]),
        ([("m-e1", R, 10), ("m-e2", R, 20)], 1, {"m-e1": 2, "m-e2": 2}, ["m-e2"]),
        ([("m-e1", R, 10), ("m-e2", R, 20)], 1, None, ["m-e2"]),
        ([("m-e1", R, 10), ("m-e2", R, 20), ("m-e3", S, 30), ("m-e4", R, 40)], 1,
         {"m-e1": 4, "m-e2": 1, "m-e3": 7, "m-e4": 1}, ["m-e3", "m-e4", "m-e2"]),
        ([("m-e1", S, 10), ("m-e2", S, 20)], 1, {"m-e1": 0, "m-e2": 3}, ["m-e1"]),
        ([("m-e1", R, 10), ("m-e2", R, 20)], 0, {"m-e1": 9}, ["m-e2", "m-e1"]),
    ],
    ids=["not-ready-first-whatever-its-load", "fewest-in-flight", "load-beats-age",
         "youngest-on-equal-load", "no-load-youngest", "four-to-one", "both-starting",
         "to-zero"],
)
def test_scale_down_order(have: list[tuple[str, ReplicaState, float]], keep: int,
                          load: dict[str, int] | None, stopped: list[str]) -> None:
    reps = [running(rid, ("node01", (i,), 20000 + i), state=state, created_at=NOW - 100 + created)
            for i, (rid, state, created) in enumerate(have)]

    result = plan(catalog(model(replicas=keep)), [h100_8x80g("node01")], reps, {}, NOW,
                  load=load)

    assert result.actions == tuple(Stop(r, f"scaled down to {keep}") for r in stopped)


# --- held room ---------------------------------------------------------------------------------


def _stopping(rep: Replica) -> Replica:
    return replace(rep, state=ReplicaState.STOPPED)


@pytest.mark.parametrize(
    ("held", "prof", "nodes", "free_gpus", "free_ports"),
    [
        ([_stopping(running("old-e1", ("node01", (0, 1), 20000), model="old"))], TP1,
         [h100_8x80g("node01")], {("node01", 2)}, {("node01", 20001)}),
        # A held replica of the very model being placed is not counted as one of its own.
        ([_stopping(running("m-e1", ("node01", (0,), 20000)))], TP1,
         [h100_8x80g("node01")], {("node01", 1)}, {("node01", 20001)}),
        # Its shards still say ready: held is what the controller says, not the state.
        ([running("old-e1", ("node01", (0,), 20000), model="old")], TP1,
         [h100_8x80g("node01")], {("node01", 1)}, {("node01", 20001)}),
        # The leader's rendezvous port is held too.
        ([_stopping(running("p-e1", ("node01", (), 20000), ("node02", (), 20000),
                            model="p", profile="pair", rendezvous_port=20001))],
         SIM_PAIR, two_fabrics_of_four()[:2], set(),
         {("node01", 20002), ("node01", 20003), ("node02", 20001)}),
    ],
    ids=["other-model", "same-model", "shards-still-ready", "rendezvous-port"],
)
def test_held_replicas_keep_their_gpus_and_ports(
    held: list[Replica], prof: Profile, nodes: list[Node], free_gpus: set, free_ports: set
) -> None:
    result = plan(catalog(model("m", prof)), nodes, [], {}, NOW, held=held)

    [action] = result.actions
    placement = action.placement
    assert {(s.node_id, g) for s in placement.shards for g in s.gpus} == free_gpus
    ports = {(s.node_id, s.port) for s in placement.shards}
    if placement.rendezvous_port is not None:
        ports.add((placement.shards[0].node_id, placement.rendezvous_port))
    assert ports == free_ports


def test_held_room_on_a_full_node_leaves_the_model_waiting_for_it() -> None:
    held = [_stopping(running("old-e1", ("node01", tuple(range(8)), 20000), model="old"))]

    result = plan(catalog(model()), [h100_8x80g("node01")], [], {}, NOW, held=held)

    # Nothing is placed onto room still held, and the reason says what it waits for.
    assert result == Plan((), {"m": "waiting for old-e1 to stop"})


def _live_failed_pair() -> Replica:
    """Rank 1 exited, rank 0 still runs and holds node01's GPUs until it is told to stop."""
    pair = running("a-e1", ("node01", tuple(range(8)), 20000), ("node02", tuple(range(8)), 20000),
                   model="a", profile="pair", rendezvous_port=20001)
    shards = (pair.shards[0], replace(pair.shards[1], state="failed"))
    return replace(pair, shards=shards, state=ReplicaState.FAILED, reason="rank 1 failed")


@pytest.mark.parametrize(
    ("going", "declared"),
    [
        (running("old-e1", ("node01", tuple(range(8)), 20000), model="old", profile="tp8"),
         catalog(model("m", TP8))),
        (running("a-e1", ("node01", tuple(range(8)), 20000), model="a", profile="tp8",
                 state=ReplicaState.STARTING, created_at=NOW - 700),
         catalog(model("a", TP8), model("m", TP8))),
        (_live_failed_pair(), catalog(model("a", PAIR), model("m", TP8))),
    ],
    ids=["stopped-undeclared", "reaped-startup-timeout", "reaped-rank-0-still-running"],
)
def test_a_replica_stopped_this_pass_keeps_its_room_until_the_next(
    going: Replica, declared: Catalog
) -> None:
    nodes = [h100_8x80g("node01", "ib-a"), h100_8x80g("node02", "ib-a")]

    result = plan(declared, nodes, [going], {}, NOW)

    assert [a.replica for a in result.actions if isinstance(a, Stop | Reap)] == [going.id]
    still_running = {(s.node_id, g) for s in going.shards if s.state not in ("failed", "stopped")
                     for g in s.gpus}
    taken = {(s.node_id, g) for a in of_type(result, Place) for s in a.placement.shards
             for g in s.gpus}
    assert taken & still_running == set()


# --- lost nodes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("node02", "actions"),
    [
        (h100_8x80g("node02", state=NodeState.LOST),
         [Reap("m-e1", "node node02 is lost", crashed=False)]),
        (None, [Reap("m-e1", "node node02 is lost", crashed=False)]),
        (h100_8x80g("node02", state=NodeState.UNREACHABLE), []),
        (h100_8x80g("node02", state=NodeState.REGISTERING), []),
    ],
    ids=["lost", "forgotten", "unreachable-keeps-serving", "registering-keeps-serving"],
)
def test_a_lost_node_reaps_its_replicas(node02: Node | None, actions: list) -> None:
    nodes = [h100_8x80g("node01")] + ([node02] if node02 else [])
    on_lost = running("m-e1", ("node02", (0,), 20000))
    other = running("n-e1", ("node01", (0,), 20000), model="n")

    result = plan(catalog(model("m"), model("n")), nodes, [on_lost, other], {}, NOW)

    assert [a for a in result.actions if isinstance(a, Reap)] == actions
    # Moved, not crashed: placed again in the same pass, on the node that is left.
    placed = [a for a in result.actions if isinstance(a, Place)]
    assert [(p.placement.model, {s.node_id for s in p.placement.shards}) for p in placed] == (
        [("m", {"node01"})] if actions else [])
    assert result.unplaced == {}


# --- partition heal and control-plane restart --------------------------------------------------


def _adopted(epoch: int, node: str, state: str, now: float, world_size: int = 1,
             rank: int = 0, replica: Replica | None = None, profile: str = "tp1") -> Replica:
    shard = Shard(rank, node, address_of(node), 20000, (0,) if profile == "tp1" else (), state)
    return adopt(replica, replica_id=f"m-e{epoch}", model="m", profile=profile, epoch=epoch,
                 world_size=world_size, shard=shard, now=now)


@pytest.mark.parametrize(
    ("old_state", "new_state", "load", "stopped"),
    [
        ("ready", "starting", {}, "m-e7"),
        ("starting", "ready", {}, "m-e3"),
        ("ready", "ready", {"m-e3": 4, "m-e7": 0}, "m-e7"),
        ("ready", "ready", {"m-e3": 0, "m-e7": 4}, "m-e3"),
        # Equal load: the youngest goes, and an adopted replica is as young as its adoption.
        ("ready", "ready", {}, "m-e3"),
    ],
    ids=["old-ready", "new-ready", "old-busier", "new-busier", "equal-load"],
)
def test_a_healed_partition_leaves_exactly_one_copy(
    old_state: str, new_state: str, load: dict[str, int], stopped: str
) -> None:
    # node02 was cut off, its replica (epoch 3) re-placed on node01 (epoch 7); node02 came
    # back with it still running, and the controller adopted it.
    new = _adopted(7, "node01", new_state, NOW - 300)
    old = _adopted(3, "node02", old_state, NOW)
    assert old.reason == "adopted from running shards" and old.epoch < new.epoch

    result = plan(catalog(model()), [h100_8x80g("node01"), h100_8x80g("node02")],
                  [old, new], {}, NOW + 1, load=load)

    assert result == Plan((Stop(stopped, "scaled down to 1"),), {})


@pytest.mark.parametrize(
    ("after", "reaped"),
    [(0.0, False), (29.9, False), (30.0, True), (600.0, True)],
    ids=["at-adoption", "within-grace", "grace-ends", "long-after"],
)
def test_an_adopted_replica_missing_a_rank_is_reaped_after_the_grace(
    after: float, reaped: bool
) -> None:
    half = _adopted(5, "node01", "ready", NOW, world_size=2, profile="pair")
    assert half.state is ReplicaState.STARTING and half.missing_ranks() == [1]
    nodes = two_fabrics_of_four()[:2]
    declared = catalog(model("m", SIM_PAIR))

    result = plan(declared, nodes, [half], {}, NOW + after, Policy(adoption_grace_s=30.0))

    if reaped:
        assert result.actions == (Reap("m-e5", "rank 1 of 2 never reported; "
                                              "a replica short of a shard cannot serve"),)
        assert result.unplaced == {"m": "a replica just failed; restarting after the backoff"}
    else:
        assert result == Plan((), {}), "counted as the model's replica while it may complete"


def test_an_adopted_replica_whose_missing_rank_reports_in_time_is_kept() -> None:
    half = _adopted(5, "node01", "ready", NOW, world_size=2, profile="pair")
    whole = _adopted(5, "node02", "ready", NOW + 10, world_size=2, rank=1, replica=half,
                     profile="pair")
    assert whole.state is ReplicaState.READY

    result = plan(catalog(model("m", SIM_PAIR)), two_fabrics_of_four()[:2], [whole], {},
                  NOW + 600, Policy(adoption_grace_s=30.0))

    assert result == Plan((), {})


def test_place_with_one_profile_prefers_the_weights_too() -> None:
    # place() is the one-profile form; the weights rule applies to it as well.
    nodes = [h100_8x80g("node01"), holding(h100_8x80g("node02"), "m")]

    result = place(model("m", TP1), TP1, nodes, {"node01": PARTLY})

    assert nodes_of(placed(result)) == ["node02"]
