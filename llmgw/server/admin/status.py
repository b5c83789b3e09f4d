"""``/api/status``: the cluster as the controller sees it."""

from __future__ import annotations

from litestar import Request, get

from llmgw.server.admin.common import require


@get("/api/status")
async def status(request: Request) -> dict:
    await require(request, admin=True)
    controller = request.app.state.controller
    nodes = []
    for session in controller.sessions.all():
        inv = session.register.inventory
        nodes.append({
            "id": session.node_id,
            "address": session.register.address,
            "state": session.state.value,
            "gpus": len(inv.gpus),
            "engines": [{"name": e.name, "version": e.version, "state": e.state,
                         "detail": e.detail} for e in inv.engines],
            "fabric": inv.fabric,
        })
    replicas = [
        {
            "id": r.id, "model": r.model, "profile": r.profile, "epoch": r.epoch,
            "state": r.state.value, "reason": r.reason,
            "shards": [{"rank": s.rank, "node": s.node_id, "port": s.port, "state": s.state,
                        "detail": s.detail} for s in r.shards],
        }
        for r in sorted(controller.replicas.values(), key=lambda r: r.id)
    ]
    models = [
        {"name": m.name, "replicas_wanted": m.replicas,
         "replicas_ready": sum(1 for r in controller.replicas.values()
                               if r.model == m.name and r.state.value == "ready"),
         "unplaced": controller.unplaced.get(m.name)}
        for m in controller.catalog.models
    ]
    state = request.app.state
    logins = {"tracked_addresses": len(state.throttle),
              "throttle_capacity": state.throttle.capacity, **state.hasher.stats()}
    return {"nodes": nodes, "replicas": replicas, "models": models, "logins": logins}


ROUTES = [status]
