"""``GET /api/metrics/targets``: every node the controller knows, in Prometheus' HTTP
service discovery format (https://prometheus.io/docs/prometheus/latest/http_sd/).

Prometheus asks this every minute or so (``http_sd_configs``) and scrapes a per-node
exporter (node_exporter by default, on ``?port=`` 9100) at each node's address as it
registered, so a node that joins is scraped without anyone editing prometheus.yml. Each
target carries the labels ``node`` (the node's id) and ``fabric`` (empty where it has
none, which Prometheus drops).

Who may ask is who may scrape ``/metrics`` (:class:`llmgw.server.metrics.Access`): the
list names every node's address, no more than ``/metrics`` tells about the cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec
from litestar import Request, get
from litestar.di import NamedDependency
from litestar.params import Parameter

from llmgw.core.names import hostport
from llmgw.server.dependencies import from_states
from llmgw.server.errors import ApiError, refusals
from llmgw.server.metrics import Metrics

if TYPE_CHECKING:
    from llmgw.server.controller import Controller

NODE_EXPORTER_PORT = 9100


class TargetGroup(msgspec.Struct):
    """One node: the address to scrape and the labels its series get."""

    targets: list[str]
    labels: dict[str, str]


def target_groups(controller: Controller, port: int) -> list[TargetGroup]:
    """One group per node the controller knows, by node id."""
    return [TargetGroup([hostport(s.register.address, port)],
                        {"node": s.node_id, "fabric": s.register.inventory.fabric or ""})
            for s in controller.sessions.all()]


# Bounds checked by the handler, which says what is wrong; the document states them.
PortParam = Parameter(schema_extra={"minimum": 1, "maximum": 65535},
                      description="the exporter's port on every node (node_exporter's: 9100)")


@get("/api/metrics/targets", dependencies=from_states("metrics", "admin_token"),
     responses=refusals(400, 401, 404))
async def metrics_targets(request: Request, metrics: NamedDependency[Metrics],
                          admin_token: NamedDependency[str],
                          port: Annotated[int, PortParam] = NODE_EXPORTER_PORT,
                          ) -> list[TargetGroup]:
    """Every node the controller knows as a Prometheus HTTP SD target group: the node's
    registered address with ``port``, labels ``node`` and ``fabric``. Open to whom
    ``/metrics`` is: a request from the server's own host, or one with the metrics or
    admin token."""
    refusal = metrics.access.refusal(request, admin_token, "/api/metrics/targets")
    if refusal is not None:
        raise refusal
    if not 1 <= port <= 65535:
        raise ApiError(400, f"port must be a TCP port, 1 to 65535, not {port}", param="port",
                       code="invalid_value")
    return target_groups(metrics.controller, port)
