"""Nodes over the admin API: what each reports, and draining one for maintenance."""

from __future__ import annotations

from litestar import Request, get, post
from litestar.params import FromPath

from llmgw.server.admin.common import require
from llmgw.server.errors import ApiError


def node_json(session, replicas) -> dict:
    inv = session.register.inventory
    warnings = []
    flags = set(inv.cpu_flags)
    if flags and "avx2" not in flags and not flags & {"neon", "asimd"}:
        warnings.append("CPU without AVX2: CPU engines run several times slower; on a VM, "
                        "give it the host's CPU model (e.g. QEMU -cpu host)")
    beat = session.last_heartbeat
    free = beat.weights_free_mib if beat else []
    if len(free) != len(inv.weights_dirs):  # the heartbeat lists them in inventory order
        free = [d.free_mib for d in inv.weights_dirs]
    return {
        "id": session.node_id,
        "address": session.register.address,
        "state": session.state.value,
        "fabric": inv.fabric,
        "labels": inv.labels,
        "gpus": [{"index": g.index, "name": g.name, "memory_total_mib": g.memory_total_mib,
                  "memory_free_mib": g.memory_free_mib} for g in inv.gpus],
        "engines": [{"name": e.name, "version": e.version, "state": e.state,
                     "detail": e.detail} for e in inv.engines],
        "disabled_engines": inv.disabled_engines,
        "weights": inv.weights,
        "weights_dirs": [{"path": d.path, "shared": d.shared, "total_mib": d.total_mib,
                          "free_mib": f, "held": d.held, "note": d.note}
                         for d, f in zip(inv.weights_dirs, free, strict=True)],
        "gpu_driver": inv.gpu_driver, "cuda": inv.cuda,
        "rdma": [{"adapter": p.adapter, "port": p.port, "state": p.state,
                  "rate_gbps": p.rate_gbps, "link_layer": p.link_layer} for p in inv.rdma],
        "replicas": sorted(r.id for r in replicas
                           if any(s.node_id == session.node_id for s in r.shards)),
        "warnings": warnings,
    }


@get("/api/nodes")
async def list_nodes(request: Request) -> list[dict]:
    await require(request, admin=True)
    controller = request.app.state.controller
    return [node_json(s, controller.replicas.values()) for s in controller.sessions.all()]


async def _drain(request: Request, node_id: str, draining: bool) -> dict:
    await require(request, admin=True)
    controller = request.app.state.controller
    if controller.sessions.get(node_id) is None:
        raise ApiError(404, f"no node {node_id!r} has registered", code="node_not_found")
    await controller.set_draining(node_id, draining)
    session = controller.sessions.get(node_id)
    return node_json(session, controller.replicas.values())


@post("/api/nodes/{node_id:str}/drain", status_code=200)
async def drain(request: Request, node_id: FromPath[str]) -> dict:
    return await _drain(request, node_id, True)


@post("/api/nodes/{node_id:str}/undrain", status_code=200)
async def undrain(request: Request, node_id: FromPath[str]) -> dict:
    return await _drain(request, node_id, False)


ROUTES = [list_nodes, drain, undrain]
