"""The nodes pages, for admins as ``/api/nodes`` is: every node at a glance, and one node
in full (what it reported, its engines in its own words, the build of each engine it is
asked for); drain and undrain a node, and choose its engine builds.

A node is read where ``/api/status`` reads it: on the leader, from its stream's session;
on a server that does not lead, from the store's record the leader keeps. Drains and build
choices are kept in the store, so either server takes them and the leader acts on them.
"""

from __future__ import annotations

from collections import Counter
from urllib.parse import quote

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Template

from llmgw import wire
from llmgw.core.builds import BUILD_NAMES
from llmgw.core.desired_engines import BUILD_SOURCE_WORDS, BY_DEFAULT, BuildChoice
from llmgw.server.admin.engine_builds import set_engine_build
from llmgw.server.admin.nodes import (
    EngineBuildView,
    NodeView,
    drain_node,
    engine_build_view,
    node_view,
    registered_node,
)
from llmgw.server.controller import DRAINING_SETTING, Controller
from llmgw.server.errors import ApiError
from llmgw.server.ui.page import PREFIX, GoTo, open_page, posted
from llmgw.server.ui.pages import status_of
from llmgw.store import StoreUnavailable

NODES = f"{PREFIX}/nodes"
PER_PAGE = 100  # rows of the list: a page stays well under 100 KB however large the cluster
HELD_SHOWN = 20  # weights keys shown per directory
_X86 = ("x86_64", "amd64", "i686", "i386")


def mib(n: int) -> str:
    """A size in MiB as a person reads it."""
    return f"{n / 1024:,.1f} GiB" if n >= 1024 else f"{n:,} MiB"


def node_href(node_id: str) -> str:
    return f"{NODES}/{quote(node_id, safe='')}"


class NodeRow(msgspec.Struct):
    """One line of the list."""

    node: NodeView
    href: str
    gpus: str  # "8x NVIDIA H100 80GB HBM3"
    gpu_used_mib: int
    gpu_total_mib: int


def node_row(node: NodeView) -> NodeRow:
    names = Counter(g.name for g in node.gpus)
    return NodeRow(node, node_href(node.id),
                   ", ".join(f"{n}x {name}" for name, n in names.items()),
                   sum(g.memory_total_mib - g.memory_free_mib for g in node.gpus),
                   sum(g.memory_total_mib for g in node.gpus))


def _page_number(raw: str | None) -> int:
    try:
        return max(1, int(raw or 1))
    except ValueError:
        raise ApiError(400, f"page={raw!r} is not a page number; use 1, 2, …") from None


