"""Assembling the server: the Litestar app, its controller, and the listener.

Configuration is passed in, never read at import time, so tests build as many servers as
they like in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
from litestar import HttpMethod, Litestar, Request, Response, get, route
from litestar.datastructures import State
from litestar.exceptions import HTTPException, ValidationException
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components
from litestar.types import ASGIApp

from llmgw.config import ServerConfig
from llmgw.core import reconcile
from llmgw.core.catalog import Catalog
from llmgw.core.inventory import Timeouts
from llmgw.core.throttle import LoginThrottle
from llmgw.server import admin, ui
from llmgw.server.admin import join as join_routes
from llmgw.server.admin.common import StructSchemas, empty_body_refusal
from llmgw.server.agents.sessions import NodeSessions
from llmgw.server.agents.stream import agent_stream
from llmgw.server.auth import KeyCache, guards
from llmgw.server.auth.passwords import PasswordHasher
from llmgw.server.controller import Controller
from llmgw.server.dependencies import from_states
from llmgw.server.endpoints import config_secrets
from llmgw.server.errors import ApiError, error_response, store_refusal
from llmgw.server.leadership import Leadership, server_name
from llmgw.server.metrics import Access, Metrics, metrics_endpoint
from llmgw.server.metrics_targets import metrics_targets
from llmgw.server.mirror import mirror_route
from llmgw.server.openai import routes as openai_routes
from llmgw.server.openai import spec
from llmgw.server.openai.admission import GatewayContext
from llmgw.server.openai.proxy import upstream_pool
from llmgw.server.openai.router import Router
from llmgw.server.openai.trail import trail_for
from llmgw.server.openai.usage import UsageRecorder
from llmgw.server.probe import EngineProbe
from llmgw.store import Store, StoreError, StoreSchemaMissing, StoreUnavailable
from llmgw.tracing import Tracing

log = logging.getLogger(__name__)


@dataclass
class Server:
    app: Litestar
    controller: Controller
    router: Router
    gateway: GatewayContext
    leadership: Leadership

    @property
    def asgi(self) -> ASGIApp:
        """What the HTTP server runs: the gateway's POSTs first, then Litestar."""
        return openai_routes.gateway_first(self.app, self.gateway)


class Health(msgspec.Struct):
    # "ok", or "degraded" while the store does not answer (routes known serve on).
    status: str
    # The server's clock (Unix time): an agent's doctor measures its skew against it.
    time: float
    # "ok", "unreachable" or "schema missing": as the store last answered, not asked anew.
    store: str = "ok"
    # This server's name, whether it leads the cluster now, and who does as it last read.
    server: str = ""
    leader: bool = False
    leader_name: str | None = None


@get("/healthz", dependencies=from_states("store", "leadership"))
async def healthz(store: Store, leadership: Leadership) -> Health:
    outage = store.outage
    lease = leadership.leader
    lead = dict(server=leadership.name, leader=leadership.leads(),
                leader_name=lease.holder if lease is not None and lease.live else None)
    if outage is None:
        return Health("ok", time.time(), **lead)
    return Health("degraded", time.time(),
                  "schema missing" if isinstance(outage, StoreSchemaMissing) else "unreachable",
                  **lead)


# The whole API, /v1 and /api, described for OpenAPI clients and tools: the shapes of
# requests and answers, nothing of this cluster's models, keys or accounts. So it is
# served to anyone, as the code it describes is public.
def _openapi() -> OpenAPIConfig:
    return OpenAPIConfig(
        title="llmgw",
        version="",  # llmgw's own, filled in when first served (GatewayDocument)
        description="`/v1`: the OpenAI API, in front of the cluster's engines. `/api`: "
                    "the cluster's administration (`llmgw ctl`). Every refusal is an "
                    "OpenAI error envelope.",
        path="/openapi.json",
        # At /openapi.json itself (the router's root), and nowhere else that serves JSON.
        render_plugins=[spec.GatewayDocument(path=["/", "/openapi.json"])],
        components=Components(security_schemes={**guards.SECURITY_SCHEMES,
                                                **spec.SECURITY_SCHEMES}),
        use_handler_docstrings=True,
    )


