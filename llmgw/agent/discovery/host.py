"""Host facts: name, OS, CPU, memory, and the address the control plane reaches us at."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

# Vector extensions that decide how fast a CPU engine runs.
_VECTOR_FLAGS = ("avx", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile",
                 "amx_int8", "amx_bf16", "f16c", "fma", "neon", "asimd", "sve")


def hostname() -> str:
    return socket.gethostname()


def os_release(path: Path = Path("/etc/os-release")) -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key.strip()] = value.strip().strip('"')
    return fields


def cpu_info(path: Path = Path("/proc/cpuinfo")) -> tuple[str, list[str]]:
    """The CPU's model name and the vector extensions it has, from a cpuinfo-shaped file."""
    model, flags = "", set()
    try:
        text = path.read_text()
    except OSError:
        return platform.processor(), []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "Features"):
            flags.update(value.split())
    return model, sorted(f for f in _VECTOR_FLAGS if f in flags)


class NoRoute(Exception):
    """No route from this node to a control-plane address; the message says which and why."""


@dataclass(frozen=True)
class Route:
    destination: str  # the control plane's address the name resolved to
    source: str  # our address on that route: what the control plane reaches us at
    interface: str
    gateway: str = ""  # empty when the destination is on a directly attached network


def route_to(server_url: str) -> Route:
    """The kernel's route to a control-plane URL's host, asked over netlink: nothing is
    sent to the host itself."""
    parts = urlsplit(server_url)
    name = parts.hostname or "127.0.0.1"
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise NoRoute(f"{name} does not resolve: {err.strerror}; check DNS or /etc/hosts, or "
                      "write the control plane's IP address in agent.yaml") from None
    errors = []
    with IPRoute() as ipr:
        for family, *_, sockaddr in infos:
            destination = sockaddr[0]
            try:
                found = ipr.route("get", dst=destination)
            except NetlinkError as err:
                errors.append(f"{destination}: {os.strerror(err.code)}")
                continue
            route = found[0]
            source = route.get("prefsrc")
            if not source:
                # No preferred source (some IPv6 routes): the address on the out interface.
                addrs = ipr.get_addr(family=family, index=route.get("oif"))
                source = addrs[0].get("address") if addrs else ""
            if not source:
                errors.append(f"{destination}: the route has no source address")
                continue
            links = ipr.get_links(route.get("oif"))
            interface = links[0].get("ifname") if links else ""
            return Route(destination, source, interface or "", route.get("gateway") or "")
    raise NoRoute(f"no route to {name} ({'; '.join(errors)}); check this node's network "
                  "and default route")


def route_source_address(servers: list[str]) -> str:
    """Our address on the route to the first control-plane address that has one."""
    reasons = []
    for server in servers:
        try:
            return route_to(server).source
        except NoRoute as err:
            reasons.append(str(err))
    raise NoRoute("; ".join(reasons))


def listening_ports(low: int, high: int) -> set[int]:
    """TCP ports in ``low..high`` that something on this host listens on."""
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.Error, OSError):
        return set()
    return {c.laddr.port for c in conns
            if c.status == psutil.CONN_LISTEN and low <= c.laddr.port <= high}


def port_free(address: str, port: int) -> bool:
    """Whether a server could bind ``address:port`` now (as servers do, with
    SO_REUSEADDR, so a port in TIME_WAIT counts as free)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def memory_mib() -> tuple[int, int]:
    vm = psutil.virtual_memory()
    return vm.total // 2**20, vm.available // 2**20


def disk_mib(path: str | Path) -> tuple[int, int]:
    """Total and free (for an unprivileged writer) MiB of the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize // 2**20, st.f_bavail * st.f_frsize // 2**20


def describe() -> dict:
    """The host part of the inventory, as plain data."""
    release = os_release()
    model, flags = cpu_info()
    total, available = memory_mib()
    return {
        "hostname": hostname(),
        "os": " ".join(filter(None, [release.get("ID", ""), release.get("VERSION_ID", "")])),
        "os_like": release.get("ID_LIKE", ""),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "cpu_model": model,
        "cpu_count": os.cpu_count() or 0,
        "cpu_flags": flags,
        "ram_total_mib": total,
        "ram_available_mib": available,
    }
