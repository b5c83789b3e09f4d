"""Nodes as the control plane sees them, and the node lifecycle.

``registering -> ready <-> unreachable -> lost``; ``draining`` is asked for by an operator.
A node's state follows from when it was last heard from, so it is computed, not stored.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from llmgw import wire


class NodeState(enum.StrEnum):
    REGISTERING = "registering"
    READY = "ready"
    UNREACHABLE = "unreachable"
    LOST = "lost"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class Timeouts:
    unreachable_after_s: float = 15.0
    lost_after_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    name: str
    memory_total_mib: int
    memory_free_mib: int


@dataclass(frozen=True, slots=True)
class EngineStatus:
    name: str
    version: str = ""
    state: str = "installed"  # installed | configured | installing | failed
    detail: str = ""

    @property
    def usable(self) -> bool:
        return self.state in ("installed", "configured")


@dataclass(frozen=True, slots=True)
class Node:
    id: str
    address: str
    state: NodeState
    gpus: tuple[Gpu, ...] = ()
    engines: tuple[EngineStatus, ...] = ()
    cpu_flags: frozenset[str] = frozenset()
    ram_total_mib: int = 0
    fabric: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    port_range: tuple[int, int] = (20000, 20999)
    ports_busy: frozenset[int] = frozenset()  # taken by something else on the node
    disabled_engines: frozenset[str] = frozenset()
    weights: frozenset[str] = frozenset()  # models whose weights the node already holds
    last_seen: float = 0.0
    connected: bool = True

    def engine(self, name: str) -> EngineStatus | None:
        return next((e for e in self.engines if e.name == name), None)


@dataclass(slots=True)
class NodeLiveness:
    """What the control plane tracks per node between passes."""

    last_seen: float
    connected: bool = True
    draining: bool = False
    lost: bool = False  # once lost, a node stays lost until it registers again


def node_state(live: NodeLiveness, now: float, timeouts: Timeouts) -> NodeState:
    """The state a node is in at ``now``, from when it was last heard from."""
    silent = now - live.last_seen
    if live.lost or silent >= timeouts.lost_after_s:
        return NodeState.LOST
    if not live.connected or silent >= timeouts.unreachable_after_s:
        return NodeState.UNREACHABLE
    if live.draining:
        return NodeState.DRAINING
    return NodeState.READY


def node_from_register(msg: wire.Register, state: NodeState, last_seen: float,
                       heartbeat: wire.Heartbeat | None = None) -> Node:
    """The node as placement sees it: the registration, with what the latest heartbeat
    measured since (free GPU memory, busy ports) where it has it."""
    inv = msg.inventory
    free = heartbeat.gpu_memory_free_mib if heartbeat else []
    # GPU order is PCI bus order on both: the heartbeat's list lines up with the inventory's.
    if len(free) != len(inv.gpus):
        free = [g.memory_free_mib for g in inv.gpus]
    ports_busy = heartbeat.ports_busy if heartbeat else msg.ports_busy
    return Node(
        id=msg.node_id,
        address=msg.address,
        state=state,
        gpus=tuple(Gpu(g.index, g.name, g.memory_total_mib, f)
                   for g, f in zip(inv.gpus, free, strict=True)),
        engines=tuple(EngineStatus(e.name, e.version, e.state, e.detail) for e in inv.engines),
        cpu_flags=frozenset(inv.cpu_flags),
        ram_total_mib=inv.ram_total_mib,
        fabric=inv.fabric,
        labels=tuple(sorted(inv.labels.items())),
        port_range=tuple(msg.port_range),
        ports_busy=frozenset(ports_busy),
        disabled_engines=frozenset(inv.disabled_engines),
        weights=frozenset(inv.weights),
        last_seen=last_seen,
    )


def _gib(mib: int) -> str:
    return f"{mib / 1024:.0f} GiB" if mib >= 10 * 1024 else f"{mib / 1024:.1f} GiB"


def _engine_words(e: wire.Engine) -> str:
    return " ".join(filter(None, [e.name, e.version, e.state if e.state != "installed" else ""]))


def inventory_changes(old: wire.Inventory, new: wire.Inventory) -> list[str]:
    """What changed between two inventories, in words, leaving out what moves on every
    heartbeat (free memory, free disk). Empty when nothing placement reads has changed."""
    changes: list[str] = []
    if old.ram_total_mib != new.ram_total_mib:
        changes.append(f"RAM {_gib(old.ram_total_mib)} -> {_gib(new.ram_total_mib)}")
    if old.cpu_count != new.cpu_count:
        changes.append(f"CPUs {old.cpu_count} -> {new.cpu_count}")
    if set(old.cpu_flags) != set(new.cpu_flags):
        added = sorted(set(new.cpu_flags) - set(old.cpu_flags))
        gone = sorted(set(old.cpu_flags) - set(new.cpu_flags))
        changes.append("CPU extensions" + "".join(f" +{f}" for f in added)
                       + "".join(f" -{f}" for f in gone))
    old_gpus = [(g.name, g.memory_total_mib, g.uuid) for g in old.gpus]
    new_gpus = [(g.name, g.memory_total_mib, g.uuid) for g in new.gpus]
    if old_gpus != new_gpus:
        changes.append(f"GPUs {len(old.gpus)} -> {len(new.gpus)}"
                       + (f" ({new.gpus[0].name})" if new.gpus else ""))
    if (old.gpu_driver, old.cuda) != (new.gpu_driver, new.cuda):
        changes.append(f"NVIDIA driver {old.gpu_driver or 'none'} -> {new.gpu_driver or 'none'}")
    old_engines = {e.name: e for e in old.engines}
    new_engines = {e.name: e for e in new.engines}
    for name in sorted(old_engines.keys() | new_engines.keys()):
        was, now = old_engines.get(name), new_engines.get(name)
        if was is None:
            changes.append(f"engine +{_engine_words(now)}")
        elif now is None:
            changes.append(f"engine -{name}")
        elif (was.version, was.state) != (now.version, now.state):
            changes.append(f"engine {_engine_words(was)} -> {_engine_words(now)}")
        elif was.detail != now.detail:
            # The node's own words (an install's progress, why it failed) are what
            # placement's refusals and `ctl nodes` show: they count as a change too.
            changes.append(f"engine {_engine_words(now)}: {now.detail or 'no detail'}")
    for what, a, b in (("fabric", old.fabric, new.fabric),
                       ("labels", old.labels, new.labels),
                       ("disabled engines", old.disabled_engines, new.disabled_engines)):
        if a != b:
            changes.append(f"{what} {a or 'none'} -> {b or 'none'}")
    added = sorted(set(new.weights) - set(old.weights))
    gone = sorted(set(old.weights) - set(new.weights))
    if added or gone:
        changes.append("weights" + "".join(f" +{k}" for k in added)
                       + "".join(f" -{k}" for k in gone))
    old_dirs = [(d.path, d.shared) for d in old.weights_dirs]
    new_dirs = [(d.path, d.shared) for d in new.weights_dirs]
    if old_dirs != new_dirs:
        changes.append("weights directories " + (", ".join(p for p, _ in new_dirs) or "none"))
    old_ports = [(p.adapter, p.port, p.state, p.rate_gbps) for p in old.rdma]
    new_ports = [(p.adapter, p.port, p.state, p.rate_gbps) for p in new.rdma]
    if old_ports != new_ports:
        active = sum(1 for p in new.rdma if p.state == "ACTIVE")
        changes.append(f"RDMA ports {len(new.rdma)} ({active} active)")
    return changes