@get(NODES, include_in_schema=False)
async def nodes_page(request: Request) -> Template:
    page = await open_page(request, admin=True)
    controller: Controller = request.app.state.controller
    status = await status_of(request)
    states = Counter(n.state for n in status.nodes)
    state = request.query_params.get("state", "")
    if state and state not in states:
        state = ""  # none in that state (any more): every node
    shown = sorted((n for n in status.nodes if not state or n.state == state),
                   key=lambda n: n.id)
    number = _page_number(request.query_params.get("page"))
    pages = max(1, -(-len(shown) // PER_PAGE))
    number = min(number, pages)
    rows = [node_row(n) for n in shown[(number - 1) * PER_PAGE:number * PER_PAGE]]
    return page.render("nodes.html", title="Nodes", rows=rows, total=len(status.nodes),
                       matching=len(shown), states=sorted(states.items()), state=state,
                       number=number, pages=pages, per_page=PER_PAGE, mib=mib,
                       leads=controller.holds_lead, draining=await draining_nodes(controller))


async def draining_nodes(controller: Controller) -> set[str]:
    """The nodes an operator asked to drain (whatever their state now: a draining node may
    also be unreachable)."""
    if controller.holds_lead:
        return set(controller.sessions.draining)
    try:
        return set(await controller.store.get_setting(DRAINING_SETTING, []))
    except StoreUnavailable:
        return set()


class BuildRow(msgspec.Struct):
    """One engine's build on this node, and what an admin may choose."""

    engine: str
    view: EngineBuildView
    source: str  # in words
    note: str  # why the choice may not take effect yet, or ""


def build_rows(node: NodeView, register: wire.Register) -> list[BuildRow]:
    rows = []
    installable = register.installable_engines
    for engine in BUILD_NAMES:
        view = node.engine_builds.get(engine)
        note = ""
        if view is None:  # as set_engine_build answers for an engine not asked for
            view = engine_build_view(engine, BuildChoice("auto", BY_DEFAULT))
            note = f"server.yaml names no {engine} for this node: it is not asked for it"
        if installable is not None and engine not in installable:
            note = f"this node's agent cannot install {engine}"
        elif engine in node.disabled_engines:
            note = f"this node disables {engine} (agent.yaml disable_engines)"
        rows.append(BuildRow(engine, view, BUILD_SOURCE_WORDS.get(view.source, view.source), note))
    return rows


@get(f"{NODES}/{{node_id:str}}", include_in_schema=False)
async def node_page(request: Request, node_id: str) -> Template:
    page = await open_page(request, admin=True)
    controller: Controller = request.app.state.controller
    session = await registered_node(controller, node_id)
    node = node_view(session, controller.replicas.values(),
                     controller.build_choices(session.register))
    inv = session.register.inventory
    beat = session.last_heartbeat
    flags = set(inv.cpu_flags)
    models = {r.id: r.model for r in controller.replicas.values()}
    return page.render(
        "node.html", title=f"Node {node.id}", node=node, href=node_href(node.id), inv=inv,
        mib=mib,
        ram_available_mib=beat.ram_available_mib if beat and beat.ram_available_mib
        else inv.ram_available_mib,
        no_avx2=inv.arch in _X86 and bool(flags) and "avx2" not in flags,
        replicas=[(r, models.get(r, "")) for r in node.replicas],
        builds=build_rows(node, session.register),
        held_shown=HELD_SHOWN, leads=controller.holds_lead,
        draining=node.id in await draining_nodes(controller),
        gpu_used_mib=sum(g.memory_total_mib - g.memory_free_mib for g in node.gpus),
        gpu_total_mib=sum(g.memory_total_mib for g in node.gpus))


def _back(fields: dict[str, str], node_id: str) -> str:
    """Back to the page the form was on: the list, or the node's page."""
    return NODES if fields.get("back") == "list" else node_href(node_id)


async def _set_draining(request: Request, node_id: str, draining: bool) -> GoTo:
    _, fields = await posted(request, admin=True)
    controller: Controller = request.app.state.controller
    await drain_node(controller, node_id, draining)
    if draining:
        done = (f"{node_id} is draining: its replicas move to other nodes, each stopping once "
                "its replacement serves; nothing new is placed there until you undrain it")
    else:
        done = f"{node_id} is undrained: replicas may be placed there again"
    if not controller.holds_lead:
        done += f" (kept in the store: the leader acts on it within {controller.interval_s:g} s)"
    return GoTo(_back(fields, node_id), flash=done)


@post(f"{NODES}/{{node_id:str}}/drain", include_in_schema=False, status_code=303)
async def drain_post(request: Request, node_id: str) -> Response:
    raise await _set_draining(request, node_id, True)


@post(f"{NODES}/{{node_id:str}}/undrain", include_in_schema=False, status_code=303)
async def undrain_post(request: Request, node_id: str) -> Response:
    raise await _set_draining(request, node_id, False)


@post(f"{NODES}/{{node_id:str}}/engine-builds/{{engine:str}}", include_in_schema=False,
      status_code=303)
async def engine_build_post(request: Request, node_id: str, engine: str) -> Response:
    _, fields = await posted(request, admin=True)
    done = await set_engine_build(request.app.state.controller, node_id, engine,
                                  fields.get("build", ""))
    source = BUILD_SOURCE_WORDS.get(done.build.source, done.build.source)
    raise GoTo(node_href(node_id),
               flash=f"{node_id} {engine}: {done.build.build} ({source}); {done.told}")


ROUTES = [nodes_page, node_page, drain_post, undrain_post, engine_build_post]
