"""RDMA ports (InfiniBand and RoCE), read from sysfs.

The layout is the kernel's: ``<root>/<adapter>/node_guid`` and, per port,
``<root>/<adapter>/ports/<n>/{state,rate,link_layer}``. A file that cannot be read leaves
its field empty and the port is still reported, so one odd driver does not hide a fabric.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")


@dataclass(frozen=True)
class IbPort:
    adapter: str  # mlx5_0
    port: int  # 1-based, as sysfs numbers them
    state: str  # ACTIVE, DOWN, INIT, ARMED ("4: ACTIVE" without its number)
    rate_gbps: float  # 400.0 for "400 Gb/sec (4X NDR)"; 0.0 where unknown
    link_layer: str  # InfiniBand or Ethernet (RoCE)
    guid: str  # the adapter's node GUID, "b83f:d203:00a1:2b3c"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _named(value: str) -> str:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``."""
    return value.partition(":")[2].strip() if ":" in value else value


def _rate(value: str) -> float:
    match = _RATE.match(value)
    return float(match.group(1)) if match else 0.0


def _port_number(path: Path) -> int:
    return int(path.name) if path.name.isdigit() else -1


def discover_infiniband(root: Path = Path("/sys/class/infiniband")) -> tuple[IbPort, ...]:
    """Every port of every RDMA adapter under ``root``, by adapter then port. No ``root``
    (no RDMA driver loaded) is no adapters."""
    try:
        adapters = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return ()
    found: list[IbPort] = []
    for adapter in adapters:
        guid = _read(adapter / "node_guid")
        try:
            ports = sorted((p for p in (adapter / "ports").iterdir()
                            if _port_number(p) >= 0), key=_port_number)
        except OSError:
            continue
        for port in ports:
            found.append(IbPort(
                adapter=adapter.name, port=_port_number(port),
                state=_named(_read(port / "state")), rate_gbps=_rate(_read(port / "rate")),
                link_layer=_read(port / "link_layer"), guid=guid))
    return tuple(found)
