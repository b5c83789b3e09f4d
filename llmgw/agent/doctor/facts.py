"""The doctor's gathering half: read the node into a plain ``Facts``.

Every source (NVML, cpuinfo, sysfs, statvfs, netlink, one GET of each control plane's
``/healthz``) is reached through ``Sources``, which a test replaces; ``gather`` never raises
for a missing device, file or network.
"""

from __future__ import annotations

import json
import os
import platform
import pwd
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw.agent.discovery import gpus as gpu_discovery
from llmgw.agent.discovery import host
from llmgw.agent.discovery.infiniband import IbPort, discover_infiniband
from llmgw.agent.discovery.tls import TlsReport, read_tls
from llmgw.config import AgentConfig

PROBE_TIMEOUT_S = 3.0
# What an agent.yaml that names only its servers gets: where engines and weights go.
_DEFAULTS = AgentConfig(servers=["http://127.0.0.1:8080"])


@dataclass(frozen=True)
class Probe:
    """One GET of a control plane's /healthz."""

    ok: bool
    error: str = ""
    status: int | None = None
    server_time: float | None = None  # the server's clock, from the answer
    sent_at: float = 0.0  # our clock when the request left and when the answer came
    received_at: float = 0.0

    @property
    def round_trip_s(self) -> float:
        return max(0.0, self.received_at - self.sent_at)

    @property
    def skew_s(self) -> float | None:
        """Server clock minus ours, read at the middle of the round trip."""
        if self.server_time is None:
            return None
        return self.server_time - (self.sent_at + self.received_at) / 2


@dataclass(frozen=True)
class ServerFact:
    url: str
    route: host.Route | None
    route_error: str = ""
    probe: Probe | None = None  # None: not tried (no route)


@dataclass(frozen=True)
class DirFact:
    path: str  # as configured
    measured: str  # the nearest existing path, whose filesystem was measured
    exists: bool
    is_dir: bool
    writable: bool  # the directory, or (missing) the parent it would be created in
    total_mib: int | None
    free_mib: int | None
    shared: bool = False
    error: str = ""


@dataclass(frozen=True)
class Facts:
    hostname: str
    node_id: str
    os_release: dict[str, str]
    kernel: str
    arch: str
    cpu_model: str
    cpu_count: int
    cpu_flags: tuple[str, ...]  # vector extensions only
    virtual: bool  # cpuinfo's "hypervisor" flag
    ram_total_mib: int
    ram_available_mib: int
    gpus: gpu_discovery.GpuReport
    infiniband: tuple[IbPort, ...]
    engine_dir: DirFact
    weights: tuple[DirFact, ...]
    servers: tuple[ServerFact, ...]
    tls: TlsReport | None = None  # None: no tls in agent.yaml
    now: float = 0.0
    user: str = ""  # who ran the doctor, "root (uid 0)"


def http_probe(url: str, context: ssl.SSLContext | None, timeout_s: float,
               clock: Callable[[], float]) -> Probe:
    """GET ``{url}/healthz`` directly (no proxy, as the agent dials)."""
    handlers: list[Any] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    target = url.rstrip("/") + "/healthz"
    sent = clock()
    try:
        with opener.open(target, timeout=timeout_s) as answer:
            body, status = answer.read(65536), answer.status
    except urllib.error.HTTPError as err:
        return Probe(False, f"{target} answered HTTP {err.code}", err.code, None, sent, clock())
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return Probe(False, _network_error(reason, target, timeout_s), None, None, sent,
                     clock())
    received = clock()
    try:
        value = json.loads(body).get("time")
        server_time = float(value) if isinstance(value, int | float) else None
    except (ValueError, AttributeError):
        server_time = None
    return Probe(True, "", status, server_time, sent, received)


def _network_error(reason: Any, target: str, timeout_s: float) -> str:
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(reason, ConnectionRefusedError):
        netloc = urllib.parse.urlsplit(target).netloc
        return f"connection refused: nothing listens on {netloc}"
    if isinstance(reason, ssl.SSLError):
        return f"TLS handshake failed: {reason.reason or reason}"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason)


