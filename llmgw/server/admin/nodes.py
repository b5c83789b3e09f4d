"""Nodes over the admin API: what each reports, and draining one for maintenance (its
engine builds: admin/engine_builds.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec
from litestar import get, post
from litestar.di import NamedDependency
from litestar.params import FromPath

import llmgw
from llmgw.core.builds import BUILD_NAMES
from llmgw.core.desired_engines import DEFAULT_CHOICE, BuildChoice
from llmgw.core.replicas import Replica
from llmgw.core.versions import behind_words
from llmgw.server.admin.common import ADMIN
from llmgw.server.agents.sessions import NodeSession, session_of_record
from llmgw.server.controller import Controller
from llmgw.server.errors import ApiError, refusals
from llmgw.store import Store, StoreUnavailable


class GpuView(msgspec.Struct):
    index: int
    name: str
    memory_total_mib: int
    memory_free_mib: int


class EngineView(msgspec.Struct):
    name: str
    version: str
    state: str
    detail: str


class WeightsDirView(msgspec.Struct):
    path: str
    shared: bool
    total_mib: int
    free_mib: int
    held: list[str]
    note: str


class RdmaView(msgspec.Struct):
    adapter: str
    port: int
    state: str
    rate_gbps: float
    link_layer: str


class EngineBuildView(msgspec.Struct):
    """The build of one engine a node is asked for: ``auto`` (the node takes its best),
    a build name, or ``none`` (not installed there); ``source`` says what decided it:
    ``node`` (an operator's choice for this node), ``server.yaml`` (its engine_overrides) or
    ``default``. ``choices``: what an operator may choose (``default``: server.yaml's)."""

    build: str
    source: str
    choices: list[str]


def engine_build_view(engine: str, choice: BuildChoice) -> EngineBuildView:
    return EngineBuildView(choice.build, choice.source,
                           [DEFAULT_CHOICE, "auto", "none", *BUILD_NAMES[engine]])


class NodeView(msgspec.Struct):
    id: str
    address: str
    state: str
    fabric: str | None
    labels: dict[str, str]
    gpus: list[GpuView]
    engines: list[EngineView]
    disabled_engines: list[str]
    weights: list[str]
    weights_dirs: list[WeightsDirView]
    gpu_driver: str
    cuda: str
    rdma: list[RdmaView]
    replicas: list[str]
    warnings: list[str]
    # The node's llmgw, as its agent registered ("unknown" from an agent that did not say).
    llmgw_version: str = "unknown"
    # Per engine server.yaml asks it for, or an operator chose a build of for it.
    engine_builds: dict[str, EngineBuildView] = {}


def replicas_by_node(replicas: Iterable[Replica]) -> dict[str, list[Replica]]:
    """Each node's replicas, in one pass (not a scan of every replica per node)."""
    found: dict[str, list[Replica]] = {}
    for r in replicas:
        for node_id in {s.node_id for s in r.shards}:
            found.setdefault(node_id, []).append(r)
    return found


def node_view(session: NodeSession, replicas: Iterable[Replica],
              builds: Mapping[str, BuildChoice] | None = None) -> NodeView:
    """``builds``: its engines' build choices (``Controller.build_choices``)."""
    inv = session.register.inventory
    warnings = []
    behind = behind_words(llmgw.__version__, session.register.agent_version)
    if behind:
        warnings.append(behind)
    flags = set(inv.cpu_flags)
    if flags and "avx2" not in flags and not flags & {"neon", "asimd"}:
        warnings.append("CPU without AVX2: CPU engines run several times slower; on a VM, "
                        "give it the host's CPU model (e.g. QEMU -cpu host)")
    beat = session.last_heartbeat
    free = beat.weights_free_mib if beat else []
    if len(free) != len(inv.weights_dirs):  # the heartbeat lists them in inventory order
        free = [d.free_mib for d in inv.weights_dirs]
    # GPU memory free as of the last heartbeat, as placement reads it; else the inventory's.
    gpu_free = beat.gpu_memory_free_mib if beat else []
    if len(gpu_free) != len(inv.gpus):
        gpu_free = [g.memory_free_mib for g in inv.gpus]
    return NodeView(
        id=session.node_id,
        address=session.register.address,
        state=session.state.value,
        fabric=inv.fabric,
        labels=inv.labels,
        gpus=[GpuView(g.index, g.name, g.memory_total_mib, f)
              for g, f in zip(inv.gpus, gpu_free, strict=True)],
        engines=[EngineView(e.name, e.version, e.state, e.detail) for e in inv.engines],
        disabled_engines=inv.disabled_engines,
        weights=inv.weights,
        weights_dirs=[WeightsDirView(d.path, d.shared, d.total_mib, f, d.held, d.note)
                      for d, f in zip(inv.weights_dirs, free, strict=True)],
        gpu_driver=inv.gpu_driver, cuda=inv.cuda,
        rdma=[RdmaView(p.adapter, p.port, p.state, p.rate_gbps, p.link_layer)
              for p in inv.rdma],
        replicas=sorted(r.id for r in replicas
                        if any(s.node_id == session.node_id for s in r.shards)),
        warnings=warnings,
        llmgw_version=session.register.agent_version or "unknown",
        engine_builds={name: engine_build_view(name, c) for name, c in (builds or {}).items()},
    )



async def known_sessions(controller: Controller, store: Store) -> list[NodeSession]:
    """The nodes as this server knows them: its own streams' sessions while it leads,
    else the leader's records in the store (none while the store is out of reach)."""
    if controller.holds_lead:  # even while not sure of its lease
        return controller.sessions.all()
    try:
        return [session_of_record(r) for r in await store.list_nodes()]
    except StoreUnavailable:
        return []


async def known_session(controller: Controller, node_id: str) -> NodeSession | None:
    """One node as this server knows it: its stream's session, else the leader's record
    in the store (a server that does not lead holds no stream); None for a node never
    registered. StoreUnavailable when it must read the store and cannot."""
    session = controller.sessions.get(node_id)
    if session is None and (record := await controller.store.get_node(node_id)) is not None:
        session = session_of_record(record)
    return session


async def registered_node(controller: Controller, node_id: str) -> NodeSession:
    """``known_session``, or the refusal: 404 for a node never registered, 503 when this
    server does not lead and cannot read the leader's record in the store."""
    try:
        session = await known_session(controller, node_id)
    except StoreUnavailable:
        raise ApiError(503, "this server does not lead and cannot reach the store to read "
                       "the leader's record of the node; ask the leader, or again once the "
                       "store answers", code="store_unavailable") from None
    if session is None:
        raise ApiError(404, f"no node {node_id!r} has registered; `llmgw ctl nodes` and the "
                       "Nodes page list those that have", code="node_not_found")
    return session


@get("/api/nodes", **ADMIN, responses=refusals(401, 403))
async def list_nodes(controller: NamedDependency[Controller],
                     store: NamedDependency[Store]) -> list[NodeView]:
    on_node = replicas_by_node(controller.replicas.values())
    return [node_view(s, on_node.get(s.node_id, ()), controller.build_choices(s.register))
            for s in await known_sessions(controller, store)]


async def drain_node(controller: Controller, node_id: str, draining: bool) -> NodeView:
    """On a server that does not lead, the drain is kept in the store, and the leader acts
    on it at its next read of the models and drains."""
    session = await registered_node(controller, node_id)
    await controller.set_draining(node_id, draining)
    session = controller.sessions.get(node_id) or session
    return node_view(session, controller.replicas.values(),
                     controller.build_choices(session.register))


@post("/api/nodes/{node_id:str}/drain", status_code=200, **ADMIN,
      responses=refusals(401, 403, 404, 415))
async def drain(node_id: FromPath[str], controller: NamedDependency[Controller]) -> NodeView:
    return await drain_node(controller, node_id, True)


@post("/api/nodes/{node_id:str}/undrain", status_code=200, **ADMIN,
      responses=refusals(401, 403, 404, 415))
async def undrain(node_id: FromPath[str], controller: NamedDependency[Controller]) -> NodeView:
    return await drain_node(controller, node_id, False)


ROUTES = [list_nodes, drain, undrain]
