"""Replicas and their shards: the state machine, as pure transitions over frozen data.

A replica knows how many shards it must have (its profile's node count, set at placement
and again at adoption). It is ready only when every rank is, and its endpoint is rank 0's.
Status carrying an older epoch than the replica's is ignored: it comes from a placement
that has since been replaced.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from llmgw.core.placement import Placement


class ReplicaState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    node_id: str
    address: str
    port: int | None
    gpus: tuple[int, ...] = ()
    state: str = "starting"  # fetching | starting | ready | unhealthy | failed | stopped
    detail: str = ""
    output_tail: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Replica:
    id: str
    model: str
    profile: str
    epoch: int
    world_size: int
    shards: tuple[Shard, ...]
    state: ReplicaState
    created_at: float
    ready_since: float | None = None
    reason: str = ""
    fabric: str | None = None
    rendezvous_port: int | None = None

    def shard(self, rank: int) -> Shard | None:
        return next((s for s in self.shards if s.rank == rank), None)

    def endpoint(self) -> tuple[str, int] | None:
        leader = self.shard(0)
        if self.state is not ReplicaState.READY or leader is None or leader.port is None:
            return None
        return leader.address, leader.port

    @property
    def live(self) -> bool:
        return self.state not in (ReplicaState.FAILED, ReplicaState.STOPPED)

    def missing_ranks(self) -> list[int]:
        have = {s.rank for s in self.shards}
        return [r for r in range(self.world_size) if r not in have]


def new_replica(replica_id: str, placement: Placement, epoch: int, now: float) -> Replica:
    shards = tuple(
        Shard(s.rank, s.node_id, s.address, s.port, s.gpus) for s in placement.shards
    )
    return Replica(
        id=replica_id,
        model=placement.model,
        profile=placement.profile,
        epoch=epoch,
        world_size=len(shards),
        shards=shards,
        state=ReplicaState.STARTING,
        created_at=now,
        reason=placement.describe(),
        fabric=placement.fabric,
        rendezvous_port=placement.rendezvous_port,
    )


def _settle(replica: Replica, now: float) -> Replica:
    """Derive the replica's state from its shards."""
    if replica.state in (ReplicaState.FAILED, ReplicaState.STOPPED):
        return replica
    failed = next((s for s in replica.shards if s.state in ("failed", "stopped")), None)
    if failed is not None:
        detail = f": {failed.detail}" if failed.detail else ""
        return replace(
            replica,
            state=ReplicaState.FAILED,
            ready_since=None,
            reason=f"rank {failed.rank} on {failed.node_id} {failed.state}{detail}",
        )
    complete = not replica.missing_ranks()
    if complete and all(s.state == "ready" for s in replica.shards):
        since = replica.ready_since if replica.ready_since is not None else now
        return replace(replica, state=ReplicaState.READY, ready_since=since)
    return replace(replica, state=ReplicaState.STARTING, ready_since=None)


def apply_status(
    replica: Replica,
    *,
    rank: int,
    epoch: int,
    state: str,
    now: float,
    port: int | None = None,
    detail: str = "",
    output_tail: tuple[str, ...] = (),
) -> Replica:
    """A shard reported a transition. Status from an older placement is ignored."""
    if epoch != replica.epoch:
        return replica
    shard = replica.shard(rank)
    if shard is None:
        return replica
    if shard.state == "fetching" and state != "fetching":
        # The weights are there now: the startup clock starts over, so a long download
        # does not count against the engine's startup timeout.
        replica = replace(replica, created_at=now)
    updated = replace(
        shard,
        state=state,
        port=port if port is not None else shard.port,
        detail=detail,
        output_tail=output_tail or shard.output_tail,
    )
    shards = tuple(updated if s.rank == rank else s for s in replica.shards)
    return _settle(replace(replica, shards=shards), now)


def fail(replica: Replica, reason: str) -> Replica:
    return replace(replica, state=ReplicaState.FAILED, ready_since=None, reason=reason)


def adopt(
    replica: Replica | None,
    *,
    replica_id: str,
    model: str,
    profile: str,
    epoch: int,
    world_size: int,
    shard: Shard,
    now: float,
) -> Replica:
    """Fold one running shard, reported by a node after a restart, into its replica.

    The replica takes its shard count from what the shard reports, so a replica that comes
    back with a rank missing is not ready, and is failed once its grace period ends.
    """
    if replica is None or replica.epoch < epoch:
        replica = Replica(
            id=replica_id,
            model=model,
            profile=profile,
            epoch=epoch,
            world_size=world_size,
            shards=(),
            state=ReplicaState.STARTING,
            created_at=now,
            reason="adopted from running shards",
        )
    elif replica.epoch > epoch:
        return replica
    elif shard.state != "ready":
        # A known replica whose node came back with a shard not (yet) ready: its startup
        # clock starts again now, or a replica older than its startup timeout would be
        # reaped the moment its agent restarts.
        replica = replace(replica, created_at=now)
    shards = tuple(sorted([*(s for s in replica.shards if s.rank != shard.rank), shard],
                          key=lambda s: s.rank))
    return _settle(replace(replica, shards=shards), now)
