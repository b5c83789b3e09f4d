"""The gateway without a whole llmgw server, for tests that drive its routes in process:
the server state they read (a catalog of one model, a real router and upstream pool, real
metrics), and the routes served on llmgw's HTTP server in front of a test's engine."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace

import msgspec
import uvicorn

from llmgw.config import Gateway, Listen, Model
from llmgw.core.catalog import catalog_from_config
from llmgw.core.inventory import Timeouts
from llmgw.server.agents.sessions import NodeSessions
from llmgw.server.listen import listening_socket
from llmgw.server.metrics import Metrics
from llmgw.server.openai import routes
from llmgw.server.openai.proxy import upstream_pool
from llmgw.server.openai.router import Router
from llmgw.transport.server import make_server


def gateway_state(model: str, router: Router, pool,
                  gateway: Gateway | None = None) -> SimpleNamespace:
    """What ``routes`` reads of its ``GatewayContext``: ``model`` declared (on the sim
    engine), no API keys required, no replica known to the controller (the router holds
    the replicas) nor on its way; ``gateway`` settings as given, else the defaults."""
    models = [msgspec.convert({"name": model, "profiles": [{"engine": "sim"}]}, Model)]
    controller = SimpleNamespace(catalog=catalog_from_config(models), replicas={},
                                 sessions=NodeSessions(Timeouts()),
                                 why_not_ready=lambda model: "no replica is ready",
                                 expecting=lambda model: False, sleepy=frozenset(),
                                 wake_left=lambda model: 0.0)
    return SimpleNamespace(router=router, upstream=pool, controller=controller, awaiting={},
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


class CountingFront(routes.GatewayFront):
    """The GatewayFront, counting the requests ``serve_now`` took (``served_now``): how
    a test sees which path served a request."""

    def __init__(self, app, state) -> None:
        super().__init__(app, state)
        self.served_now = 0

    def serve_now(self, *args) -> bool:
        taken = super().serve_now(*args)
        self.served_now += taken
        return taken


Answer = Callable[[bytes, bytes, asyncio.StreamReader, asyncio.StreamWriter],
                  Awaitable[bool | None]]


def engine_answering(answer: Answer):
    """An ``asyncio.start_server`` handler for a kept-alive test engine: each request's
    head and body (read by its content-length) go to ``answer(head, body, reader,
    writer)``, which writes the answer; it returns False to end the connection."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                if await answer(head, body, reader, writer) is False:
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return serve


@contextlib.asynccontextmanager
async def gateway_in_process(model: str, engine, gateway: Gateway | None = None
                             ) -> AsyncIterator[int]:
    """The gateway's routes on llmgw's HTTP server on loopback, in front of one replica of
    ``model``: an engine served by ``engine`` (an ``asyncio.start_server`` handler). Yields
    the server's port; stops the server, the pool and the engine after."""
    async with gateway_front_in_process(model, engine, gateway) as running:
        yield running.port


@contextlib.asynccontextmanager
async def gateway_front_in_process(model: str, engine, gateway: Gateway | None = None,
                                   *, plain_uvicorn: bool = False
                                   ) -> AsyncIterator[SimpleNamespace]:
    """``gateway_in_process``, yielding the app and the server too: ``port``, ``front``
    (a CountingFront) and ``server``. With ``plain_uvicorn``, on uvicorn's own protocol
    instead of llmgw's server: an ASGI server that offers no BodyWriter and serves nothing
    from callbacks."""
    engine_server = await asyncio.start_server(engine, "127.0.0.1", 0)
    router = Router(rng=random.Random(1))
    router.update({model: [("r0", "127.0.0.1", engine_server.sockets[0].getsockname()[1])]})
    pool = upstream_pool(gateway or Gateway())
    sock, _ = listening_socket(Listen(host="127.0.0.1", port=0))
    app = CountingFront(lifespan_only, gateway_state(model, router, pool, gateway))
    if plain_uvicorn:
        server = uvicorn.Server(uvicorn.Config(app, loop="none", http="httptools",
                                               lifespan="on", log_config=None,
                                               access_log=False))
    else:
        server = make_server(app, sock)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield SimpleNamespace(port=sock.getsockname()[1], front=app, server=server)
    finally:
        if plain_uvicorn:
            server.should_exit = True
        else:
            server.stop()
        await asyncio.wait_for(serving, 15)
        await pool.close()
        engine_server.close()
        await engine_server.wait_closed()