def _api_error(_: Request, exc: ApiError) -> Response:
    return exc.response()


def _http_error(request: Request, exc: HTTPException) -> Response:
    if isinstance(exc, ValidationException) and (
            refusal := empty_body_refusal(request, exc)) is not None:
        return refusal.response()
    status = exc.status_code
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if status == 404:
        message = f"there is no {request.method} {request.url.path} here"
    elif status == 405:
        message = f"{request.url.path} does not take {request.method}"
    return error_response(status, message, headers=getattr(exc, "headers", None))


def _store_unavailable(_: Request, exc: StoreUnavailable) -> Response:
    # Not logged here: the store logs an outage once, when it starts.
    return store_refusal(exc).response()


def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error serving %s %s", request.method, request.url.path)
    return error_response(500, "internal error; the server's log has the details",
                          code="internal_error")


def _options_for(handlers: list) -> HTTPRouteHandler:
    """One OPTIONS answer for every path of ``handlers``, naming every method the path
    takes. Litestar 2's own names only the methods of the path's first handler: with
    ``@get`` and ``@post`` on /api/users it said ``GET, OPTIONS`` (litestar#4169, fixed
    in its 3.x). Registered before the others, it stands in for Litestar's."""
    paths = sorted({path for h in handlers if isinstance(h, HTTPRouteHandler)
                    for path in h.paths})
    # A request's scope names its path as /api/keys/{prefix}, the routes as
    # /api/keys/{prefix:str}.
    by_template = {re.sub(r"\{(\w+):[^}]*\}", r"{\1}", path): path for path in paths}

    @route(paths, http_method=HttpMethod.OPTIONS, include_in_schema=False,
           sync_to_thread=False)
    def options(request: Request) -> Response:
        path = by_template[request.scope["path_template"]]
        methods = request.app.route_handler_method_map[path]
        return Response(None, status_code=204, headers={"allow": ", ".join(sorted(methods))})

    return options


_HOUSEKEEPING_S = 600.0


async def _housekeeping(store: Store) -> None:
    """Forget expired sessions and ended usage windows, so neither table grows forever."""
    while True:
        try:
            removed = await store.delete_expired_sessions(datetime.now(UTC))
            if removed:
                log.info("removed %d expired session(s)", removed)
            await store.prune_usage_windows(datetime.now(UTC))
        except StoreError as err:
            log.warning("housekeeping: %s", err)
        await asyncio.sleep(_HOUSEKEEPING_S)


