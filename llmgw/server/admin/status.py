"""``/api/status``: the cluster as the controller sees it."""

from __future__ import annotations

from litestar import Request, get

from llmgw.server.admin.common import require
from llmgw.server.admin.nodes import node_json


@get("/api/status")
async def status(request: Request) -> dict:
    await require(request, admin=True)
    controller = request.app.state.controller
    in_flight = request.app.state.router.in_flight()
    nodes = [node_json(s, controller.replicas.values()) for s in controller.sessions.all()]
    replicas = [
        {
            "id": r.id, "model": r.model, "profile": r.profile, "epoch": r.epoch,
            "state": r.state.value, "reason": r.reason, "in_flight": in_flight.get(r.id, 0),
            "shards": [{"rank": s.rank, "node": s.node_id, "port": s.port, "state": s.state,
                        "detail": s.detail} for s in r.shards],
        }
        for r in sorted(controller.replicas.values(), key=lambda r: r.id)
    ]
    sessions = controller.sessions.all()
    models = [
        {"name": m.name, "replicas_wanted": m.replicas, "priority": m.priority,
         "weights_in_fabrics": sorted({h["fabric"] for h in weights_held(m, sessions)
                                       if h["fabric"]}),
         "weights": weights_held(m, sessions),
         "replicas_ready": sum(1 for r in controller.replicas.values()
                               if r.model == m.name and r.state.value == "ready"),
         "unplaced": controller.unplaced.get(m.name)}
        for m in controller.catalog.models
    ]
    state = request.app.state
    logins = {"tracked_addresses": len(state.throttle),
              "throttle_capacity": state.throttle.capacity, **state.hasher.stats()}
    return {"nodes": nodes, "replicas": replicas, "models": models, "logins": logins}


def weights_held(model, sessions) -> list[dict]:
    """Where the model's weights are, per fabric: weights in one fabric are no use in
    another without a slow copy over the management network. A shared filer counts once,
    however many nodes see it."""
    keys = {model.weights_key(p) for p in model.profiles}
    fabrics: dict[str | None, dict] = {}
    for session in sessions:
        inv = session.register.inventory
        for directory in inv.weights_dirs or [None]:
            held = set(directory.held) if directory else set(inv.weights)
            if not held & keys:
                continue
            entry = fabrics.setdefault(inv.fabric, {"fabric": inv.fabric, "nodes": [],
                                                    "shared": []})
            if directory is not None and directory.shared:
                if directory.path not in entry["shared"]:
                    entry["shared"].append(directory.path)
            elif session.node_id not in entry["nodes"]:
                entry["nodes"].append(session.node_id)
    return sorted(fabrics.values(), key=lambda e: (e["fabric"] is None, e["fabric"] or ""))


ROUTES = [status]
