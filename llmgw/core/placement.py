"""Where a replica of a model can run, and why it cannot run anywhere else.

``place`` filters nodes, keeping one reason per turned-down node (in the node's own words
where it gave them), then picks among the survivors. A multi-node replica takes all of
its nodes from one fabric: fabrics are not connected to each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from llmgw.core.catalog import BUILTIN_ENGINES, Model, Profile
from llmgw.core.inventory import Node, NodeState

Strategy = Literal["binpack", "spread"]


@dataclass(frozen=True, slots=True)
class NodeUsage:
    """What already runs on a node, as far as placement is concerned."""

    gpus: frozenset[int] = frozenset()
    ports: frozenset[int] = frozenset()
    shards: int = 0

    def plus(self, gpus: Iterable[int], ports: Iterable[int]) -> NodeUsage:
        return NodeUsage(
            self.gpus | frozenset(gpus), self.ports | frozenset(ports), self.shards + 1
        )


@dataclass(frozen=True, slots=True)
class ShardPlacement:
    rank: int
    node_id: str
    address: str
    port: int
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Placement:
    model: str
    profile: str
    shards: tuple[ShardPlacement, ...]
    fabric: str | None = None
    rendezvous_port: int | None = None

    def describe(self) -> str:
        nodes = "+".join(s.node_id for s in self.shards)
        return f"placed on {nodes}" + (f" ({self.fabric})" if self.fabric else "")


@dataclass(frozen=True, slots=True)
class Refusal:
    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class PlacementResult:
    placement: Placement | None
    refusals: tuple[Refusal, ...] = field(default=())

    def describe(self) -> str:
        if self.placement:
            return self.placement.describe()
        if not self.refusals:
            return "no nodes have registered"
        return "; ".join(f"{r.node_id}: {r.reason}" for r in self.refusals)


@dataclass(frozen=True, slots=True)
class _Fit:
    node: Node
    gpus: tuple[int, ...]
    ports: tuple[int, ...]
    free_gpus_after: int
    shards: int


def _free_ports(node: Node, used: frozenset[int], count: int) -> tuple[int, ...]:
    low, high = node.port_range
    found: list[int] = []
    for port in range(low, high + 1):
        if port not in used and port not in node.ports_busy:
            found.append(port)
            if len(found) == count:
                break
    return tuple(found)


def _fit(node: Node, profile: Profile, usage: NodeUsage, ports_wanted: int) -> _Fit | str:
    """The GPUs and up to ``ports_wanted`` ports (at least one) this node would give one
    shard, or why it cannot."""
    if node.state is not NodeState.READY:
        return f"not ready ({node.state.value})"
    if profile.engine not in BUILTIN_ENGINES:
        engine = node.engine(profile.engine)
        if engine is None:
            return f"{profile.engine} is not installed"
        if not engine.usable:
            words = engine.detail or engine.state
            return f"{profile.engine} {words}" if engine.state != "installing" else words
    free = [
        g
        for g in node.gpus
        if g.index not in usage.gpus and g.memory_free_mib >= profile.gpu_memory_mib
    ]
    if len(free) < profile.gpus:
        need = f"{profile.gpus} GPU{'s' if profile.gpus != 1 else ''}"
        if profile.gpu_memory_mib:
            gib = profile.gpu_memory_mib / 1024
            need += f" with {gib:g} GiB free"
        have = len(free)
        return f"needs {need}, has {have}" if node.gpus else f"needs {need}, has no GPUs"
    ports = _free_ports(node, usage.ports, ports_wanted)
    if not ports:
        low, high = node.port_range
        return f"no free port left in {low}-{high}"
    chosen = tuple(sorted(g.index for g in free)[: profile.gpus])
    unused_after = sum(1 for g in node.gpus if g.index not in usage.gpus) - len(chosen)
    return _Fit(node, chosen, ports, unused_after, usage.shards)


def _rank_key(fit: _Fit, strategy: Strategy) -> tuple:
    # binpack fills the fullest node that fits; spread the emptiest. The id breaks ties so
    # that a plan is the same every time for the same input.
    if strategy == "binpack":
        return (fit.free_gpus_after, -fit.shards, fit.node.id)
    return (-fit.free_gpus_after, fit.shards, fit.node.id)


def place(
    model: Model,
    profile: Profile,
    nodes: Iterable[Node],
    usage: Mapping[str, NodeUsage],
    strategy: Strategy = "binpack",
) -> PlacementResult:
    """Choose nodes, GPUs and ports for one new replica of ``model`` with ``profile``."""
    multi = profile.nodes > 1
    refusals: list[Refusal] = []
    fits: list[_Fit] = []
    for node in sorted(nodes, key=lambda n: n.id):
        if multi and not node.fabric:
            refusals.append(Refusal(node.id, "has no fabric set, needed for a multi-node replica"))
            continue
        # A multi-node leader also binds its group's rendezvous port: ask for two ports, and
        # let a node with only one be a worker.
        result = _fit(node, profile, usage.get(node.id, NodeUsage()), 2 if multi else 1)
        if isinstance(result, str):
            refusals.append(Refusal(node.id, result))
        else:
            fits.append(result)

    if not multi:
        if not fits:
            return PlacementResult(None, tuple(refusals))
        best = min(fits, key=lambda f: _rank_key(f, strategy))
        shard = ShardPlacement(0, best.node.id, best.node.address, best.ports[0], best.gpus)
        return PlacementResult(Placement(model.name, profile.name, (shard,), best.node.fabric))

    by_fabric: dict[str, list[_Fit]] = {}
    for fit in fits:
        by_fabric.setdefault(fit.node.fabric or "", []).append(fit)
    groups: list[tuple[tuple, str, list[_Fit]]] = []
    for fabric, members in sorted(by_fabric.items()):
        if len(members) < profile.nodes:
            refusals.append(
                Refusal(f"fabric {fabric}", f"has {len(members)} of {profile.nodes} nodes that fit")
            )
            continue
        ranked = sorted(members, key=lambda f: _rank_key(f, strategy))
        leader = next((f for f in ranked if len(f.ports) >= 2), None)
        if leader is None:
            refusals.append(Refusal(f"fabric {fabric}",
                                    "no node has two free ports for the group's leader"))
            continue
        chosen = [leader, *[f for f in ranked if f is not leader][: profile.nodes - 1]]
        score = tuple(sorted(_rank_key(f, strategy) for f in chosen))
        groups.append((score, fabric, chosen))
    if not groups:
        return PlacementResult(None, tuple(refusals))
    _, fabric, chosen = min(groups)
    shards = tuple(
        ShardPlacement(rank, f.node.id, f.node.address, f.ports[0], f.gpus)
        for rank, f in enumerate(chosen)
    )
    leader = chosen[0]
    return PlacementResult(
        Placement(model.name, profile.name, shards, fabric, rendezvous_port=leader.ports[1])
    )


def place_model(
    model: Model,
    nodes: Iterable[Node],
    usage: Mapping[str, NodeUsage],
    strategy: Strategy = "binpack",
) -> PlacementResult:
    """Try the model's profiles in the order declared; the first that fits wins."""
    nodes = list(nodes)
    refusals: list[Refusal] = []
    for profile in model.profiles:
        result = place(model, profile, nodes, usage, strategy)
        if result.placement:
            return result
        prefix = f"[{profile.name}] " if len(model.profiles) > 1 else ""
        refusals.extend(Refusal(r.node_id, prefix + r.reason) for r in result.refusals)
    return PlacementResult(None, tuple(refusals))
