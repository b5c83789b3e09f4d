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
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from llmgw import __version__, pki, wire
from llmgw.agent import self_upgrade
from llmgw.agent.client_errors import describe
from llmgw.agent.control_plane import ControlPlane, TlsFilesUnusable, client_context
from llmgw.agent.discovery import gpus, host, infiniband
from llmgw.agent.install.manager import EngineInstaller
from llmgw.agent.install.pypi import InstallError
from llmgw.agent.runtime import (
    ManagerUnreachable,
    ProcessRuntime,
    Runtime,
    SystemdRuntime,
    available,
)
from llmgw.agent.shard_logs import ShardLogs
from llmgw.agent.shards import ShardSupervisor
from llmgw.agent.weights import WeightsStore
from llmgw.config import AgentConfig, AgentTls, ConfigError
from llmgw.core import engine_names
from llmgw.core.backoff import jittered_delay_s
from llmgw.core.inventory import inventory_changes
from llmgw.core.names import is_loopback_host
from llmgw.engines import ADAPTERS, HELPER_BINARIES
from llmgw.files import write_atomically
from llmgw.tracing import Tracing

log = logging.getLogger(__name__)

STREAM_PATH = "/agent/v1/stream"
# A session that lasted this long was healthy: the next failure starts the backoff over.
_HEALTHY_SESSION_S = 10.0
# With nothing heard from the server for this long, ping it; no pong within half as long
# and the stream is given up. A server that is paused (SIGSTOP, a frozen VM) keeps its
# socket open: without this its nodes would wait on it, not fail over to the others.
SERVER_SILENCE_S = 8.0
# How often a connected agent looks at its certificate's remaining lifetime.
_RENEW_CHECK_S = 300.0


class StreamRefused(Exception):
    """The control plane refused this agent; retried with backoff, and logged with why."""


_HANDSHAKE_REFUSALS = {
    401: "it asks for a node certificate: join this node (llmgw agent join URL TOKEN) or set "
         "tls in agent.yaml",
    403: "it refused this node's certificate (revoked, unknown to the cluster, or not a node "
         "certificate); the server's log says which; join this node again",
    503: "it could not check this node's certificate against its store; it retries",
}


def _is_tls_url(server: str) -> bool:
    return server.startswith(("https://", "wss://"))


def check_servers(config: AgentConfig) -> None:
    """Refuse, before dialling, a plain-text control plane off loopback (unless
    ``allow_plain_http``) and a TLS one without the node's certificate."""
    for i, server in enumerate(config.servers):
        if _is_tls_url(server):
            if config.tls is None:
                raise ConfigError(
                    f"servers[{i}]: {server} is TLS, but agent.yaml has no tls block; set "
                    "tls: {ca_file, cert_file, key_file}, or join with llmgw agent join")
            continue
        host = urlsplit(server).hostname or ""
        if not (config.allow_plain_http or is_loopback_host(host)):
            raise ConfigError(
                f"servers[{i}]: {server} is plain text off loopback: the stream, which can "
                "start processes on this node, would cross the network unauthenticated; use "
                "the server's https:// address (with tls), or set allow_plain_http: true on "
                "a network you trust")


def renewal_due(cert_pem: bytes, now: datetime) -> bool:
    """Whether less than a third of the certificate's lifetime is left."""
    cert = pki.load_cert(cert_pem)
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    return cert.not_valid_after_utc - now < lifetime / 3


