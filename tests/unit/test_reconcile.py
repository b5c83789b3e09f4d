"""The reconcile planner, by scenario: what it places, stops and reaps, and what it says."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw.core.catalog import Catalog, Model, Profile
from llmgw.core.inventory import NodeState
from llmgw.core.placement import NodeUsage
from llmgw.core.reconcile import (
    Backoff,
    Place,
    Plan,
    Policy,
    Reap,
    Stop,
    after_failure,
    plan,
    settle_backoffs,
    usage_of,
)
from llmgw.core.replicas import Replica, ReplicaState, Shard
from tests.unit.shapes import cpu_avx2, h100_8x80g, two_fabrics_of_four

VLLM_1 = Profile("tp1", "vllm", gpus=1, startup_timeout_s=60.0)
SIM_2 = Profile("pair", "sim", nodes=2)
NOW = 1000.0


def catalog(*models: Model) -> Catalog:
    return Catalog(tuple(models))


def model(name: str = "m", prof: Profile = VLLM_1, replicas: int = 1) -> Model:
    return Model(name, (prof,), replicas)


def replica(
    id: str,
    *shards: tuple[str, tuple[int, ...], int],
    model: str = "m",
    profile: str = "tp1",
    state: ReplicaState = ReplicaState.READY,
    created_at: float = 0.0,
    world_size: int | None = None,
    epoch: int = 1,
    shard_state: str | None = None,
    rendezvous_port: int | None = None,
) -> Replica:
    """A replica with one shard per (node, gpus, port), ranks in the order given."""
    if shard_state is None:
        shard_state = "ready" if state is ReplicaState.READY else "starting"
    return Replica(
        id=id,
        model=model,
        profile=profile,
        epoch=epoch,
        world_size=len(shards) if world_size is None else world_size,
        shards=tuple(
            Shard(rank, node, "10.0.0.1", port, gpus, shard_state)
            for rank, (node, gpus, port) in enumerate(shards)
        ),
        state=state,
        created_at=created_at,
        ready_since=created_at if state is ReplicaState.READY else None,
        rendezvous_port=rendezvous_port,
    )


def of_type(result: Plan, kind: type) -> list:
    return [a for a in result.actions if isinstance(a, kind)]


# --- placing ---------------------------------------------------------------------------------


def test_empty_cluster_says_no_nodes_have_registered() -> None:
    result = plan(catalog(model()), [], [], {}, NOW)

    assert result.actions == ()
    assert result.unplaced == {"m": "no nodes have registered"}


def test_one_node_gets_one_place() -> None:
    result = plan(catalog(model()), [h100_8x80g("node01")], [], {}, NOW)

    (action,) = result.actions
    assert isinstance(action, Place)
    assert action.placement.model == "m"
    assert action.placement.profile == "tp1"
    assert [(s.node_id, s.gpus, s.port) for s in action.placement.shards] == [
        ("node01", (0,), 20000)
    ]
    assert result.unplaced == {}


def test_two_wanted_are_placed_in_one_pass_on_distinct_gpus_and_ports() -> None:
    result = plan(catalog(model(replicas=2)), [h100_8x80g("node01")], [], {}, NOW)

    places = of_type(result, Place)
    assert len(places) == 2 == len(result.actions)
    shards = [p.placement.shards[0] for p in places]
    assert [s.gpus for s in shards] == [(0,), (1,)]
    assert [s.port for s in shards] == [20000, 20001]


def test_multi_node_replicas_in_one_pass_share_no_port_or_rendezvous() -> None:
    nodes = two_fabrics_of_four()[:2]

    result = plan(catalog(model(prof=SIM_2, replicas=2)), nodes, [], {}, NOW)

    places = [a.placement for a in of_type(result, Place)]
    assert len(places) == 2
    held = [(s.node_id, s.port) for p in places for s in p.shards]
    held += [(p.shards[0].node_id, p.rendezvous_port) for p in places]
    assert len(held) == len(set(held)) == 6


def test_existing_replicas_hold_their_gpus_and_ports() -> None:
    old = replica("m-e1", ("node01", (0,), 20000))

    result = plan(catalog(model(replicas=2)), [h100_8x80g("node01")], [old], {}, NOW)

    (action,) = result.actions
    assert isinstance(action, Place)
    assert action.placement.shards[0].gpus == (1,)
    assert action.placement.shards[0].port == 20001


def test_places_what_fits_and_says_why_not_the_rest() -> None:
    big = Model("big", (Profile("tp4", "vllm", gpus=4),), replicas=3)

    result = plan(catalog(big), [h100_8x80g("node01")], [], {}, NOW)

    assert len(of_type(result, Place)) == 2
    assert result.unplaced == {"big": "node01: needs 4 GPUs, has 0"}


def test_a_model_at_its_count_gets_nothing() -> None:
    ready = replica("m-e1", ("node01", (0,), 20000))

    result = plan(catalog(model()), [h100_8x80g("node01")], [ready], {}, NOW)

    assert result == Plan((), {})


# --- stopping --------------------------------------------------------------------------------


def test_surplus_stops_the_least_valuable_first() -> None:
    old_ready = replica("m-e1", ("node01", (0,), 20000), created_at=10)
    young_ready = replica("m-e3", ("node01", (1,), 20001), created_at=50)
    old_starting = replica(
        "m-e2", ("node01", (2,), 20002), state=ReplicaState.STARTING, created_at=NOW - 30
    )
    young_starting = replica(
        "m-e4", ("node01", (3,), 20003), state=ReplicaState.STARTING, created_at=NOW - 5
    )
    replicas = [old_ready, young_ready, old_starting, young_starting]

    result = plan(catalog(model(replicas=1)), [h100_8x80g("node01")], replicas, {}, NOW)

    assert result.actions == (
        Stop("m-e4", "scaled down to 1"),
        Stop("m-e2", "scaled down to 1"),
        Stop("m-e3", "scaled down to 1"),
    )


def test_scaled_to_zero_stops_all() -> None:
    replicas = [replica(f"m-e{i}", ("node01", (i,), 20000 + i)) for i in range(3)]

    result = plan(catalog(model(replicas=0)), [h100_8x80g("node01")], replicas, {}, NOW)

    assert sorted(a.replica for a in of_type(result, Stop)) == ["m-e0", "m-e1", "m-e2"]
    assert len(result.actions) == 3


@pytest.mark.parametrize(
    "declared",
    [
        Catalog(()),
        catalog(model("other")),
        catalog(Model("m", (Profile("other", "vllm", gpus=1),))),
    ],
    ids=["empty-catalog", "model-removed", "profile-removed"],
)
def test_replica_of_an_undeclared_model_or_profile_is_stopped(declared: Catalog) -> None:
    ready = replica("m-e1", ("node01", (0,), 20000))

    result = plan(declared, [h100_8x80g("node01")], [ready], {}, NOW)

    assert [a for a in result.actions if not isinstance(a, Place)] == [
        Stop("m-e1", "model m is no longer declared")
    ]


# --- reaping ---------------------------------------------------------------------------------


def test_failed_replica_is_reaped_with_its_reason() -> None:
    failed = replica(
        "m-e1", ("node01", (0,), 20000), state=ReplicaState.FAILED, shard_state="failed"
    )
    failed = replace(failed, reason="rank 0 on node01 failed: CUDA out of memory")

    result = plan(catalog(model()), [h100_8x80g("node01")], [failed], {}, NOW)

    assert of_type(result, Reap) == [
        Reap("m-e1", "rank 0 on node01 failed: CUDA out of memory")
    ]


def test_a_reaped_replica_is_not_replaced_in_the_same_pass() -> None:
    failed = replica(
        "m-e1", ("node01", (0,), 20000), state=ReplicaState.FAILED, shard_state="failed"
    )

    result = plan(catalog(model()), [h100_8x80g("node01")], [failed], {}, NOW)

    assert of_type(result, Reap) != []
    assert of_type(result, Place) == []


@pytest.mark.parametrize("nodes", ["lost", "gone"])
def test_shard_on_a_lost_node_is_reaped_naming_the_node(nodes: str) -> None:
    pair = replica(
        "m-e1", ("node01", (), 20000), ("node02", (), 20000), profile="pair", rendezvous_port=20001
    )
    cluster = [h100_8x80g("node01", "ib-a")]
    if nodes == "lost":
        cluster.append(h100_8x80g("node02", "ib-a", state=NodeState.LOST))

    result = plan(catalog(model(prof=SIM_2)), cluster, [pair], {}, NOW)

    assert of_type(result, Reap) == [Reap("m-e1", "node node02 is lost", crashed=False)]


def test_a_replica_off_a_lost_node_is_placed_again_at_once_without_a_backoff() -> None:
    # Node loss is not an engine crash: no failure counted, no pass waited, and a backoff
    # the model has from earlier crashes is not made longer.
    moved = replica("m-e1", ("node02", (0,), 20000))
    cluster = [h100_8x80g("node01"), h100_8x80g("node02", state=NodeState.LOST)]

    result = plan(catalog(model()), cluster, [moved], {}, NOW)

    assert of_type(result, Reap) == [Reap("m-e1", "node node02 is lost", crashed=False)]
    [place] = of_type(result, Place)
    assert {s.node_id for s in place.placement.shards} == {"node01"}


def test_a_replica_on_an_unreachable_node_is_left_alone() -> None:
    ready = replica("m-e1", ("node01", (0,), 20000))
    node = h100_8x80g("node01", state=NodeState.UNREACHABLE)

    result = plan(catalog(model()), [node], [ready], {}, NOW)

    assert result.actions == ()
    assert result.unplaced == {}


def test_a_replica_on_a_draining_node_serves_until_a_replacement_does() -> None:
    ready = replica("m-e1", ("node01", (0,), 20000))
    draining = h100_8x80g("node01", state=NodeState.DRAINING)

    alone = plan(catalog(model()), [draining], [ready], {}, NOW)
    assert alone.actions == (), "nowhere else to go: it keeps serving"
    assert alone.unplaced == {"m": "node01: not ready (draining)"}

    moved = plan(catalog(model()), [draining, h100_8x80g("node02")], [ready], {}, NOW)
    [place] = of_type(moved, Place)
    assert place.placement.shards[0].node_id == "node02"
    assert of_type(moved, Stop) == [], "not stopped before its replacement is ready"

    replacement = replica("m-e2", ("node02", (0,), 20000))
    done = plan(catalog(model()), [draining, h100_8x80g("node02")], [ready, replacement], {},
                NOW)
    assert of_type(done, Stop) == [Stop("m-e1", "node node01 is draining")]
    assert of_type(done, Place) == []


def test_adopted_replica_missing_a_rank_is_reaped_after_the_grace_period() -> None:
    policy = Policy(adoption_grace_s=30.0)
    half = replica(
        "m-e7",
        ("node01", (), 20000),
        profile="pair",
        world_size=2,
        state=ReplicaState.STARTING,
        shard_state="ready",
        created_at=NOW,
    )
    nodes = two_fabrics_of_four()[:2]
    declared = catalog(model(prof=SIM_2))

    before = plan(declared, nodes, [half], {}, NOW + 29.9, policy)
    after = plan(declared, nodes, [half], {}, NOW + 30.0, policy)

    assert of_type(before, Reap) == []
    assert of_type(before, Place) == []
    reaps = of_type(after, Reap)
    assert [r.replica for r in reaps] == ["m-e7"]
    assert "rank 1 of 2 never reported" in reaps[0].reason


def test_starting_replica_past_its_startup_timeout_is_reaped() -> None:
    starting = replica(
        "m-e1", ("node01", (0,), 20000), state=ReplicaState.STARTING, created_at=NOW
    )
    nodes = [h100_8x80g("node01")]

    before = plan(catalog(model()), nodes, [starting], {}, NOW + 59.0)
    after = plan(catalog(model()), nodes, [starting], {}, NOW + 60.0)

    assert before.actions == ()
    assert of_type(after, Reap) == [Reap("m-e1", "not ready after 60 s")]


def test_a_replica_whose_ready_shard_turned_unhealthy_is_left_to_its_agent() -> None:
    # Ready for an hour, then a health check failing: not "not ready after 60 s". The
    # agent fails the shard if it does not recover; until then nothing is routed to it.
    unhealthy = replica("m-e1", ("node01", (0,), 20000), state=ReplicaState.STARTING,
                        created_at=NOW, shard_state="unhealthy")
    nodes = [h100_8x80g("node01")]

    assert of_type(plan(catalog(model()), nodes, [unhealthy], {}, NOW + 3600), Reap) == []


def test_a_replica_fetching_its_weights_is_not_held_to_the_startup_timeout() -> None:
    fetching = replica("m-e1", ("node01", (0,), 20000), state=ReplicaState.STARTING,
                       created_at=NOW, shard_state="fetching")
    nodes = [h100_8x80g("node01")]

    assert of_type(plan(catalog(model()), nodes, [fetching], {}, NOW + 3600), Reap) == []


def test_adopted_replica_stuck_starting_is_reaped_after_the_startup_timeout() -> None:
    # Its "ready" may have been lost while the agent reconnected; it must not wait forever.
    adopted = replica(
        "m-e1",
        ("node01", (0,), 20000),
        state=ReplicaState.STARTING,
        created_at=NOW,
    )

    nodes = [h100_8x80g("node01")]
    assert plan(catalog(model()), nodes, [adopted], {}, NOW + 59).actions == ()
    result = plan(catalog(model()), nodes, [adopted], {}, NOW + 3600)
    assert [type(a).__name__ for a in result.actions] == ["Reap"]


# --- backoff ---------------------------------------------------------------------------------


def test_after_failure_doubles_from_the_initial_delay_up_to_the_max() -> None:
    policy = Policy(restart_backoff_initial_s=10.0, restart_backoff_max_s=300.0)
    backoff = Backoff()
    delays = []
    for _ in range(8):
        backoff = after_failure(backoff, NOW, policy)
        delays.append(backoff.not_before - NOW)

    assert delays == [10, 20, 40, 80, 160, 300, 300, 300]
    assert backoff.failures == 8


def test_after_failure_stays_capped_after_a_long_crash_loop() -> None:
    # 1100 failures at the 300 s cap is under four days of a model that cannot start.
    backoff = after_failure(Backoff(failures=1100), NOW, Policy())

    assert backoff == Backoff(1101, NOW + 300.0)


def test_plan_waits_out_the_backoff_and_says_when_it_tries_next() -> None:
    nodes = [h100_8x80g("node01")]
    backoffs = {"m": Backoff(failures=2, not_before=NOW + 15)}

    waiting = plan(catalog(model()), nodes, [], backoffs, NOW)
    due = plan(catalog(model()), nodes, [], backoffs, NOW + 15)

    assert waiting.actions == ()
    assert waiting.unplaced == {"m": "restarting after 2 failures, next try in 15 s"}
    assert len(of_type(due, Place)) == 1
    assert due.unplaced == {}


def test_backoff_of_one_model_does_not_hold_another() -> None:
    backoffs = {"a": Backoff(failures=1, not_before=NOW + 10)}
    declared = catalog(model("a"), model("b"))

    result = plan(declared, [h100_8x80g("node01")], [], backoffs, NOW)

    assert [a.placement.model for a in of_type(result, Place)] == ["b"]
    assert result.unplaced == {"a": "restarting after 1 failure, next try in 10 s"}


def test_settle_backoffs_forgets_failures_after_reset_s_of_readiness() -> None:
    policy = Policy(restart_backoff_reset_s=600.0)
    backoffs = {"m": Backoff(3, NOW + 40), "other": Backoff(2, NOW + 20)}
    ready = replace(replica("m-e1", ("node01", (0,), 20000)), ready_since=NOW)
    starting = replica(
        "other-e1", ("node01", (1,), 20001), model="other", state=ReplicaState.STARTING
    )

    early = settle_backoffs(backoffs, [ready, starting], NOW + 599, policy)
    late = settle_backoffs(backoffs, [ready, starting], NOW + 600, policy)

    assert early == backoffs
    assert late["m"].failures == 0
    assert late["other"] == Backoff(2, NOW + 20)
    assert backoffs["m"].failures == 3  # the input is not changed


# --- usage -----------------------------------------------------------------------------------


def test_usage_of_counts_live_replicas_and_the_leaders_rendezvous_port() -> None:
    pair = replica(
        "p-e1", ("node01", (0, 1), 20000), ("node02", (0, 1), 20000), rendezvous_port=20001
    )
    failed = replica("m-e2", ("node01", (5,), 20005), state=ReplicaState.FAILED)

    usage = usage_of([pair, failed])

    assert usage == {
        "node01": NodeUsage(frozenset({0, 1}), frozenset({20000, 20001}), 1),
        "node02": NodeUsage(frozenset({0, 1}), frozenset({20000}), 1),
    }


def test_plan_works_on_a_thousand_nodes() -> None:
    nodes = [cpu_avx2(f"cpu{i:04d}") for i in range(1000)]
    declared = catalog(model("small", Profile("cpu", "llama.cpp"), replicas=20))

    result = plan(declared, nodes, [], {}, NOW, Policy(strategy="spread"))

    chosen = [a.placement.shards[0].node_id for a in of_type(result, Place)]
    assert len(chosen) == len(set(chosen)) == 20


def test_a_model_waiting_out_its_backoff_keeps_its_room_from_lower_priorities() -> None:
    # Eight GPUs: "low" holds four, "high" crashed out of the other four and waits.
    high = Model("high", (Profile("tp4", "vllm", gpus=4, startup_timeout_s=60.0),),
                 priority=10)
    low = Model("low", (Profile("tp4", "vllm", gpus=4, startup_timeout_s=60.0),),
                replicas=2)
    running = [replica("low-1", ("node01", (0, 1, 2, 3), 8000), model="low", profile="tp4")]
    backoffs = {"high": Backoff(failures=1, not_before=NOW + 5)}

    waiting = plan(catalog(high, low), [h100_8x80g("node01")], running, backoffs, NOW)
    due = plan(catalog(high, low), [h100_8x80g("node01")], running, backoffs, NOW + 5)

    # Not placed for "low", to be evicted for "high" a moment later.
    assert of_type(waiting, Place) == []
    assert waiting.unplaced["high"] == "restarting after 1 failure, next try in 5 s"
    assert "low" in waiting.unplaced
    assert [a.placement.model for a in of_type(due, Place)] == ["high"]
