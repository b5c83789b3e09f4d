"""The replica state machine: shards report, the replica follows."""

from __future__ import annotations

import pytest

from llmgw.core.placement import Placement, ShardPlacement
from llmgw.core.replicas import (
    Replica,
    ReplicaState,
    Shard,
    adopt,
    apply_status,
    fail,
    new_replica,
)

PAIR = Placement(
    model="Qwen/Qwen2.5-72B",
    profile="tp8x2",
    shards=(
        ShardPlacement(0, "node01", "10.0.0.2", 20000, tuple(range(8))),
        ShardPlacement(1, "node02", "10.0.0.3", 20000, tuple(range(8))),
    ),
    fabric="ib-a",
    rendezvous_port=20001,
)
SINGLE = Placement("m", "default", (ShardPlacement(0, "ws1", "10.0.0.9", 20004, (1,)),))


def started(placement: Placement = PAIR, epoch: int = 5) -> Replica:
    return new_replica(f"r-e{epoch}", placement, epoch, now=100.0)


def report(replica: Replica, rank: int, state: str, *, epoch: int = 5, now: float = 110.0,
           **kw) -> Replica:
    return apply_status(replica, rank=rank, epoch=epoch, state=state, now=now, **kw)


# --- new_replica and apply_status --------------------------------------------------------------


def test_new_replica_is_starting_with_world_size_from_its_placement() -> None:
    replica = started()

    assert replica.state is ReplicaState.STARTING
    assert replica.world_size == 2
    assert [(s.rank, s.node_id, s.port, s.state) for s in replica.shards] == [
        (0, "node01", 20000, "starting"),
        (1, "node02", 20000, "starting"),
    ]
    assert replica.epoch == 5
    assert replica.model == "Qwen/Qwen2.5-72B"
    assert replica.profile == "tp8x2"
    assert replica.fabric == "ib-a"
    assert replica.rendezvous_port == 20001
    assert replica.created_at == 100.0
    assert replica.reason == "placed on node01+node02 (ib-a)"
    assert replica.endpoint() is None
    assert replica.missing_ranks() == []
    assert replica.live


def test_ready_on_every_rank_makes_the_replica_ready_at_rank_0() -> None:
    replica = report(started(), 1, "ready", now=120.0)
    replica = report(replica, 0, "ready", now=130.0)

    assert replica.state is ReplicaState.READY
    assert replica.ready_since == 130.0
    assert replica.endpoint() == ("10.0.0.2", 20000)


def test_ready_since_keeps_the_first_moment_of_readiness() -> None:
    replica = report(started(SINGLE), 0, "ready", now=120.0)
    again = report(replica, 0, "ready", now=500.0)

    assert again.ready_since == 120.0


def test_a_reported_port_replaces_the_planned_one() -> None:
    replica = report(started(SINGLE), 0, "ready", port=20777)

    assert replica.endpoint() == ("10.0.0.9", 20777)


def test_ready_on_rank_0_of_2_is_still_starting() -> None:
    replica = report(started(), 0, "ready")

    assert replica.state is ReplicaState.STARTING
    assert replica.ready_since is None
    assert replica.endpoint() is None


def test_a_shard_going_back_to_starting_takes_the_replica_out_of_ready() -> None:
    replica = report(report(started(SINGLE), 0, "ready"), 0, "starting")

    assert replica.state is ReplicaState.STARTING
    assert replica.endpoint() is None


@pytest.mark.parametrize("state", ["failed", "stopped"])
def test_a_failed_shard_fails_the_replica_naming_rank_and_node(state: str) -> None:
    replica = report(started(), 0, "ready")

    replica = report(
        replica, 1, state, detail="exit 1", output_tail=("torch.OutOfMemoryError: CUDA",)
    )

    assert replica.state is ReplicaState.FAILED
    assert replica.reason == f"rank 1 on node02 {state}: exit 1"
    assert replica.shard(1).output_tail == ("torch.OutOfMemoryError: CUDA",)
    assert replica.endpoint() is None
    assert not replica.live


def test_a_failed_replica_stays_failed() -> None:
    failed = report(started(SINGLE), 0, "failed")

    again = report(failed, 0, "ready")

    assert again.state is ReplicaState.FAILED


def test_fail_sets_the_reason() -> None:
    ready = report(started(SINGLE), 0, "ready")

    failed = fail(ready, "node ws1 disconnected before start")

    assert failed.state is ReplicaState.FAILED
    assert failed.reason == "node ws1 disconnected before start"
    assert failed.ready_since is None
    assert failed.endpoint() is None


