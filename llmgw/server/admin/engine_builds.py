"""A node's engine builds over the admin API: read them, and choose one.

``set_engine_build`` is what ``PUT /api/nodes/{node}/engine-builds/{engine}`` runs, and
what the cluster page calls. The choice is kept in the store (every server of the cluster
reads it, and it survives restarts) and wins over server.yaml's ``engine_overrides`` for
that node and engine; ``default`` clears it. The leader tells the node at once when it
holds the node's stream; a choice made on another server reaches the node within the
leader's next controller interval.
"""

from __future__ import annotations

import msgspec
from litestar import get, put
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from llmgw.core.builds import BUILD_NAMES
from llmgw.core.desired_engines import BY_DEFAULT, BuildChoice, build_choice_refusal
from llmgw.server.admin.common import ADMIN, Input, StrictBody
from llmgw.server.admin.nodes import (
    EngineBuildView,
    NodeView,
    engine_build_view,
    node_view,
    registered_node,
)
from llmgw.server.controller import Controller
from llmgw.server.errors import ApiError, refusals


class EngineBuildChoice(Input):
    """``{"build": "cu129"}``: auto, none, one of the engine's builds, or default (no
    choice of the operator's: server.yaml's engine_overrides, else auto)."""

    build: str


class EngineBuildSet(msgspec.Struct):
    """What was kept, and when the node hears of it (``told``, in words)."""

    engine: str
    build: EngineBuildView
    told: str
    node: NodeView


async def set_engine_build(controller: Controller, node_id: str, engine: str,
                           choice: str) -> EngineBuildSet:
    """Keep ``choice`` as ``node_id``'s build of ``engine`` and tell the node. Refused
    (ApiError, nothing kept) for a node that never registered (404) or an engine or build
    that is not one (400, naming those that are)."""
    session = await registered_node(controller, node_id)
    refusal = build_choice_refusal(engine, choice, default_too=True)
    if refusal:
        raise ApiError(400, refusal, param="build" if engine in BUILD_NAMES else "engine",
                       code="invalid_value")
    told = await controller.set_engine_build(node_id, engine, choice)
    session = controller.sessions.get(node_id) or session
    builds = controller.build_choices(session.register)
    # An engine server.yaml does not ask the node for, its choice just cleared: auto.
    build = builds.get(engine, BuildChoice("auto", BY_DEFAULT))
    return EngineBuildSet(engine, engine_build_view(engine, build), told,
                          node_view(session, controller.replicas.values(), builds))


@get("/api/nodes/{node_id:str}/engine-builds", **ADMIN, responses=refusals(401, 403, 404))
async def engine_builds(node_id: FromPath[str], controller: NamedDependency[Controller]
                        ) -> dict[str, EngineBuildView]:
    session = await registered_node(controller, node_id)
    return {name: engine_build_view(name, choice)
            for name, choice in controller.build_choices(session.register).items()}


@put("/api/nodes/{node_id:str}/engine-builds/{engine:str}", **ADMIN, dto=StrictBody,
     responses=refusals(400, 401, 403, 404, 415))
async def choose_engine_build(node_id: FromPath[str], engine: FromPath[str],
                              data: JSONBody[EngineBuildChoice],
                              controller: NamedDependency[Controller]) -> EngineBuildSet:
    return await set_engine_build(controller, node_id, engine, data.build)


ROUTES = [engine_builds, choose_engine_build]
