"""Properties of planning over random clusters and demands.

Each example plans, applies the plan as the controller would (every Place becomes a replica
whose shards all report ready), and checks what must hold whatever the cluster looks like:
no GPU or port is given twice, no replica spans two fabrics, a ready replica is whole, and
planning again over the result asks for nothing more.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.core import engine_names
from llmgw.core.catalog import Catalog, Model, Profile
from llmgw.core.inventory import EngineStatus, Gpu, Node, NodeState
from llmgw.core.names import replica_id
from llmgw.core.reconcile import Place, Plan, Reap, Stop, plan
from llmgw.core.replicas import Replica, ReplicaState, apply_status, new_replica

FABRICS = (None, "ib-a", "ib-b", "ib-c")
# The engines a node installs that a profile may spread over GPUs and nodes.
ENGINES = tuple(e for e in engine_names.INSTALLABLE if e not in engine_names.SINGLE_GPU)
GPU_MIB = (24564, 49140, 81559)

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# One draw per field, bit masks for the per-GPU and per-engine choices: generation, not
# planning, is what costs time here.
NODE_FIELDS = st.tuples(
    st.integers(0, 8),  # GPUs
    st.sampled_from(GPU_MIB),  # memory of each
    st.integers(0, 255),  # bit g set: GPU g has only half its memory free
    st.integers(0, 63),  # two bits per engine: present, installing
    st.integers(0, 3),  # which of the cluster's fabrics
    st.sampled_from((1, 2, 3, 5, 1000)),  # ports in the node's range
    st.integers(0, 6),  # 0: unreachable
)


@st.composite
def nodes(draw) -> list[Node]:
    fabrics = draw(st.lists(st.sampled_from(FABRICS), min_size=1, max_size=4, unique=True))
    fields = draw(st.lists(NODE_FIELDS, min_size=1, max_size=30))
    result = []
    for i, (gpu_count, total, halves, engine_bits, fabric, width, ready) in enumerate(fields):
        gpus = tuple(
            Gpu(g, "gpu", total, total // 2 if halves >> g & 1 else total - 512)
            for g in range(gpu_count)
        )
        engines = tuple(
            EngineStatus(name, state="installing" if engine_bits >> (2 * e + 1) & 1
                         else "installed")
            for e, name in enumerate(ENGINES)
            if engine_bits >> (2 * e) & 1
        )
        low = 20000 + 1000 * (i % 2)
        result.append(
            Node(
                id=f"n{i:02d}",
                address=f"10.0.{i}.1",
                state=NodeState.READY if ready else NodeState.UNREACHABLE,
                gpus=gpus,
                engines=engines,
                fabric=fabrics[fabric % len(fabrics)],
                port_range=(low, low + width - 1),
            )
        )
    return result


@st.composite
def profiles(draw, index: int) -> Profile:
    gpus = draw(st.sampled_from((0, 0, 1, 1, 2, 4, 8)))
    return Profile(
        name=f"p{index}",
        engine=draw(st.sampled_from((*engine_names.BUILTIN * 2, *ENGINES))),
        nodes=draw(st.integers(1, 3)),
        gpus=gpus,
        gpu_memory_mib=draw(st.sampled_from((0, 20480, 40960))) if gpus else 0,
    )


@st.composite
def catalogs(draw) -> Catalog:
    models = []
    for i in range(draw(st.integers(1, 6))):
        profs = tuple(draw(profiles(j)) for j in range(draw(st.integers(1, 2))))
        models.append(Model(f"org/model-{i}", profs, draw(st.integers(0, 4))))
    return Catalog(tuple(models))


def apply(result: Plan, replicas: dict[str, Replica], epoch: int, now: float) -> int:
    """Do what the controller does with a plan; every new shard comes up ready."""
    for action in result.actions:
        if isinstance(action, Reap | Stop):
            del replicas[action.replica]
            continue
        assert isinstance(action, Place)
        epoch += 1
        replica = new_replica(replica_id(action.placement.model, epoch), action.placement,
                              epoch, now)
        for shard in action.placement.shards:
            replica = apply_status(replica, rank=shard.rank, epoch=epoch, state="ready",
                                   now=now)
        replicas[replica.id] = replica
    return epoch


def check_invariants(catalog: Catalog, cluster: list[Node], replicas: list[Replica]) -> None:
    by_id = {n.id: n for n in cluster}
    gpus_held: Counter[tuple[str, int]] = Counter()
    ports_held: Counter[tuple[str, int]] = Counter()
    for replica in replicas:
        assert replica.live
        profile = catalog.get(replica.model).profile(replica.profile)
        assert replica.world_size == profile.nodes
        if replica.state is ReplicaState.READY:
            assert sorted(s.rank for s in replica.shards) == list(range(replica.world_size))
            assert replica.endpoint() == (replica.shards[0].address, replica.shards[0].port)
        node_ids = [s.node_id for s in replica.shards]
        assert len(set(node_ids)) == len(node_ids)
        if replica.world_size > 1:
            assert replica.fabric is not None
            assert {by_id[n].fabric for n in node_ids} == {replica.fabric}
            assert replica.rendezvous_port is not None
            ports_held[(replica.shards[0].node_id, replica.rendezvous_port)] += 1
        for shard in replica.shards:
            node = by_id[shard.node_id]
            assert node.state is NodeState.READY
            assert len(shard.gpus) == profile.gpus
            for g in shard.gpus:
                gpu = next(x for x in node.gpus if x.index == g)
                assert gpu.memory_free_mib >= profile.gpu_memory_mib
                gpus_held[(shard.node_id, g)] += 1
            ports_held[(shard.node_id, shard.port)] += 1
    for (node_id, port), _ in ports_held.items():
        low, high = by_id[node_id].port_range
        assert low <= port <= high
    assert [k for k, n in gpus_held.items() if n > 1] == []
    assert [k for k, n in ports_held.items() if n > 1] == []


@SETTINGS
@given(cluster=nodes(), catalog=catalogs())
def test_planning_twice_gives_nothing_twice_and_asks_for_nothing_more(
    cluster: list[Node], catalog: Catalog
) -> None:
    replicas: dict[str, Replica] = {}

    first = plan(catalog, cluster, [], {}, now=0.0)
    apply(first, replicas, 0, now=0.0)

    check_invariants(catalog, cluster, list(replicas.values()))
    counts = Counter(r.model for r in replicas.values())
    for model in catalog.models:
        assert counts[model.name] <= model.replicas
        if counts[model.name] < model.replicas:
            assert model.name in first.unplaced
    assert all(r.state is ReplicaState.READY for r in replicas.values())

    second = plan(catalog, cluster, list(replicas.values()), {}, now=1.0)

    # Nothing has changed, so nothing is to be done; what could not be placed still cannot.
    assert second.actions == ()
    assert second.unplaced.keys() == first.unplaced.keys()


@SETTINGS
@given(cluster=nodes(), catalog=catalogs(), data=st.data())
def test_losing_a_node_reaps_its_replicas_and_replaces_them_elsewhere(
    cluster: list[Node], catalog: Catalog, data: st.DataObject
) -> None:
    replicas: dict[str, Replica] = {}
    epoch = apply(plan(catalog, cluster, [], {}, now=0.0), replicas, 0, now=0.0)

    victim = data.draw(st.sampled_from([n.id for n in cluster]))
    cluster = [
        Node(n.id, n.address, NodeState.LOST, n.gpus, n.engines, fabric=n.fabric,
             port_range=n.port_range) if n.id == victim else n
        for n in cluster
    ]
    on_victim = {r.id for r in replicas.values() if victim in {s.node_id for s in r.shards}}

    third = plan(catalog, cluster, list(replicas.values()), {}, now=2.0)

    reaped = {a.replica for a in third.actions if isinstance(a, Reap)}
    assert reaped == on_victim
    assert all(a.reason == f"node {victim} is lost" for a in third.actions
               if isinstance(a, Reap))
    assert not [a for a in third.actions if isinstance(a, Stop)]
    apply(third, replicas, epoch, now=2.0)
    assert all(victim not in {s.node_id for s in r.shards} for r in replicas.values())
    check_invariants(catalog, cluster, list(replicas.values()))
