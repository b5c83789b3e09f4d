"""The agent's connection to the control plane.

The agent dials out (nodes sit behind firewalls more often than control planes do) and
keeps dialling forever over its list of addresses, with jittered exponential backoff so
that a fleet does not reconnect in lockstep after a control-plane restart. Shards keep
running while it is away; on every (re)connection it reports them for adoption.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

import aiohttp

from llmgw import __version__, wire
from llmgw.agent.discovery import gpus, host, infiniband
from llmgw.agent.runtime import (
    ManagerUnreachable,
    ProcessRuntime,
    Runtime,
    SystemdRuntime,
    available,
)
from llmgw.agent.shards import ShardSupervisor
from llmgw.agent.weights import WeightsStore
from llmgw.config import AgentConfig
from llmgw.core.inventory import inventory_changes
from llmgw.engines import ADAPTERS, HELPER_BINARIES

log = logging.getLogger(__name__)

STREAM_PATH = "/agent/v1/stream"
# A session that lasted this long was healthy: the next failure starts the backoff over.
_HEALTHY_SESSION_S = 10.0


class StreamRefused(Exception):
    """The control plane refused this agent; retried with backoff, and logged with why."""


def stream_url(server: str) -> str:
    server = server.rstrip("/")
    if server.startswith("https://"):
        return "wss://" + server[len("https://"):] + STREAM_PATH
    if server.startswith("http://"):
        return "ws://" + server[len("http://"):] + STREAM_PATH
    return server + STREAM_PATH


def backoff_delay(attempt: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Full jitter: anywhere between zero and the exponential ceiling."""
    return rng.uniform(0, min(max_s, initial_s * 2 ** min(attempt, 32)))


async def choose_runtime(config: AgentConfig) -> Runtime:
    """systemd units where a manager answers on the configured bus (required with
    ``runtime: systemd``), else plain processes; the log says which and why."""
    if config.runtime != "process":
        why_not = await available(config.systemd_bus)
        if why_not is None:
            log.info("runtime: systemd transient units via %s", config.systemd_bus)
            return SystemdRuntime(config.systemd_bus, config.state_dir)
        if config.runtime == "systemd":
            raise ManagerUnreachable(f"runtime: systemd, but {why_not}")
        reason = f"no systemd manager: {why_not}"
    else:
        reason = "runtime: process in agent.yaml"
    runtime = ProcessRuntime(config.state_dir)
    log.info("runtime: plain processes (%s); shard records and logs are under %s", reason,
             runtime.directory)
    return runtime


