"""Host facts: name, OS, CPU, memory, and the address the control plane reaches us at."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from urllib.parse import urlsplit

import psutil

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


def route_source_address(server_url: str) -> str:
    """The local address on the route to the control plane. A UDP connect picks the route
    without sending a packet."""
    parts = urlsplit(server_url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, port))
        except OSError:
            return "127.0.0.1"
        return sock.getsockname()[0]


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


def describe() -> dict:
    """The host part of the inventory, as plain data."""
    release = os_release()
    model, flags = cpu_info()
    total, available = memory_mib()
    return {
        "hostname": hostname(),
        "os": " ".join(filter(None, [release.get("ID", ""), release.get("VERSION_ID", "")])),
        "arch": platform.machine(),
        "cpu_model": model,
        "cpu_count": os.cpu_count() or 0,
        "cpu_flags": flags,
        "ram_total_mib": total,
        "ram_available_mib": available,
    }
