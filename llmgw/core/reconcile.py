"""The reconcile planner: compare what is declared with what is observed, emit actions.

Level-triggered: every pass looks at the whole picture, so a missed event is corrected on
the next one; events only make the controller run a pass sooner. ``plan`` decides and
the controller acts: it owns the sockets, the store and the clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from llmgw.core.backoff import Retry, delay_s
from llmgw.core.catalog import Catalog, Model
from llmgw.core.inventory import Node, NodeState
from llmgw.core.placement import (
    NodeUsage,
    Placement,
    PlacementResult,
    Refusal,
    Strategy,
    place_model,
    place_replicas,
    static_refusal,
)
from llmgw.core.replicas import Replica, ReplicaState


@dataclass(frozen=True, slots=True)
class Policy:
    restart_backoff_initial_s: float = 10.0
    restart_backoff_max_s: float = 300.0
    restart_backoff_reset_s: float = 600.0
    adoption_grace_s: float = 30.0
    strategy: Strategy = "binpack"


# Crash-loop backoff for one model: how many failures in a row, and when the next replica
# may be placed.
Backoff = Retry


# --- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Place:
    placement: Placement


@dataclass(frozen=True, slots=True)
class Reap:
    """Stop whatever is left of a failed replica and forget it. It counts as a failure
    (the model's crash-loop backoff) when the replica itself failed (``crashed``), not when
    a node it ran on was lost: that says nothing of the model, and it is placed again at
    once."""

    replica: str
    reason: str
    crashed: bool = True


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop a healthy replica that is no longer wanted (scale-down, model removed, drain)."""

    replica: str
    reason: str
    # Why, as one word: scale_down, drain or removed (traces name the action by it).
    cause: str = field(default="removed", compare=False)


@dataclass(frozen=True, slots=True)
class Evict:
    """Stop a replica to make room for a model of higher priority; it is placed again
    when room returns, and it does not count as a failure."""

    replica: str
    reason: str


Action = Place | Reap | Stop | Evict


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...] = ()
    # Why a model has fewer replicas than it wants: placement's refusals, or the backoff.
    unplaced: Mapping[str, str] = field(default_factory=dict)
    # Every node placement turned down, per model it could not place (all of them).
    refusals: Mapping[str, tuple[Refusal, ...]] = field(default_factory=dict)


def usage_of(replicas: Iterable[Replica], held: bool = False) -> dict[str, NodeUsage]:
    """GPUs and ports held on each node by the replicas that are still alive (and, with
    ``held``, by stopped ones whose shards have not yet let go)."""
    usage: dict[str, NodeUsage] = {}
    for replica in replicas:
        if not replica.live and not held:
            continue
        for shard in replica.shards:
            ports = [shard.port] if shard.port is not None else []
            if shard.rank == 0 and replica.rendezvous_port is not None:
                ports.append(replica.rendezvous_port)
            usage[shard.node_id] = usage.get(shard.node_id, NodeUsage()).plus(shard.gpus, ports)
    return usage


def _node_lost(replica: Replica, nodes: Mapping[str, Node]) -> str | None:
    for shard in replica.shards:
        node = nodes.get(shard.node_id)
        if node is None or node.state is NodeState.LOST:
            return f"node {shard.node_id} is lost"
    return None


def _why_reap(replica: Replica, nodes: Mapping[str, Node], now: float, policy: Policy,
              startup_timeout_s: float) -> str | None:
    if replica.state is ReplicaState.FAILED:
        return replica.reason or "failed"
    if replica.missing_ranks() and now - replica.created_at >= policy.adoption_grace_s:
        missing = ", ".join(str(r) for r in replica.missing_ranks())
        return (
            f"rank {missing} of {replica.world_size} never reported; "
            "a replica short of a shard cannot serve"
        )
    # Adopted replicas too: created_at is when they were adopted. A shard that was ready
    # and now fails its health check is not starting: its agent fails it if it does not
    # recover, and the startup clock does not apply. Nor while a shard fetches weights
    # (the fetch has its own timeouts); the clock starts when it is done.
    starting = replica.state is ReplicaState.STARTING and not any(
        s.state in ("unhealthy", "fetching") for s in replica.shards)
    if starting and now - replica.created_at >= startup_timeout_s:
        return f"not ready after {startup_timeout_s:g} s"
    return None