def build(config: ServerConfig, store: Store, catalog: Catalog, admin_token: str,
          tracing: Tracing | None = None) -> Server:
    """``tracing``: instead of one built from ``config.tracing`` (a test's exporter)."""
    timeouts = Timeouts(config.nodes.unreachable_after_s, config.nodes.lost_after_s)
    policy = reconcile.Policy(
        restart_backoff_initial_s=config.controller.restart_backoff_initial_s,
        restart_backoff_max_s=config.controller.restart_backoff_max_s,
        restart_backoff_reset_s=config.controller.restart_backoff_reset_s,
        adoption_grace_s=config.controller.adoption_grace_s,
    )
    controller = Controller(catalog, store, NodeSessions(timeouts), policy,
                            interval_s=config.controller.interval_s,
                            heartbeat_interval_s=config.nodes.heartbeat_interval_s,
                            settings=config,
                            follow_interval_s=config.controller.follow_interval_s)
    name = config.name or server_name(config.listen.host, config.listen.port)
    tracing = tracing or Tracing(config.tracing, default_service="llmgw-server",
                                 instance=name)
    controller.tracing = tracing
    leadership = Leadership(store, name, f"{config.listen.host}:{config.listen.port}",
                            config.controller.lease_s)
    leadership.on_lead(controller.took_lead)
    leadership.on_deposed(controller.deposed)
    leadership.on_servers(lambda _: controller.changed())
    controller.leading = leadership.leads
    controller.holds_lead = False  # until leadership.start() takes the lease
    controller.not_leading = lambda: (f"{name} does not lead the cluster; "
                                      f"{leadership.describe_leader()}")
    controller.servers = leadership.servers_up
    probe = EngineProbe(controller)
    # Static endpoints' keys and CA files: a ConfigError naming the key path of one that
    # cannot be read (server/endpoints.py).
    controller.endpoints.use(config_secrets(config.models))
    router = Router(queue_max=config.gateway.queue_max,
                    queue_wait_s=config.gateway.queue_wait_s,
                    epsilon=config.gateway.affinity_epsilon)
    controller.on_change(lambda c: router.update(c.ready_endpoints()))
    controller.load = router.in_flight
    usage = UsageRecorder(store)
    metrics = Metrics(controller, router, Access.from_config(config), stats=controller.stats,
                      store=store, tls=config.tls,
                      trail=trail_for(config, tracing, controller))
    auth = config.auth
    throttle = LoginThrottle(auth.login_attempts, auth.login_window_s,
                             auth.login_throttle_capacity)
    hasher = PasswordHasher(auth.hash_slots, auth.argon2_memory_kib, auth.argon2_time_cost,
                            auth.argon2_parallelism)

    gateway = GatewayContext(
        config=config, controller=controller, router=router, store=store, metrics=metrics,
        usage=usage, api_keys=KeyCache(store, auth.key_cache_s))

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        gateway.upstream = upstream = upstream_pool(config.gateway)
        with contextlib.suppress(StoreUnavailable):  # the store logged it; runs from memory
            await controller.load_table()
        await leadership.start()
        tasks = [asyncio.create_task(leadership.run(), name="leadership"),
                 asyncio.create_task(probe.run(), name="engine-probe"),
                 asyncio.create_task(controller.endpoints.run(lambda: controller.catalog,
                                                             controller.changed),
                                     name="endpoint-checks"),
                 asyncio.create_task(controller.run(), name="controller"),
                 asyncio.create_task(_housekeeping(store), name="housekeeping"),
                 asyncio.create_task(usage.run(), name="usage"),
                 asyncio.create_task(gateway.api_keys.run(), name="api-keys")]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await leadership.stop()
            await upstream.close()
            await asyncio.to_thread(tracing.shutdown)  # sends what is batched

    handlers = [healthz, metrics_endpoint, metrics_targets, agent_stream, mirror_route,
                *openai_routes.ROUTES, *admin.ROUTES, *join_routes.ROUTES]
    app = Litestar(
        route_handlers=[_options_for(handlers), *handlers, ui.router()],
        template_config=ui.template_config(),
        lifespan=[lifespan],
        state=State({
            "config": config, "store": store, "controller": controller, "router": router,
            "leadership": leadership, "tracing": tracing,
            "admin_token": admin_token, "started_at": time.time(),
            "throttle": throttle, "hasher": hasher, "metrics": metrics, "usage": usage,
            "api_keys": gateway.api_keys, "gateway": gateway,
            # join.RevokedCallback: awaited with (node, serials) after a revocation.
            "on_revoked": [],
            # Changes to the catalog, one at a time.
            "models_lock": asyncio.Lock(),
            "cluster_ca": join_routes.ClusterCa(config),
        }),
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            StoreUnavailable: _store_unavailable,
            Exception: _unexpected,
        },
        # Bodies are forwarded to engines; prompts with images can be large, but bounded.
        request_max_body_size=64 * 2**20,
        openapi_config=_openapi(),
        plugins=[StructSchemas()],
        logging_config=None,
    )
    return Server(app, controller, router, gateway, leadership)
