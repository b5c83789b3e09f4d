"""Upgrading the nodes' llmgw to the release the mirror holds (``llmgw ctl upgrade``).

``GET /api/upgrade`` is the plan: the release the mirror's bundle holds, and for each node
what an upgrade would do (its agent replaces its own installation; a NixOS node is given
the steps to run, since the system owns its llmgw). ``POST /api/nodes/{node}/upgrade``
upgrades one node, one at a time cluster-wide, and ``GET`` on it says how it goes
(server.agents.upgrades). ``llmgw ctl upgrade`` walks the nodes with these.
"""

from __future__ import annotations

import shlex
import time
from typing import Annotated

import msgspec
from litestar import Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, Parameter

from llmgw import wire
from llmgw.bundle import nix as nixcache
from llmgw.config import ServerConfig
from llmgw.core.replicas import ReplicaState
from llmgw.core.versions import newer
from llmgw.server.admin.common import ADMIN
from llmgw.server.agents.sessions import NodeSession
from llmgw.server.agents.upgrades import UpgradeBusy, UpgradeView
from llmgw.server.controller import Controller
from llmgw.server.errors import ApiError, refusals
from llmgw.server.mirror import Held, served_mirror

# NodePlan.action
UPGRADE = "upgrade"  # its agent replaces its own llmgw
CURRENT = "current"  # it runs the release already
AHEAD = "ahead"  # it runs a later release than the bundle's: left alone
NIXOS = "nixos"  # the system owns llmgw: ``steps`` say what to run on it
CANNOT = "cannot"  # ``detail`` says why (an agent too old, a node not connected)

TIMEOUT_DEFAULT_S = 900.0
TimeoutParam = Parameter(schema_extra={"minimum": 10, "maximum": 7200},
                         description="seconds the node has to be back and serving")


class NodePlan(msgspec.Struct, kw_only=True):
    node: str
    state: str
    version: str
    action: str
    detail: str
    steps: list[str] = []
    upgrade: UpgradeView | None = None


class UpgradePlan(msgspec.Struct, kw_only=True):
    # The llmgw release the mirror's bundle holds; None when it holds none.
    version: str | None
    kind: str | None  # "wheels" or "nix"
    detail: str
    nodes: list[NodePlan]
    under_way: UpgradeView | None = None


def _release(config: ServerConfig) -> tuple[Held | None, str]:
    held = served_mirror(config).held_or_none()
    if held is None:
        return None, ("this control plane serves no bundle: import one that holds llmgw "
                      "(`llmgw bundle create --wheels DIR`, then `llmgw bundle import`)")
    if held.llmgw is None:
        return None, (f"the mirror's bundle {held.folder.name} holds no llmgw release: make "
                      "one with --wheels (or --nix-closure) and import it")
    return held, (f"the mirror's bundle {held.folder.name} holds llmgw "
                  f"{held.llmgw.version} ({held.llmgw.kind})")


def _nixos_steps(held: Held | None, node: str, host: str) -> list[str]:
    """What to run on a NixOS node: its system from the bundle when the bundle holds it,
    else a rebuild."""
    release = held.llmgw if held is not None else None
    if release is not None and release.kind == "nix":
        for root in release.roots:
            if f"-nixos-system-{node}-" in root:
                copy = ["nix", *nixcache.FEATURES, "copy", "--from", f"ssh://root@{host}",
                        "--trusted-public-keys", release.nix_public_key, "--require-sigs",
                        root]
                return [shlex.join(copy), *nixcache.switch_steps([root])]
    return [f"nixos-rebuild switch --flake .#{node}   (with llmgw "
            f"{release.version if release else 'the new release'} in the flake's inputs; "
            "docs/nixos.md)"]


def _plan(session: NodeSession, held: Held | None, host: str, controller: Controller
          ) -> NodePlan:
    register = session.register
    version = register.agent_version or "unknown"
    target = held.llmgw.version if held is not None and held.llmgw is not None else None
    plan = NodePlan(node=session.node_id, state=session.state.value, version=version,
                    action=CANNOT, detail="", upgrade=controller.upgrades.get(session.node_id))
    if target is not None and version == target:
        plan.action, plan.detail = CURRENT, f"runs llmgw {target}"
    elif target is not None and newer(version, target):
        plan.action, plan.detail = AHEAD, (f"runs llmgw {version}, later than the bundle's "
                                           f"{target}: left as it is")
    elif register.installation == wire.INSTALL_NIX:
        plan.action = NIXOS
        plan.detail = "NixOS: the system owns llmgw; run these steps on the node"
        plan.steps = _nixos_steps(held, session.node_id, host)
    elif target is None:
        plan.detail = "nothing to upgrade to"
    elif wire.FEATURE_SELF_UPGRADE not in register.features:
        plan.detail = (f"its agent (llmgw {version}) cannot upgrade itself: install llmgw "
                       f"{target} on it by hand once (docs/operations.md, Upgrading)")
    elif held is not None and not held.upgrade_wheels():
        plan.detail = "the bundle holds llmgw as a Nix closure, which only NixOS nodes take"
    elif session.outbox is None:
        plan.detail = f"not connected ({session.state.value}): upgrade it once it is back"
    else:
        plan.action, plan.detail = UPGRADE, f"llmgw {version} -> {target}"
    return plan


