"""``/api/status``: the cluster as the controller sees it.

On a server that does not lead, replicas are the leader's table as last read, and nodes
are as the leader recorded them in the store (their heartbeats go to the leader)."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from litestar import get
from litestar.di import NamedDependency

from llmgw.core.catalog import Model
from llmgw.core.inventory import NodeState
from llmgw.core.replicas import Replica, ReplicaState
from llmgw.core.throttle import LoginThrottle
from llmgw.server.admin.common import ADMIN
from llmgw.server.admin.nodes import (
    NodeView,
    known_sessions,
    node_view,
    replicas_by_node,
)
from llmgw.server.agents.sessions import NodeSession
from llmgw.server.auth.passwords import PasswordHasher
from llmgw.server.controller import Controller
from llmgw.server.errors import refusals
from llmgw.server.leadership import Leadership
from llmgw.server.openai.router import Router
from llmgw.store import Store, StoreUnavailable


class ShardView(msgspec.Struct):
    rank: int
    node: str
    port: int | None
    state: str
    detail: str


class ReplicaView(msgspec.Struct):
    id: str
    model: str
    profile: str
    epoch: int
    state: str
    reason: str
    in_flight: int
    shards: list[ShardView]


class WeightsHeld(msgspec.Struct):
    """Where a model's weights are in one fabric: on these nodes, and on these shared
    directories (a filer counts once, however many nodes see it)."""

    fabric: str | None
    nodes: list[str]
    shared: list[str]


class ModelStatus(msgspec.Struct):
    name: str
    replicas_wanted: int
    priority: int
    weights_in_fabrics: list[str]
    weights: list[WeightsHeld]
    replicas_ready: int
    unplaced: str | None
    # Scale to zero: unloaded after idle_unload_s without a request (null: never), down to
    # min_replicas, and whether it is so now (a request wakes it).
    idle_unload_s: float | None = None
    asleep: bool = False


class Logins(msgspec.Struct):
    """The login throttle's addresses, and the password hasher's slots."""

    tracked_addresses: int
    throttle_capacity: int
    slots: int
    in_use: int
    peak: int


class ServerView(msgspec.Struct):
    """One of the cluster's servers, as the store last heard from it."""

    name: str
    address: str
    up: bool
    since: float  # Unix time it came up (if up) or last came up
    leader: bool


class LeaderView(msgspec.Struct):
    name: str
    address: str
    term: int
    since: float  # Unix time it took the lead


class Status(msgspec.Struct):
    nodes: list[NodeView]
    replicas: list[ReplicaView]
    models: list[ModelStatus]
    logins: Logins
    # Who leads (None: no server does right now), which server answered, and every
    # server the store knows.
    leader: LeaderView | None = None
    answered_by: str = ""
    servers: list[ServerView] = []


@get("/api/status", **ADMIN, responses=refusals(401, 403))
async def status(controller: NamedDependency[Controller], router: NamedDependency[Router],
                 throttle: NamedDependency[LoginThrottle],
                 hasher: NamedDependency[PasswordHasher], store: NamedDependency[Store],
                 leadership: NamedDependency[Leadership]) -> Status:
    return await cluster_status(controller, router, throttle, hasher, store, leadership)


async def cluster_status(controller: Controller, router: Router, throttle: LoginThrottle,
                         hasher: PasswordHasher, store: Store, leadership: Leadership
                         ) -> Status:
    """The cluster as this server sees it: ``/api/status``, and the cluster page's."""
    sessions = await known_sessions(controller, store)
    on_node = replicas_by_node(controller.replicas.values())
    nodes = [node_view(s, on_node.get(s.node_id, ()), controller.build_choices(s.register))
             for s in sessions]
    replicas = replica_views(controller, router)
    models = [model_status(m, controller, sessions) for m in controller.catalog.models]
    logins = Logins(tracked_addresses=len(throttle), throttle_capacity=throttle.capacity,
                    **hasher.stats())
    try:
        lease, servers_seen = await store.leader(), await store.list_servers()
    except StoreUnavailable:  # as last read: status answers from memory
        lease, servers_seen = leadership.leader, []
    leader = (LeaderView(lease.holder, lease.address, lease.term, lease.since)
              if lease is not None and lease.live else None)
    servers = [ServerView(s.name, s.address, s.live, s.since,
                          leader is not None and s.name == leader.name)
               for s in servers_seen]
    return Status(nodes=nodes, replicas=replicas, models=models, logins=logins,
                  leader=leader, answered_by=leadership.name, servers=servers)


def replica_views(controller: Controller, router: Router, model: str | None = None
                  ) -> list[ReplicaView]:
    """The replicas (of ``model``, if given), and a lost node's replica still routed to
    until its replacement serves."""
    in_flight = router.in_flight()
    views = [_replica_view(r, in_flight, r.reason)
             for r in sorted(controller.replicas.values(), key=lambda r: r.id)
             if model is None or r.model == model]
    views += [_replica_view(r, in_flight, "its node is lost; routed to while its engine "
                            "answers, until the replacement serves")
              for r in sorted(controller.orphans.values(), key=lambda r: r.id)
              if r.state is ReplicaState.READY and (model is None or r.model == model)]
    return views


def model_status(m: Model, controller: Controller, sessions: list[NodeSession]
                 ) -> ModelStatus:
    held = weights_held(m, sessions)
    return ModelStatus(
        name=m.name, replicas_wanted=m.replicas, priority=m.priority,
        weights_in_fabrics=sorted({h.fabric for h in held if h.fabric}), weights=held,
        replicas_ready=sum(1 for r in controller.replicas.values()
                           if r.model == m.name and r.state.value == "ready"),
        unplaced=controller.unplaced.get(m.name), idle_unload_s=m.idle_unload_s,
        asleep=m.name in controller.asleep)


def _replica_view(r: Replica, in_flight: dict[str, int], reason: str) -> ReplicaView:
    return ReplicaView(id=r.id, model=r.model, profile=r.profile, epoch=r.epoch,
                       state=r.state.value, reason=reason, in_flight=in_flight.get(r.id, 0),
                       shards=[ShardView(s.rank, s.node_id, s.port, s.state, s.detail)
                               for s in r.shards])


def weights_held(model: Model, sessions: Iterable[NodeSession]) -> list[WeightsHeld]:
    """Where the model's weights are, per fabric: weights in one fabric are no use in
    another without a slow copy over the management network. A shared filer counts once,
    however many nodes see it. A lost node's weights do not count: no replica can be
    placed there, and what it holds may not be there when it comes back."""
    keys = {model.weights_key(p) for p in model.profiles}
    fabrics: dict[str | None, WeightsHeld] = {}
    for session in sessions:
        if session.state is NodeState.LOST:
            continue
        inv = session.register.inventory
        for directory in inv.weights_dirs or [None]:
            held = set(directory.held) if directory else set(inv.weights)
            if not held & keys:
                continue
            entry = fabrics.setdefault(inv.fabric, WeightsHeld(inv.fabric, [], []))
            if directory is not None and directory.shared:
                if directory.path not in entry.shared:
                    entry.shared.append(directory.path)
            elif session.node_id not in entry.nodes:
                entry.nodes.append(session.node_id)
    return sorted(fabrics.values(), key=lambda e: (e.fabric is None, e.fabric or ""))


ROUTES = [status]
