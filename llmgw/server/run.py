"""``llmgw server``: open the store, load the catalog, and serve (llmgw.transport.server)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path

from litestar.types import ASGIApp

from llmgw.config import ConfigError, Listen, ServerConfig
from llmgw.core.catalog import Catalog, catalog_from_config
from llmgw.core.names import is_loopback_host
from llmgw.server.agents.live import LiveStreams
from llmgw.server.app import build
from llmgw.server.auth import load_admin_token
from llmgw.server.catalog import sync_declared
from llmgw.server.listen import listening_socket
from llmgw.server.reload import Reloader
from llmgw.store import Store, open_store
from llmgw.store.lock import hold_state_lock
from llmgw.store.urls import store_url
from llmgw.transport.server import make_server

log = logging.getLogger(__name__)


async def sync_catalog(store: Store, config: ServerConfig) -> Catalog:
    """The catalog to serve: server.yaml's models (mirrored into the store, with any
    replicas override set over the API) and the models added over the API."""
    catalog = await sync_declared(store, config)
    log.info("catalog: %s", ", ".join(catalog.names()) or "no models declared")
    return catalog


def check_plain_http(config: ServerConfig) -> None:
    """Plain HTTP is for loopback, or a network the operator vouched for."""
    listen = config.listen
    if (config.tls is not None or listen.allow_plain_http or listen.host == "localhost"
            or is_loopback_host(listen.host)):
        return
    raise ConfigError(
        f"listen.host is {listen.host}, not a loopback address, and server.yaml has no tls "
        "block: passwords, API keys and the agent stream would cross the network in plain "
        "text. Run `llmgw server init` for a CA and certificates (it writes tls), or set "
        "listen.allow_plain_http: true on a network you trust")


@dataclass
class Restart:
    """Asked for by the setup form once server.yaml names another store: the server
    stopped as on SIGTERM, and is started again in this process (same PID, so systemd and
    `llmgw up` see no exit), on the socket systemd passed if it passed one."""

    passed_fd: int | None = None  # a duplicate of systemd's socket, kept open for the exec

    def exec(self) -> None:
        if self.passed_fd is not None:
            os.dup2(self.passed_fd, 3)  # sd_listen_fds' first
            os.set_inheritable(3, True)
            os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1")
        log.info("starting again: %s", " ".join(sys.argv))
        logging.shutdown()
        os.execv(sys.executable, [sys.executable, *sys.argv])


async def serve(config: ServerConfig, ready: asyncio.Event | None = None,
                config_path: Path | None = None) -> Restart | None:
    """Serve until SIGINT/SIGTERM, or until a restart is asked for (returned, to be
    exec'd once the store and the lock are let go). ``ready`` is set once the listener is
    up; ``config_path``, server.yaml, is where the setup form may point the store."""
    check_plain_http(config)
    catalog = catalog_from_config(config.models)
    Path(config.state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    # Held for the server's life: `llmgw store` operations refuse while it runs.
    with hold_state_lock(config.state_dir):
        return await _serve(config, catalog, ready, config_path)


async def _serve(config: ServerConfig, catalog: Catalog, ready: asyncio.Event | None,
                 config_path: Path | None) -> Restart | None:
    admin_token, created = load_admin_token(config.state_dir, config.auth.admin_token_file)
    if created:
        log.info("made a new admin token in %s/secrets/admin-token", config.state_dir)
    store = await open_store(store_url(config))
    try:
        catalog = await sync_catalog(store, config)
        server = build(config, store, catalog, admin_token)
        live = LiveStreams()
        # POST /api/nodes/NAME/revoke closes the node's live mTLS streams at once.
        server.app.state.on_revoked.append(live.on_revoked)
        tls = config.tls
        agents = None
        if tls:
            # Only here: the listener brings aiohttp, which nothing else in a server needs.
            from llmgw.server.agents.mtls import AgentListener

            agents = AgentListener(tls, server.controller, store, live)
        # On the socket systemd passed (llmgw-server.socket) if any: restarts refuse nothing.
        passed = "LISTEN_PID" in os.environ
        sock, where = listening_socket(config.listen)
        # /v1 and the admin API over TLS with the server's certificate; no client certificate.
        stop, serving = _http_server(config.listen, server.asgi, sock,
                                     (Path(tls.cert_file), Path(tls.key_file)) if tls else None)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        # `systemctl reload`: server.yaml read again, what can apply live applied.
        loop.add_signal_handler(signal.SIGHUP, Reloader(server, config_path).on_signal)
        restart: list[Restart] = []

        def stop_and_restart() -> None:
            if not restart:
                # The HTTP server closes the socket as it stops: systemd's is kept.
                restart.append(Restart(os.dup(sock.fileno()) if passed else None))
                stop()

        server.app.state.config_path = config_path
        server.app.state.restart = stop_and_restart
        log.info("serving on %s://%s (%s)", "https" if tls else "http", where,
                 config.listen.server)
        _tune_gc()
        if agents is not None:
            await agents.start()
        try:
            task = asyncio.create_task(serving)
            if ready is not None:
                ready.set()
            await task
        finally:
            if agents is not None:
                await agents.stop()
        return restart[0] if restart else None
    finally:
        await store.close()


def _http_server(listen: Listen, app: ASGIApp, sock: socket.socket,
                 tls: tuple[Path, Path] | None) -> tuple[Callable[[], None], Coroutine]:
    """The HTTP server ``listen.server`` names, for ``app`` on ``sock``: its stop (the
    first finishes requests in flight, a second ends them) and its run."""
    if listen.server == "granian":
        # Only here: a server on uvicorn never loads granian.
        from llmgw.server.serve_granian import GranianServer

        granian = GranianServer(app, sock, tls)
        return granian.stop, granian.serve()
    http = make_server(app, sock, tls)
    return http.stop, http.serve(sockets=[sock])


def _tune_gc() -> None:
    """What is loaded at start lives for the process's life: freeze it out of the cyclic
    collector's view, and collect the young generation less often. Each proxied request
    allocates a few hundred short-lived objects; with the default threshold (700) a
    collection ran every few requests (measured: about 15 % of the gateway's CPU)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