@get("/api/upgrade", **ADMIN, responses=refusals(401, 403, 503))
async def upgrade_plan(request: Request, controller: NamedDependency[Controller],
                       config: NamedDependency[ServerConfig]) -> UpgradePlan:
    """The llmgw release the mirror holds, and what upgrading each node to it would do."""
    _leader(controller)
    held, detail = _release(config)
    controller.upgrades.refresh(time.time(), controller.replicas)
    host = request.url.hostname or "CONTROL_PLANE"
    release = held.llmgw if held is not None else None
    return UpgradePlan(
        version=release.version if release else None, kind=release.kind if release else None,
        detail=detail, nodes=[_plan(s, held, host, controller)
                              for s in controller.sessions.all()],
        under_way=controller.upgrades.under_way())


def _leader(controller: Controller) -> None:
    if not controller.holds_lead:
        raise ApiError(503, f"{controller.not_leading()}: ask the leader, which holds the "
                       "nodes' streams", code="not_leader")


def _session(controller: Controller, node_id: str) -> NodeSession:
    session = controller.sessions.get(node_id)
    if session is None:
        raise ApiError(404, f"no node {node_id!r} has registered", code="node_not_found")
    return session


@post("/api/nodes/{node_id:str}/upgrade", status_code=202, **ADMIN,
      responses=refusals(400, 401, 403, 404, 409, 503))
async def upgrade_node(request: Request, node_id: FromPath[str],
                       controller: NamedDependency[Controller],
                       config: NamedDependency[ServerConfig],
                       timeout_s: Annotated[float, TimeoutParam] = TIMEOUT_DEFAULT_S
                       ) -> UpgradeView:
    """Upgrade the node's llmgw to the mirror's release: its agent installs it and
    restarts into it, its shards left running and adopted. One node at a time; ``GET``
    this path to follow it."""
    if not 10 <= timeout_s <= 7200:
        raise ApiError(400, f"timeout_s must be 10 to 7200 seconds, not {timeout_s:g}",
                       param="timeout_s", code="invalid_value")
    _leader(controller)
    session = _session(controller, node_id)
    held, detail = _release(config)
    plan = _plan(session, held, request.url.hostname or "CONTROL_PLANE", controller)
    if plan.action != UPGRADE or held is None or held.llmgw is None:
        words = f"node {node_id}: {plan.detail}"
        if plan.steps:
            words += ": " + "; ".join(plan.steps)
        raise ApiError(409 if held is not None else 400, words if held else detail,
                       code=f"upgrade_{plan.action}")
    # What it serves now (its Register lists only what ran when it connected).
    serving = [(replica.id, shard.rank) for replica in controller.replicas.values()
               if replica.state is ReplicaState.READY
               for shard in replica.shards if shard.node_id == node_id]
    try:
        return controller.upgrades.begin(
            node_id, held.llmgw.version, held.upgrade_wheels(),
            session.register.agent_version, serving, time.time(), timeout_s)
    except UpgradeBusy as err:
        raise ApiError(409, str(err), code="upgrade_busy") from None


@get("/api/nodes/{node_id:str}/upgrade", **ADMIN, responses=refusals(401, 403, 404, 503))
async def node_upgrade(node_id: FromPath[str], controller: NamedDependency[Controller]
                       ) -> UpgradeView:
    """How the node's last upgrade (on this leader) went, or goes."""
    _leader(controller)
    controller.upgrades.refresh(time.time(), controller.replicas)
    found = controller.upgrades.get(node_id)
    if found is None:
        _session(controller, node_id)
        raise ApiError(404, f"node {node_id} has not been upgraded since this server took "
                       "the lead", code="no_upgrade")
    return found


ROUTES = [upgrade_plan, upgrade_node, node_upgrade]