def _stop_order(replica: Replica, load: Mapping[str, int]) -> tuple:
    # Least valuable first: not ready before ready, then the fewest requests in flight,
    # then the youngest.
    return (replica.state is ReplicaState.READY, load.get(replica.id, 0), -replica.created_at,
            replica.id)


def _eviction(model: Model, alive: list[Replica], catalog: Catalog, nodes: list[Node],
              usage: Mapping[str, NodeUsage], policy: Policy) -> list[Replica] | None:
    """The fewest, lowest-priority replicas whose room would let one replica of ``model``
    fit, or None. Only replicas on nodes that could take ``model`` at all are candidates."""
    eligible = {n.id for n in nodes
                if any(static_refusal(model, p, n) is None for p in model.profiles)}

    def priority(r: Replica) -> int:
        return catalog.get(r.model).priority

    victims = sorted(
        (r for r in alive if priority(r) < model.priority
         and any(s.node_id in eligible for s in r.shards)),
        key=lambda r: (priority(r), r.state is ReplicaState.READY, len(r.shards),
                       -r.created_at, r.id))
    if not victims:
        return None

    def fits(without: list[Replica]) -> bool:
        # The room as this pass sees it (placements made, stopping replicas held), less
        # what the victims hold.
        room = _minus(usage, without)
        return place_model(model, nodes, room, policy.strategy).placement is not None

    for victim in victims:
        if fits([victim]):
            return [victim]
    chosen: list[Replica] = []
    for victim in victims:
        chosen.append(victim)
        if fits(chosen):
            # Drop any that turned out not to be needed, most valuable first.
            for extra in sorted(chosen, key=lambda r: -priority(r)):
                if len(chosen) > 1 and fits([r for r in chosen if r is not extra]):
                    chosen.remove(extra)
            return chosen
    return None


def _minus(usage: Mapping[str, NodeUsage], replicas: Iterable[Replica]
           ) -> dict[str, NodeUsage]:
    room = dict(usage)
    for node_id, freed in usage_of(replicas, held=True).items():
        have = room.get(node_id, NodeUsage())
        room[node_id] = NodeUsage(have.gpus - freed.gpus, have.ports - freed.ports,
                                  max(0, have.shards - freed.shards))
    return room