@dataclass(frozen=True)
class Sources:
    """Where ``gather`` reads the node from; tests replace each one."""

    nvml: Any = None  # pynvml itself, or an NVML-shaped fake
    cpuinfo: Path = Path("/proc/cpuinfo")
    os_release: Path = Path("/etc/os-release")
    infiniband_root: Path = Path("/sys/class/infiniband")
    arch: str = field(default_factory=platform.machine)
    clock: Callable[[], float] = time.time
    probe: Callable[[str, ssl.SSLContext | None, float, Callable[[], float]], Probe] = http_probe
    route: Callable[[str], host.Route] = host.route_to
    disk: Callable[[str], tuple[int, int]] = host.disk_mib
    memory: Callable[[], tuple[int, int]] = host.memory_mib
    timeout_s: float = PROBE_TIMEOUT_S


def gather(config: AgentConfig | None = None, servers: Sequence[str] | None = None,
           sources: Sources | None = None) -> Facts:
    """Read the node. ``servers`` defaults to the configuration's; none means no
    control-plane checks. Never raises for a missing device, file or network."""
    src = sources or Sources()
    cfg = config or _DEFAULTS
    urls = list(servers) if servers is not None else (list(config.servers) if config else [])
    model, flags = host.cpu_info(src.cpuinfo)
    total, available = src.memory()
    name = host.hostname()
    tls = config.tls if config else None
    if config:
        gpu_discovery.preload_nvml(config.nvml_library)
    return Facts(
        hostname=name, node_id=cfg.node_id or name, os_release=host.os_release(src.os_release),
        kernel=platform.release(), arch=src.arch, cpu_model=model, cpu_count=os.cpu_count() or 0,
        cpu_flags=tuple(flags), virtual=_hypervisor(src.cpuinfo), ram_total_mib=total,
        ram_available_mib=available, gpus=gpu_discovery.discover_gpus(src.nvml),
        infiniband=discover_infiniband(src.infiniband_root),
        engine_dir=_dir_fact(cfg.state_dir, False, src.disk),
        weights=tuple(_dir_fact(d.path, d.shared, src.disk) for d in cfg.weights_directories()),
        servers=tuple(_server_fact(url, cfg, src) for url in urls),
        tls=read_tls(tls.ca_file, tls.cert_file, tls.key_file) if tls else None,
        now=src.clock(), user=_whoami())


def _hypervisor(path: Path) -> bool:
    try:
        return re.search(r"^flags\s*:.*\bhypervisor\b", path.read_text(), re.M) is not None
    except OSError:
        return False


def _whoami() -> str:
    uid = os.geteuid()
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _dir_fact(path: str, shared: bool, disk: Callable[[str], tuple[int, int]]) -> DirFact:
    target = Path(path)
    measured = target
    while not measured.exists() and measured != measured.parent:
        measured = measured.parent
    try:
        total, free = disk(str(measured))
        error = ""
    except OSError as err:
        total = free = None
        error = f"cannot measure {measured}: {err.strerror}"
    return DirFact(path=path, measured=str(measured), exists=target.exists(),
                   is_dir=target.is_dir(), writable=os.access(measured, os.W_OK | os.X_OK),
                   total_mib=total, free_mib=free, shared=shared, error=error)


def _server_fact(url: str, config: AgentConfig, src: Sources) -> ServerFact:
    try:
        route = src.route(url)
    except host.NoRoute as err:
        return ServerFact(url, None, str(err))
    context = None
    if url.startswith("https://"):
        try:
            context = _client_context(config)
        except (OSError, ssl.SSLError) as err:
            return ServerFact(url, route, "", Probe(False, f"TLS files unusable: {err}"))
    return ServerFact(url, route, "", src.probe(url, context, src.timeout_s, src.clock))


def _client_context(config: AgentConfig) -> ssl.SSLContext:
    tls = config.tls
    context = ssl.create_default_context(cafile=tls.ca_file if tls else None)
    if tls:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=_no_passphrase)
    return context


def _no_passphrase() -> bytes:
    raise ssl.SSLError("the key is encrypted; the agent cannot type a passphrase")
