"""``llmgw server``: open the store, load the catalog, and serve on granian."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from pathlib import Path

import msgspec
from granian.constants import Interfaces
from granian.server.embed import Server as Granian

from llmgw.config import ServerConfig
from llmgw.core.catalog import Catalog, catalog_from_config
from llmgw.server.app import build
from llmgw.server.auth import load_or_create_admin_token
from llmgw.store import Store, open_store, sqlite_url
from llmgw.store.lock import hold_state_lock

log = logging.getLogger(__name__)


def store_url(config: ServerConfig) -> str:
    return config.store.url or sqlite_url(Path(config.state_dir) / "llmgw.db")


async def sync_catalog(store: Store, catalog: Catalog, config: ServerConfig) -> None:
    """server.yaml declares the models; the store keeps the same list for the API to read."""
    declared = {m.name: m for m in config.models}
    for name, model in declared.items():
        await store.put_model(name, msgspec.to_builtins(model))
    for stored in await store.list_models():
        if stored.name not in declared:
            await store.delete_model(stored.name)
    log.info("catalog: %s", ", ".join(catalog.names()) or "no models declared")


class _QuietEmbedWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Embedded server is experimental" not in record.getMessage()


async def serve(config: ServerConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until SIGINT/SIGTERM. ``ready`` is set once the listener is up."""
    catalog = catalog_from_config(config.models)
    Path(config.state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    # Held for the server's life: `llmgw store` operations refuse while it runs.
    with hold_state_lock(config.state_dir):
        await _serve(config, catalog, ready)


async def _serve(config: ServerConfig, catalog: Catalog, ready: asyncio.Event | None) -> None:
    admin_token, created = load_or_create_admin_token(config.state_dir)
    if created:
        log.info("made a new admin token in %s/secrets/admin-token", config.state_dir)
    store = await open_store(store_url(config))
    try:
        await sync_catalog(store, catalog, config)
        server = build(config, store, catalog, admin_token)
        logging.getLogger("_granian").addFilter(_QuietEmbedWarning())
        granian = Granian(
            server.app,
            address=config.listen.host,
            port=config.listen.port,
            interface=Interfaces.ASGI,
            websockets=True,
            log_enabled=False,
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, granian.stop)
        log.info("serving on http://%s:%d", config.listen.host, config.listen.port)
        _tune_gc()
        task = asyncio.create_task(granian.serve())
        if ready is not None:
            ready.set()
        await task
    finally:
        await store.close()


def _tune_gc() -> None:
    """What is loaded at start lives for the process's life: freeze it out of the cyclic
    collector's view, and collect the young generation less often. Each proxied request
    allocates a few hundred short-lived objects; with the default threshold (700) a
    collection ran every few requests (measured: about 15 % of the gateway's CPU)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
