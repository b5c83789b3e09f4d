"""Reloading server.yaml without a restart (SIGHUP, ``systemctl reload llmgw-server``).

Load, compare, apply: the file is read and checked whole first, so a file with an error
changes nothing; ``core.config_change`` then says which changed keys apply at once and
which keep their running value until a restart (named in one log line). What applies is
handed to every part that holds the config: the app's state (the admin API, the page, the
auth checks), the gateway, the controller, the router's queue and affinity settings, and
the catalog, synced into the store again and handed to the controller, as a change over
the admin API is.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from llmgw.config import ConfigError, ServerConfig, load, parse
from llmgw.core.catalog import CatalogError, catalog_from_config
from llmgw.core.config_change import ConfigChange, compare, effective
from llmgw.server.app import Server
from llmgw.server.catalog import sync_declared
from llmgw.server.endpoints import config_secrets
from llmgw.store import StoreError

log = logging.getLogger(__name__)

_RESTART_HINT = "restart the server to apply (systemctl restart llmgw-server)"


@dataclass(frozen=True)
class ReloadResult:
    """What a reload did: the keys it applied and those left for a restart, or the error
    that left everything as it was."""

    change: ConfigChange = field(default_factory=ConfigChange)
    error: str | None = None


def _checked(path: Path, running: ServerConfig) -> tuple[ServerConfig, ConfigChange]:
    """The config to run on after the reload, and what changed; a ConfigError (or
    CatalogError) naming the file and key path when it cannot be used."""
    new = load(path, ServerConfig)
    change = compare(running, new)
    merged = effective(running, new, change)
    # Checked again as it will run: keys kept from the running file must still fit the
    # new ones (auth.require_api_key: false needs the running listen.host on loopback).
    parse(msgspec.to_builtins(merged), ServerConfig, str(path))
    try:
        catalog_from_config(merged.models)
    except CatalogError as err:
        raise ConfigError(f"{path}: {err}") from None
    return merged, change


def _hand_out(server: Server, config: ServerConfig) -> None:
    """Every holder of the running config gets the new one."""
    server.app.state.config = config
    server.gateway.config = config
    server.controller.settings = config
    router, gateway = server.router, config.gateway
    router.queue_max, router.queue_wait_s = gateway.queue_max, gateway.queue_wait_s
    router.epsilon = gateway.affinity_epsilon
    logging.getLogger().setLevel(config.log_level.upper())


async def reload(server: Server, path: Path) -> ReloadResult:
    """Read ``path`` again and apply what can be applied live; see the module's doc."""
    state = server.app.state
    async with state.models_lock:  # one change of the catalog at a time, as the API's
        running: ServerConfig = state.config
        try:
            merged, change = _checked(path, running)
            secrets = config_secrets(merged.models, str(path))
        except ConfigError as err:
            log.error("server.yaml not reloaded, nothing changed: %s", err)
            return ReloadResult(error=str(err))
        # Static endpoints' key and CA files, read again (a key rotated in its file).
        server.controller.endpoints.use(secrets)
        server.controller.changed()
        if change.empty:
            log.info("server.yaml reloaded: nothing changed")
            return ReloadResult(change)
        catalog = None
        if "models" in change.live:
            try:
                catalog = await sync_declared(state.store, merged)
            except StoreError as err:
                log.error("server.yaml not reloaded, nothing changed: the store did not "
                          "take its models (%s); send SIGHUP again once it answers", err)
                return ReloadResult(change, str(err))
        _hand_out(server, merged)
        if change.live:
            log.info("server.yaml reloaded: applied %s", ", ".join(change.live))
        if change.restart:
            log.warning("server.yaml: %s changed but not applied, the running values are "
                        "kept; %s", ", ".join(change.restart), _RESTART_HINT)
        if catalog is not None:
            await server.controller.set_catalog(catalog)
    return ReloadResult(change)


class Reloader:
    """SIGHUP's handler: one reload at a time, each in its own task (a signal handler
    cannot await)."""

    def __init__(self, server: Server, path: Path | None) -> None:
        self.server = server
        self.path = path
        self._tasks: set[asyncio.Task] = set()

    def on_signal(self) -> None:
        if self.path is None:
            log.warning("SIGHUP: this server was started without a server.yaml "
                        "(--config); there is nothing to reload")
            return
        task = asyncio.create_task(self._reload(self.path), name="reload")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload(self, path: Path) -> None:
        log.info("SIGHUP: reloading %s", path)
        try:
            await reload(self.server, path)
        except Exception:
            log.exception("reloading %s failed", path)
