"""``/api/status``: the cluster as the controller sees it."""

from __future__ import annotations

from litestar import Request, get

from llmgw.server.admin.common import require
from llmgw.server.admin.nodes import node_json


@get("/api/status")
async def status(request: Request) -> dict:
    await require(request, admin=True)
    controller = request.app.state.controller
    nodes = [node_json(s, controller.replicas.values()) for s in controller.sessions.all()]
    replicas = [
        {
            "id": r.id, "model": r.model, "profile": r.profile, "epoch": r.epoch,
            "state": r.state.value, "reason": r.reason,
            "shards": [{"rank": s.rank, "node": s.node_id, "port": s.port, "state": s.state,
                        "detail": s.detail} for s in r.shards],
        }
        for r in sorted(controller.replicas.values(), key=lambda r: r.id)
    ]
    sessions = controller.sessions.all()

    def fabrics_holding(model: str) -> list[str]:
        # Per fabric: weights in one fabric are no use in another without a slow copy.
        return sorted({s.register.inventory.fabric for s in sessions
                       if model in s.register.inventory.weights and s.register.inventory.fabric})

    models = [
        {"name": m.name, "replicas_wanted": m.replicas, "priority": m.priority,
         "weights_in_fabrics": fabrics_holding(m.name),
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