def plan(
    catalog: Catalog,
    nodes: Iterable[Node],
    replicas: Iterable[Replica],
    backoffs: Mapping[str, Backoff],
    now: float,
    policy: Policy = Policy(),
    load: Mapping[str, int] | None = None,
    held: Iterable[Replica] = (),
) -> Plan:
    """``load``: requests in flight per replica id. ``held``: replicas being stopped whose
    GPUs and ports are not free yet."""
    nodes = list(nodes)
    nodes_by_id = {n.id: n for n in nodes}
    replicas = list(replicas)
    held = list(held)
    load = load or {}
    actions: list[Action] = []
    unplaced: dict[str, str] = {}
    refused: dict[str, tuple[Refusal, ...]] = {}
    gone: set[str] = set()
    # A model whose replica failed this pass waits for the next one, which sees the backoff
    # the controller records for the failure.
    failed_now: set[str] = set()
    evicted_from: set[str] = set()

    for replica in replicas:
        model = catalog.get(replica.model)
        profile = model.profile(replica.profile) if model else None
        if model is None or profile is None:
            actions.append(Stop(replica.id, f"model {replica.model} is no longer declared"))
            gone.add(replica.id)
            continue
        lost = _node_lost(replica, nodes_by_id)
        if lost is not None:
            actions.append(Reap(replica.id, lost, crashed=False))
            gone.add(replica.id)
            continue
        reason = _why_reap(replica, nodes_by_id, now, policy, profile.startup_timeout_s)
        if reason is not None:
            actions.append(Reap(replica.id, reason))
            gone.add(replica.id)
            failed_now.add(replica.model)

    alive = [r for r in replicas if r.id not in gone and r.live]
    # What is stopped or reaped in this pass still runs until its shards let go: its room
    # is not free in this pass either.
    stopping_now = [r for r in replicas if r.id in gone]
    usage = usage_of([*alive, *held, *stopping_now], held=True)

    def draining(r: Replica) -> str | None:
        return next((s.node_id for s in r.shards if nodes_by_id.get(s.node_id) is not None
                     and nodes_by_id[s.node_id].state is NodeState.DRAINING), None)

    # The most important models first: they get the room, and may make some.
    for model in sorted(catalog.models, key=lambda m: (-m.priority, m.name)):
        # Not those evicted earlier in this pass by a model of higher priority.
        mine = [r for r in alive if r.model == model.name and r.id not in gone]
        staying = [r for r in mine if draining(r) is None]
        ready_staying = sum(1 for r in staying if r.state is ReplicaState.READY)
        # A replica on a draining node stops once enough others serve without it.
        for replica in mine:
            if draining(replica) and ready_staying >= model.replicas:
                actions.append(Stop(replica.id, f"node {draining(replica)} is draining",
                                    "drain"))
        surplus = len(staying) - model.replicas
        if surplus > 0:
            order = sorted(staying, key=lambda r: _stop_order(r, load))
            for replica in order[:surplus]:
                actions.append(Stop(replica.id, f"scaled down to {model.replicas}",
                                    "scale_down"))
            continue
        wanted = -surplus
        if wanted == 0:
            continue
        if model.name in failed_now:
            # The failed replica's shards still hold its room in this pass.
            unplaced[model.name] = "a replica just failed; restarting after the backoff"
            continue
        backoff = backoffs.get(model.name, Backoff())
        if not backoff.due(now):
            unplaced[model.name] = (
                f"restarting after {backoff.failures} failure"
                f"{'s' if backoff.failures != 1 else ''}, next try in "
                f"{backoff.not_before - now:.0f} s"
            )
            # Its room stays its own while it waits: the models after it (none more
            # important) do not take what it would take now, only to be evicted for it.
            for placement in place_replicas(model, nodes, usage, policy.strategy, wanted)[0]:
                _take(usage, placement)
            continue
        placements, refusals = place_replicas(model, nodes, usage, policy.strategy, wanted)
        for placement in placements:
            actions.append(Place(placement))
            _take(usage, placement)
        if len(placements) == wanted:
            continue
        if held and place_model(model, nodes, _minus(usage, held),
                                policy.strategy).placement is not None:
            # Room is on its way: replicas still stopping will free enough of it.
            unplaced[model.name] = "waiting for " + ", ".join(r.id for r in held) + " to stop"
            continue
        # A model that just lost a replica to eviction does not evict in turn in the
        # same pass: a cascade, if any, happens one logged pass at a time.
        victims = None if model.name in evicted_from else _eviction(
            model, [r for r in alive if r.id not in gone], catalog, nodes, usage, policy)
        if victims:
            # The room is taken next pass, once the victims' shards have stopped.
            for victim in victims:
                lower = catalog.get(victim.model).priority
                actions.append(Evict(victim.id, f"evicted for {model.name} (priority "
                                     f"{model.priority} over {lower})"))
                gone.add(victim.id)
                evicted_from.add(victim.model)
            unplaced[model.name] = "making room: " + ", ".join(v.id for v in victims)
            continue
        unplaced[model.name] = PlacementResult(None, refusals).describe()
        refused[model.name] = refusals
    return Plan(tuple(actions), unplaced, refused)


def _take(usage: dict[str, NodeUsage], placement: Placement) -> None:
    """Count ``placement``'s GPUs and ports as used in this pass."""
    for shard in placement.shards:
        usage[shard.node_id] = usage.get(shard.node_id, NodeUsage()).plus(
            shard.gpus, placement.ports_on(shard.node_id))


def after_failure(backoff: Backoff, now: float, policy: Policy) -> Backoff:
    """One more failure in a row: wait 10 s, doubling up to 5 min (by default)."""
    failures = backoff.failures + 1
    return Backoff(failures, now + delay_s(failures, policy.restart_backoff_initial_s,
                                           policy.restart_backoff_max_s))


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
