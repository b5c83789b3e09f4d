"""The reconcile planner: compare what is declared with what is observed, emit actions.

Level-triggered: every pass looks at the whole picture, so a missed event is corrected on
the next one; events only make the controller run a pass sooner. ``plan`` decides and
the controller acts: it owns the sockets, the store and the clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from llmgw.core.catalog import Catalog
from llmgw.core.inventory import Node, NodeState
from llmgw.core.placement import NodeUsage, Placement, Strategy, place_model
from llmgw.core.replicas import Replica, ReplicaState


@dataclass(frozen=True, slots=True)
class Policy:
    restart_backoff_initial_s: float = 10.0
    restart_backoff_max_s: float = 300.0
    restart_backoff_reset_s: float = 600.0
    adoption_grace_s: float = 30.0
    strategy: Strategy = "binpack"


@dataclass(frozen=True, slots=True)
class Backoff:
    """Crash-loop backoff for one model: how many failures in a row, and when the next
    replica may be placed."""

    failures: int = 0
    not_before: float = 0.0


# --- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Place:
    placement: Placement


@dataclass(frozen=True, slots=True)
class Reap:
    """Stop whatever is left of a failed replica and forget it; counts as a failure."""

    replica: str
    reason: str


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop a healthy replica that is no longer wanted (scale-down, model removed)."""

    replica: str
    reason: str


Action = Place | Reap | Stop


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...] = ()
    # Why a model has fewer replicas than it wants: placement's refusals, or the backoff.
    unplaced: Mapping[str, str] = field(default_factory=dict)


def usage_of(replicas: Iterable[Replica]) -> dict[str, NodeUsage]:
    """GPUs and ports held on each node by the replicas that are still alive."""
    usage: dict[str, NodeUsage] = {}
    for replica in replicas:
        if not replica.live:
            continue
        for shard in replica.shards:
            ports = [shard.port] if shard.port is not None else []
            if shard.rank == 0 and replica.rendezvous_port is not None:
                ports.append(replica.rendezvous_port)
            usage[shard.node_id] = usage.get(shard.node_id, NodeUsage()).plus(shard.gpus, ports)
    return usage


def _why_reap(replica: Replica, nodes: Mapping[str, Node], now: float, policy: Policy,
              startup_timeout_s: float) -> str | None:
    if replica.state is ReplicaState.FAILED:
        return replica.reason or "failed"
    for shard in replica.shards:
        node = nodes.get(shard.node_id)
        if node is None or node.state is NodeState.LOST:
            return f"node {shard.node_id} is lost"
    if replica.missing_ranks() and now - replica.created_at >= policy.adoption_grace_s:
        missing = ", ".join(str(r) for r in replica.missing_ranks())
        return (
            f"rank {missing} of {replica.world_size} never reported; "
            "a replica short of a shard cannot serve"
        )
    # Adopted replicas too: created_at is when they were adopted.
    starting = replica.state is ReplicaState.STARTING
    if starting and now - replica.created_at >= startup_timeout_s:
        return f"not ready after {startup_timeout_s:g} s"
    return None


def _stop_order(replica: Replica) -> tuple:
    # Least valuable first: not ready before ready, then the youngest.
    return (replica.state is ReplicaState.READY, -replica.created_at)


def plan(
    catalog: Catalog,
    nodes: Iterable[Node],
    replicas: Iterable[Replica],
    backoffs: Mapping[str, Backoff],
    now: float,
    policy: Policy = Policy(),
) -> Plan:
    nodes_by_id = {n.id: n for n in nodes}
    replicas = list(replicas)
    actions: list[Action] = []
    unplaced: dict[str, str] = {}
    gone: set[str] = set()
    # A model whose replica failed this pass waits for the next one, which sees the backoff
    # the controller records for the failure (and the stopped shard's GPUs and ports free).
    failed_now: set[str] = set()

    for replica in replicas:
        model = catalog.get(replica.model)
        profile = model.profile(replica.profile) if model else None
        if model is None or profile is None:
            actions.append(Stop(replica.id, f"model {replica.model} is no longer declared"))
            gone.add(replica.id)
            continue
        reason = _why_reap(replica, nodes_by_id, now, policy, profile.startup_timeout_s)
        if reason is not None:
            actions.append(Reap(replica.id, reason))
            gone.add(replica.id)
            failed_now.add(replica.model)

    alive = [r for r in replicas if r.id not in gone and r.live]
    usage = usage_of(alive)
    for model in catalog.models:
        mine = [r for r in alive if r.model == model.name]
        surplus = len(mine) - model.replicas
        if surplus > 0:
            for replica in sorted(mine, key=_stop_order)[:surplus]:
                actions.append(Stop(replica.id, f"scaled down to {model.replicas}"))
            continue
        wanted = -surplus
        if wanted == 0:
            continue
        if model.name in failed_now:
            unplaced[model.name] = "a replica just failed; restarting after the backoff"
            continue
        backoff = backoffs.get(model.name, Backoff())
        if now < backoff.not_before:
            unplaced[model.name] = (
                f"restarting after {backoff.failures} failure"
                f"{'s' if backoff.failures != 1 else ''}, next try in "
                f"{backoff.not_before - now:.0f} s"
            )
            continue
        for _ in range(wanted):
            result = place_model(model, nodes_by_id.values(), usage, policy.strategy)
            if result.placement is None:
                unplaced[model.name] = result.describe()
                break
            actions.append(Place(result.placement))
            for shard in result.placement.shards:
                ports = [shard.port]
                if shard.rank == 0 and result.placement.rendezvous_port is not None:
                    ports.append(result.placement.rendezvous_port)
                usage[shard.node_id] = usage.get(shard.node_id, NodeUsage()).plus(
                    shard.gpus, ports
                )
    return Plan(tuple(actions), unplaced)


def after_failure(backoff: Backoff, now: float, policy: Policy) -> Backoff:
    """One more failure in a row: wait 10 s, doubling up to 5 min (by default)."""
    failures = backoff.failures + 1
    # Cap the exponent first: a model failing for days must not overflow the float.
    doublings = min(failures - 1, 32)
    delay = min(policy.restart_backoff_initial_s * 2**doublings, policy.restart_backoff_max_s)
    return Backoff(failures, now + delay)


def settle_backoffs(
    backoffs: Mapping[str, Backoff], replicas: Iterable[Replica], now: float, policy: Policy
) -> dict[str, Backoff]:
    """Forget a model's failures once one of its replicas has been ready long enough."""
    settled = dict(backoffs)
    for replica in replicas:
        b = settled.get(replica.model)
        if b is None or b.failures == 0 or replica.ready_since is None:
            continue
        if now - replica.ready_since >= policy.restart_backoff_reset_s:
            settled[replica.model] = replace(b, failures=0)
    return settled