@pytest.mark.parametrize("epoch", [4, 6])
def test_status_from_another_epoch_is_ignored(epoch: int) -> None:
    replica = started()

    after = report(replica, 0, "failed", epoch=epoch)

    assert after == replica


def test_status_for_an_unknown_rank_is_ignored() -> None:
    replica = started()

    assert report(replica, 7, "failed") == replica


# --- adoption --------------------------------------------------------------------------------


def shard(rank: int, node: str, state: str = "ready", port: int = 20000) -> Shard:
    return Shard(rank, node, f"10.0.0.{rank + 2}", port, (), state)


def adopt_one(replica: Replica | None, s: Shard, *, epoch: int = 9, world_size: int = 2,
              now: float = 200.0) -> Replica:
    return adopt(
        replica,
        replica_id=f"r-e{epoch}",
        model="m",
        profile="pair",
        epoch=epoch,
        world_size=world_size,
        shard=s,
        now=now,
    )


def test_adopt_is_ready_only_when_every_rank_is_in() -> None:
    first = adopt_one(None, shard(1, "node02"))

    assert first.reason == "adopted from running shards"
    assert first.state is ReplicaState.STARTING
    assert first.world_size == 2
    assert first.missing_ranks() == [0]
    assert first.endpoint() is None

    both = adopt_one(first, shard(0, "node01"), now=205.0)

    assert both.state is ReplicaState.READY
    assert [s.rank for s in both.shards] == [0, 1]
    assert both.endpoint() == ("10.0.0.2", 20000)
    assert both.ready_since == 205.0
    assert both.created_at == 200.0


def test_adopt_with_every_rank_but_one_starting_is_not_ready() -> None:
    replica = adopt_one(None, shard(0, "node01"))
    replica = adopt_one(replica, shard(1, "node02", state="starting"))

    assert replica.state is ReplicaState.STARTING
    assert replica.missing_ranks() == []


def test_a_long_running_replica_whose_agent_restarts_gets_a_fresh_startup_clock() -> None:
    # Ready for an hour; its agent restarts and reports the shard starting until its first
    # health check: it must not look "not ready after 600 s".
    old = adopt_one(adopt_one(None, shard(0, "node01"), world_size=1, now=100.0),
                    shard(0, "node01"), world_size=1, now=100.0)
    assert old.state is ReplicaState.READY and old.created_at == 100.0

    back = adopt_one(old, shard(0, "node01", state="starting"), world_size=1, now=3700.0)

    assert back.state is ReplicaState.STARTING and back.created_at == 3700.0
    ready = adopt_one(back, shard(0, "node01"), world_size=1, now=3701.0)
    assert ready.state is ReplicaState.READY and ready.created_at == 3700.0


def test_the_startup_clock_starts_when_the_weights_are_fetched() -> None:
    placed = adopt_one(None, shard(0, "node01", state="fetching"), world_size=1, now=100.0)
    assert placed.state is ReplicaState.STARTING and placed.created_at == 100.0
    still = apply_status(placed, rank=0, epoch=9, state="fetching", now=400.0,
                         detail="fetching m: 3.1/15.2 GB")
    assert still.created_at == 100.0

    fetched = apply_status(still, rank=0, epoch=9, state="starting", now=2000.0)

    assert fetched.state is ReplicaState.STARTING and fetched.created_at == 2000.0


def test_adopt_a_rank_again_replaces_it() -> None:
    replica = adopt_one(None, shard(0, "node01", port=20000))
    replica = adopt_one(replica, shard(0, "node01", port=20010))

    assert [(s.rank, s.port) for s in replica.shards] == [(0, 20010)]


def test_adopt_with_an_older_epoch_is_ignored() -> None:
    known = adopt_one(None, shard(0, "node01"), epoch=9)

    stale = adopt_one(known, shard(1, "node03"), epoch=8)

    assert stale == known


def test_adopt_with_a_newer_epoch_replaces_the_replica() -> None:
    known = adopt_one(adopt_one(None, shard(0, "node01")), shard(1, "node02"), epoch=9)
    assert known.state is ReplicaState.READY

    newer = adopt_one(known, shard(1, "node05"), epoch=10, now=300.0)

    assert newer.epoch == 10
    assert newer.id == "r-e10"
    assert [(s.rank, s.node_id) for s in newer.shards] == [(1, "node05")]
    assert newer.state is ReplicaState.STARTING
    assert newer.created_at == 300.0


def test_adopt_a_failed_shard_fails_the_replica() -> None:
    replica = adopt_one(None, shard(0, "node01", state="failed"))

    assert replica.state is ReplicaState.FAILED
    assert replica.reason == "rank 0 on node01 failed"