def stream_url(server: str) -> str:
    server = server.rstrip("/")
    if server.startswith("https://"):
        return "wss://" + server[len("https://"):] + STREAM_PATH
    if server.startswith("http://"):
        return "ws://" + server[len("http://"):] + STREAM_PATH
    return server + STREAM_PATH


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
        check_servers(config)
        self.config = config
        self.runtime = runtime
        self.node_id = config.node_id or host.hostname()
        self.address = config.address or ""
        self._outbox: asyncio.Queue[wire.Up] = asyncio.Queue()
        self._gpu_note = ""
        self._connected = False
        self._rng = random.Random()
        # The highest leader term heard: a command from an older one is refused.
        self._term = 0
        self.tracing = Tracing(config.tracing, default_service="llmgw-agent",
                               instance=self.node_id)
        self.weights = WeightsStore.from_config(config)
        self.weights.tracing = self.tracing
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
            tracing=self.tracing,
        )
        self.installer = EngineInstaller(config, set_binary=self.supervisor.set_binary,
                                         changed=self._probe_now.set, tracing=self.tracing)
        self.installation = self_upgrade.installation()
        self.upgrader = self_upgrade.SelfUpgrade(config.state_dir)
        self._upgrading: asyncio.Task | None = None
        # Set once an upgrade installed a new llmgw: the command to run it; run() returns.
        self._handover: asyncio.Future[list[str]] | None = None

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
        engines = [wire.Engine(name=name, version=__version__, state="installed")
                   for name in engine_names.BUILTIN]
        for name, e in sorted(self.config.engines.items()):
            if name in HELPER_BINARIES:
                continue
            if name in ADAPTERS:
                engines.append(wire.Engine(name=name, version=e.version, state="configured",
                                           detail=f"named in agent.yaml: {e.binary}"))
            else:
                engines.append(wire.Engine(name=name, version=e.version, state="failed",
                                           detail=f"this agent cannot launch {name}"))
        engines += self.installer.reported()
        return wire.Inventory(
            **facts, gpus=list(found.gpus), gpu_driver=found.driver, cuda=found.cuda,
            engines=engines, fabric=self.config.fabric,
            weights=held, weights_dirs=weights_dirs, rdma=rdma,
            labels=dict(self.config.labels),
            disabled_engines=sorted(self.config.disable_engines),
        )

    def ports_busy(self, own: set[int]) -> list[int]:
        """Ports in our range that something other than our shards listens on. ``own``:
        our shards' ports, read on the event loop before the scan (which may run in a
        thread); read after it, a shard that stopped during the scan (its port seen
        listening, no longer ours) would be reported as somebody else's, and the control
        plane would evict another replica to make the room that was already free."""
        # A shard still stopping holds its port, but as ours: the control plane already
        # counts it as taken until the stop is confirmed.
        return sorted(host.listening_ports(*self.config.port_range) - own)

    def register(self, inventory: wire.Inventory) -> wire.Register:
        return wire.Register(
            node_id=self.node_id, address=self.address, inventory=inventory,
            running=self.supervisor.running(), port_range=tuple(self.config.port_range),
            ports_busy=self.ports_busy(self.supervisor.own_ports()),
            agent_version=__version__,
            installable_engines=self.installer.installable(),
            features=[wire.FEATURE_SHARD_LOGS, wire.FEATURE_MIRROR,
                      *([wire.FEATURE_SELF_UPGRADE]
                        if self.installation == wire.INSTALL_PYTHON else [])],
            installation=self.installation,
        )

    def heartbeat(self, own_ports: set[int]) -> wire.Heartbeat:
        """What changes by the second; runs in a thread, so ``own_ports`` (our shards'
        ports) is read on the event loop first (see ports_busy)."""
        _, available = host.memory_mib()
        free = [g.memory_free_mib for g in gpus.discover_gpus().gpus]
        return wire.Heartbeat(ram_available_mib=available, gpu_memory_free_mib=free,
                              weights_free_mib=self.weights.free_mib(),
                              ports_busy=self.ports_busy(own_ports), sent_at=time.time())

    async def run(self) -> list[str] | None:
        """Serve until cancelled (None), or until an upgrade installed a new llmgw: then
        return the command that runs it, for the caller to exec once all is closed."""
        await asyncio.to_thread(self.weights.prepare)
        self._handover = asyncio.get_running_loop().create_future()
        async with self.supervisor, self.installer:
            adopted = await self.supervisor.adopt_running()
            if adopted:
                log.info("found %d shard(s) still running", adopted)
            connecting = asyncio.create_task(self._connect_forever())
            try:
                await asyncio.wait([connecting, self._handover],
                                   return_when=asyncio.FIRST_COMPLETED)
                if connecting.done():
                    connecting.result()  # its error, if it had one
                return self._handover.result()
            finally:
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
                if self._upgrading is not None:
                    self._upgrading.cancel()
                    await asyncio.gather(self._upgrading, return_exceptions=True)
                # The new llmgw adopts the shards: they keep running through an upgrade.
                if self.config.stop_shards_on_exit and not self._handover.done():
                    log.info("stopping every shard before exit")
                    await asyncio.shield(self.supervisor.stop_all())
                await asyncio.shield(asyncio.to_thread(self.tracing.shutdown))

    def _upgrade(self, message: wire.UpgradeAgent, plane: ControlPlane) -> None:
        if self._upgrading is not None and not self._upgrading.done():
            self._send(wire.UpgradeStatus(
                request=message.request, state=wire.UPGRADE_FAILED,
                detail="this agent is already upgrading; ask again once it is done"))
            return
        self._upgrading = asyncio.create_task(self._self_upgrade(message, plane))

    async def _self_upgrade(self, message: wire.UpgradeAgent, plane: ControlPlane) -> None:
        """Install the release, then hand over to it (run() returns its command)."""
        def status(detail: str) -> None:
            log.info("upgrade to llmgw %s: %s", message.version, detail)
            self._send(wire.UpgradeStatus(request=message.request,
                                          state=wire.UPGRADE_WORKING, detail=detail))

        log.info("upgrading this agent from llmgw %s to %s, as the control plane asks",
                 __version__, message.version)
        try:
            environment = await self.upgrader.install(message, plane, status)
        except InstallError as err:
            log.warning("upgrade to llmgw %s failed: %s; running on as llmgw %s",
                        message.version, err, __version__)
            self._send(wire.UpgradeStatus(request=message.request, state=wire.UPGRADE_FAILED,
                                          detail=str(err)))
            return
        argv = self_upgrade.restart_argv(environment)
        log.info("llmgw %s is installed in %s; restarting into it, shards left running",
                 message.version, environment)
        self._send(wire.UpgradeStatus(request=message.request, state=wire.UPGRADE_RESTARTING,
                                      detail=f"installed in {environment}; restarting"))
        # Sent before the stream closes, unless the stream is gone already: the server
        # then learns of it from the Register of the new llmgw.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._outbox.join(), 5.0)
        if self._handover is not None and not self._handover.done():
            self._handover.set_result(argv)

    async def _connect_forever(self) -> None:
        attempt = 0
        servers = self.config.servers
        # sock_read bounds the wait for the upgrade's answer: a paused server's kernel
        # still accepts the connection, and would otherwise hold the agent forever.
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10, sock_read=10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                server = servers[attempt % len(servers)]
                began = time.monotonic()
                try:
                    await self._session(http, server)
                    reason = "the control plane closed the stream"
                except StreamRefused as err:
                    reason = f"refused: {err}"
                except aiohttp.WSServerHandshakeError as err:
                    hint = _HANDSHAKE_REFUSALS.get(err.status, "")
                    reason = f"refused with HTTP {err.status}" + (f": {hint}" if hint else "")
                except TlsFilesUnusable as err:
                    reason = str(err)
                except host.NoRoute as err:
                    reason = str(err)
                except aiohttp.ClientConnectorError as err:
                    reason = describe(err)
                except (aiohttp.ClientError, OSError, TimeoutError, wire.WireError) as err:
                    reason = f"{type(err).__name__}: {err}"
                finally:
                    self._connected = False
                if time.monotonic() - began >= _HEALTHY_SESSION_S:
                    attempt = 0
                # attempt counts the failures before this one.
                delay = jittered_delay_s(attempt + 1, self.config.reconnect.initial_s,
                                         self.config.reconnect.max_s, self._rng.random())
                log.warning("stream to %s ended (%s); reconnecting in %.1f s", server, reason,
                            delay)
                attempt += 1
                await asyncio.sleep(delay)

    async def _session(self, http: aiohttp.ClientSession, server: str) -> None:
        url = stream_url(server)
        tls = self.config.tls if _is_tls_url(url) else None
        context = client_context(tls) if tls is not None else None
        await asyncio.to_thread(self._route)
        inventory = await asyncio.to_thread(self.inventory)
        async with http.ws_connect(url, heartbeat=SERVER_SILENCE_S, max_msg_size=16 * 2**20,
                                   ssl=context if context is not None else True) as ws:
            # Queue reports from before the Register snapshot is taken, so that a shard
            # turning ready in between is reported after it, not lost.
            while not self._outbox.empty():
                self._outbox.get_nowait()
                self._outbox.task_done()
            self._connected = True
            await ws.send_bytes(wire.encode(self.register(inventory)))
            self._inventory_sent = inventory
            welcome = wire.decode_down(await self._receive(ws))
            if not isinstance(welcome, wire.Welcome):
                raise StreamRefused(f"expected a welcome, got {type(welcome).__name__}")
            # Term 0: a server of a release that elects no leader, the only one there is.
            self._term = max(self._term, welcome.term) if welcome.term else 0
            log.info("registered with %s as %s (%s)%s", server, self.node_id, self.address,
                     f", leader's term {welcome.term}" if welcome.term else "")
            # Engines and weights on its mirror are fetched from this server, as dialled.
            plane = ControlPlane(server, tls, welcome.mirror)
            self.installer.control_plane = self.weights.control_plane = plane
            if plane.hub:
                log.info("the control plane serves a mirror; weights come from %s",
                         self.weights.hub or plane.hub)
            logs = ShardLogs(self.runtime, self.supervisor.running, self._send)
            tasks = [asyncio.create_task(self._send_loop(ws, welcome.heartbeat_interval_s)),
                     asyncio.create_task(self._probe_loop()), asyncio.create_task(logs.run())]
            if tls is not None:
                tasks.append(asyncio.create_task(self._renew_loop(tls)))
            try:
                while True:
                    message = wire.decode_down(await self._receive(ws))
                    if (isinstance(message, wire.StartShard | wire.StopShard)
                            and message.term < self._term):
                        log.warning("refusing to %s %s rank %d: sent in term %d, but the "
                                    "leader's term is %d (a server that no longer leads)",
                                    "start" if isinstance(message, wire.StartShard) else "stop",
                                    message.replica, message.rank, message.term, self._term)
                    elif isinstance(message, wire.StartShard):
                        self.supervisor.start(message)
                    elif isinstance(message, wire.StopShard):
                        self.supervisor.stop(message)
                    elif isinstance(message, wire.ShardLogRequest | wire.ShardLogCancel):
                        logs.handle(message)
                    elif isinstance(message, wire.InstallEngines):
                        self.installer.want(message)
                    elif isinstance(message, wire.UpgradeAgent):
                        self._upgrade(message, plane)
                    elif isinstance(message, wire.Certificate) and tls is not None:
                        await asyncio.to_thread(self._install_certificate, tls, message)
                    elif isinstance(message, wire.CertificateRefused):
                        log.warning("the control plane would not renew this node's "
                                    "certificate: %s", message.reason)
                    elif message is None:
                        log.info("skipping a message type this agent does not know")
            finally:
                for task in tasks:
                    task.cancel()
                # gather, not suppress(CancelledError) around each await: that swallowed
                # this task's own cancellation too (SIGTERM arriving as the stream closed),
                # and the agent reconnected instead of stopping.
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _renew_loop(self, tls: AgentTls) -> None:
        """Ask for a new certificate, on this stream, once less than a third of the
        current one's lifetime is left: checked now and every ``_RENEW_CHECK_S``. The CSR
        is signed with the node's key, which stays the same and never leaves the node."""
        while True:
            try:
                csr = await asyncio.to_thread(self._renewal_csr, tls)
            except (OSError, pki.PkiError) as err:
                log.warning("cannot check this node's certificate for renewal: %s", err)
                csr = None
            if csr is not None:
                log.info("less than a third of this node's certificate lifetime is left; "
                         "asking the control plane for a new one")
                self._send(wire.RenewCertificate(csr=csr.decode()))
            await asyncio.sleep(_RENEW_CHECK_S)

    def _renewal_csr(self, tls: AgentTls) -> bytes | None:
        if not renewal_due(Path(tls.cert_file).read_bytes(), datetime.now(UTC)):
            return None
        return pki.make_csr(pki.load_key(Path(tls.key_file).read_bytes()), self.node_id)

    def _install_certificate(self, tls: AgentTls, message: wire.Certificate) -> None:
        """Check the renewed certificate as the server will, then put it in place for the
        next connection."""
        cert_pem = message.cert.encode()
        try:
            # Against the CA this node already trusts, not the one the message carries.
            node = pki.verify_node_cert(cert_pem, Path(tls.ca_file).read_bytes(),
                                        key=pki.load_key(Path(tls.key_file).read_bytes()))
            if node != self.node_id:
                raise pki.PkiError(f"it names node {node!r}, not this node ({self.node_id!r})")
            write_atomically(Path(tls.cert_file), cert_pem)
        except (OSError, pki.PkiError) as err:
            log.warning("not using the renewed certificate: %s", err)
            return
        cert = pki.load_cert(cert_pem)
        log.info("renewed this node's certificate: serial %x, valid until %s UTC; used from "
                 "the next connection", cert.serial_number,
                 f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S}")

    @staticmethod
    async def _receive(ws: aiohttp.ClientWebSocketResponse) -> bytes:
        msg = await ws.receive()
        if msg.type == aiohttp.WSMsgType.BINARY:
            return msg.data
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                        aiohttp.WSMsgType.CLOSED):
            # The code the server sent: aiohttp's close_code turns into 1006 when our
            # reply to its close cannot be written, which hid the refusal's reason.
            code = msg.data if msg.type == aiohttp.WSMsgType.CLOSE else ws.close_code
            if code and code >= 4000:
                raise StreamRefused(f"{code} {msg.extra or ''}".strip())
            raise ConnectionResetError("stream closed")
        if msg.type == aiohttp.WSMsgType.ERROR:
            raise ConnectionResetError(f"stream error: {ws.exception()}")
        raise wire.WireError(f"unexpected {msg.type.name} frame")

    async def _send_loop(self, ws: aiohttp.ClientWebSocketResponse, interval_s: float) -> None:
        next_beat = time.monotonic()
        while True:
            timeout = max(0.0, next_beat - time.monotonic())
            queued = True
            try:
                message = await asyncio.wait_for(self._outbox.get(), timeout)
            except TimeoutError:
                queued = False
                message = await asyncio.to_thread(self.heartbeat,
                                                  self.supervisor.own_ports())
                next_beat = time.monotonic() + interval_s
            await ws.send_bytes(wire.encode(message))
            if queued:
                self._outbox.task_done()  # _self_upgrade waits for its last word to go

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