class Agent:
    def __init__(self, config: AgentConfig, runtime: Runtime):
        self.config = config
        self.runtime = runtime
        self.node_id = config.node_id or host.hostname()
        self.address = config.address or ""
        self._outbox: asyncio.Queue[wire.Up] = asyncio.Queue()
        self._gpu_note = ""
        self._connected = False
        self._rng = random.Random()
        self.weights = WeightsStore.from_config(config.weights)
        # The inventory the control plane has: a probe that finds it changed sends it.
        self._inventory_sent: wire.Inventory | None = None
        self._probe_now = asyncio.Event()
        self.supervisor = ShardSupervisor(
            self.runtime,
            bind_address=self.address or "127.0.0.1",
            binaries={name: e.binary for name, e in config.engines.items()},
            report=self._send,
            weights=self.weights,
            weights_changed=self._probe_now.set,
            health=config.shard_health,
        )

    def _route(self) -> str:
        """The address the control plane reaches us at: configured, or the source address
        of the route to it, looked up again on every connection (a node's network may
        change while the agent runs)."""
        if self.config.address:
            return self.config.address
        address = host.route_source_address(self.config.servers)
        if address != self.address:
            if self.address:
                log.info("this node's address changed: %s -> %s", self.address, address)
            self.address = address
            self.supervisor.set_bind_address(address)
        return address

    def _send(self, message: wire.Up) -> None:
        # While disconnected nothing is queued: the next Register carries the whole state.
        if self._connected:
            self._outbox.put_nowait(message)

    def inventory(self) -> wire.Inventory:
        facts = host.describe()
        found = gpus.discover_gpus()
        if not found.gpus and found.note != self._gpu_note:
            log.info("no NVIDIA GPUs: %s", found.note)
        self._gpu_note = found.note
        rdma = [wire.RdmaPort(adapter=p.adapter, port=p.port, state=p.state,
                              rate_gbps=p.rate_gbps, link_layer=p.link_layer, guid=p.guid)
                for p in infiniband.discover_infiniband()]
        weights_dirs = self.weights.scan()
        held = sorted({key for d in weights_dirs for key in d.held})
        engines = [wire.Engine(name="sim", version=__version__, state="installed")]
        for name, e in sorted(self.config.engines.items()):
            if name in HELPER_BINARIES:
                continue
            if name in ADAPTERS:
                engines.append(wire.Engine(name=name, version=e.version, state="configured",
                                           detail=f"named in agent.yaml: {e.binary}"))
            else:
                engines.append(wire.Engine(name=name, version=e.version, state="failed",
                                           detail=f"this agent cannot launch {name}"))
        return wire.Inventory(
            **facts, gpus=list(found.gpus), gpu_driver=found.driver, cuda=found.cuda,
            engines=engines, engines_probed=True, fabric=self.config.fabric,
            weights=held, weights_dirs=weights_dirs, rdma=rdma,
            labels=dict(self.config.labels),
            disabled_engines=sorted(self.config.disable_engines),
        )

    def ports_busy(self) -> list[int]:
        """Ports in our range that something other than our shards listens on."""
        # A shard still stopping holds its port, but as ours: the control plane already
        # counts it as taken until the stop is confirmed.
        return sorted(host.listening_ports(*self.config.port_range) - self.supervisor.own_ports())

    def register(self, inventory: wire.Inventory) -> wire.Register:
        return wire.Register(
            node_id=self.node_id, address=self.address, inventory=inventory,
            running=self.supervisor.running(), port_range=tuple(self.config.port_range),
            ports_busy=self.ports_busy(), agent_version=__version__,
        )

    def heartbeat(self) -> wire.Heartbeat:
        _, available = host.memory_mib()
        free = [g.memory_free_mib for g in gpus.discover_gpus().gpus]
        return wire.Heartbeat(ram_available_mib=available, gpu_memory_free_mib=free,
                              weights_free_mib=self.weights.free_mib(),
                              ports_busy=self.ports_busy(), sent_at=time.time())

    async def run(self) -> None:
        """Serve until cancelled."""
        await asyncio.to_thread(self.weights.prepare)
        async with self.supervisor:
            adopted = await self.supervisor.adopt_running()
            if adopted:
                log.info("found %d shard(s) still running", adopted)
            try:
                await self._connect_forever()
            finally:
                if self.config.stop_shards_on_exit:
                    log.info("stopping every shard before exit")
                    await asyncio.shield(self.supervisor.stop_all())

    async def _connect_forever(self) -> None:
        attempt = 0
        servers = self.config.servers
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                server = servers[attempt % len(servers)]
                began = time.monotonic()
                try:
                    await self._session(http, server)
                    reason = "the control plane closed the stream"
                except StreamRefused as err:
                    reason = f"refused: {err}"
                except host.NoRoute as err:
                    reason = str(err)
                except (aiohttp.ClientError, OSError, TimeoutError, wire.WireError) as err:
                    reason = f"{type(err).__name__}: {err}"
                finally:
                    self._connected = False
                if time.monotonic() - began >= _HEALTHY_SESSION_S:
                    attempt = 0
                delay = backoff_delay(attempt, self.config.reconnect.initial_s,
                                      self.config.reconnect.max_s, self._rng)
                log.warning("stream to %s ended (%s); reconnecting in %.1f s", server, reason,
                            delay)
                attempt += 1
                await asyncio.sleep(delay)

    async def _session(self, http: aiohttp.ClientSession, server: str) -> None:
        url = stream_url(server)
        await asyncio.to_thread(self._route)
        inventory = await asyncio.to_thread(self.inventory)
        async with http.ws_connect(url, heartbeat=None, max_msg_size=16 * 2**20) as ws:
            # Queue reports from before the Register snapshot is taken, so that a shard
            # turning ready in between is reported after it, not lost.
            while not self._outbox.empty():
                self._outbox.get_nowait()
            self._connected = True
            await ws.send_bytes(wire.encode(self.register(inventory)))
            self._inventory_sent = inventory
            welcome = wire.decode_down(await self._receive(ws))
            if not isinstance(welcome, wire.Welcome):
                raise StreamRefused(f"expected a welcome, got {type(welcome).__name__}")
            log.info("registered with %s as %s (%s)", server, self.node_id, self.address)
            sender = asyncio.create_task(self._send_loop(ws, welcome.heartbeat_interval_s))
            prober = asyncio.create_task(self._probe_loop())
            try:
                while True:
                    message = wire.decode_down(await self._receive(ws))
                    if isinstance(message, wire.StartShard):
                        self.supervisor.start(message)
                    elif isinstance(message, wire.StopShard):
                        self.supervisor.stop(message)
                    elif message is None:
                        log.info("skipping a message type this agent does not know")
            finally:
                for task in (sender, prober):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                        await task

    @staticmethod
    async def _receive(ws: aiohttp.ClientWebSocketResponse) -> bytes:
        msg = await ws.receive()
        if msg.type == aiohttp.WSMsgType.BINARY:
            return msg.data
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                        aiohttp.WSMsgType.CLOSED):
            if ws.close_code and ws.close_code >= 4000:
                raise StreamRefused(f"{ws.close_code} {msg.extra or ''}".strip())
            raise ConnectionResetError("stream closed")
        if msg.type == aiohttp.WSMsgType.ERROR:
            raise ConnectionResetError(f"stream error: {ws.exception()}")
        raise wire.WireError(f"unexpected {msg.type.name} frame")

    async def _send_loop(self, ws: aiohttp.ClientWebSocketResponse, interval_s: float) -> None:
        next_beat = time.monotonic()
        while True:
            timeout = max(0.0, next_beat - time.monotonic())
            try:
                message = await asyncio.wait_for(self._outbox.get(), timeout)
            except TimeoutError:
                message = await asyncio.to_thread(self.heartbeat)
                next_beat = time.monotonic() + interval_s
            await ws.send_bytes(wire.encode(message))

    async def _probe_loop(self) -> None:
        """Look at the node again now and then (and at once after weights were fetched),
        and send the inventory when something placement reads has changed: a VM given more
        RAM or a node given an engine becomes a candidate without an agent restart."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._probe_now.wait(), self.config.probe_interval_s)
            self._probe_now.clear()
            inventory = await asyncio.to_thread(self.inventory)
            if self._inventory_sent is None:
                continue
            changes = inventory_changes(self._inventory_sent, inventory)
            if changes:
                log.info("inventory changed: %s", "; ".join(changes))
                self._send(wire.InventoryUpdate(inventory=inventory))
                self._inventory_sent = inventory
