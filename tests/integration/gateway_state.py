"""The server state the gateway's routes read, for tests that drive them without a whole
llmgw server: a catalog of one model, a real router and upstream pool, real metrics."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from llmgw.config import Gateway, Model
from llmgw.core.catalog import catalog_from_config
from llmgw.core.inventory import Timeouts
from llmgw.server.agents.sessions import NodeSessions
from llmgw.server.metrics import Metrics
from llmgw.server.openai.router import Router


def gateway_state(model: str, router: Router, pool,
                  gateway: Gateway | None = None) -> SimpleNamespace:
    """What ``routes`` reads of ``app.state``: ``model`` declared (on the sim engine), no API
    keys required, no replica known to the controller (the router holds the replicas);
    ``gateway`` settings as given, else the defaults."""
    models = [msgspec.convert({"name": model, "profiles": [{"engine": "sim"}]}, Model)]
    controller = SimpleNamespace(catalog=catalog_from_config(models), replicas={},
                                 sessions=NodeSessions(Timeouts()),
                                 why_not_ready=lambda model: "no replica is ready")
    return SimpleNamespace(router=router, upstream=pool, controller=controller,
                           config=SimpleNamespace(gateway=gateway or Gateway(),
                                                  auth=SimpleNamespace(require_api_key=False)),
                           metrics=Metrics(controller, router, process=False))


async def lifespan_only(scope, receive, send) -> None:
    """The app behind ``routes.gateway_first`` for tests that send it only /v1 POSTs."""
    assert scope["type"] == "lifespan", "only /v1 POSTs are sent here"
    while (message := await receive())["type"] != "lifespan.shutdown":
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})
