"""Where a replica of a model can run, and why it cannot run anywhere else.

Placement filters nodes, keeping one reason per turned-down node (in the node's own words
where it gave them), then ranks the survivors: nodes (and fabrics) that already hold the
model's weights first, as a preference and never a filter, then binpack (fill the fullest
node that fits) or spread. A multi-node replica takes all of its nodes from one fabric:
fabrics are not connected to each other.

Several replicas of one model are placed in one go: the nodes are filtered and ranked
once, and only the node that took a replica is ranked again, so a pass over thousands of
nodes stays fast.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from llmgw.core import engine_names
from llmgw.core.catalog import Model, Profile
from llmgw.core.inventory import Node, NodeState

Strategy = Literal["binpack", "spread"]

# Vector extensions without which a CPU engine runs several times slower.
_FAST_CPU_FLAG = "avx2"
_ARM_FLAGS = frozenset({"neon", "asimd"})


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
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        nodes = "+".join(s.node_id for s in self.shards)
        text = f"placed on {nodes}" + (f" ({self.fabric})" if self.fabric else "")
        return text + "".join(f"; warning: {w}" for w in self.warnings)

    def ports_on(self, node_id: str) -> list[int]:
        ports = [s.port for s in self.shards if s.node_id == node_id]
        if self.rendezvous_port is not None and self.shards[0].node_id == node_id:
            ports.append(self.rendezvous_port)
        return ports


# What kind of thing turned a node down, for metrics and traces (a bounded label).
REFUSAL_KINDS = ("node_state", "selector", "gpu_class", "engine", "cpu", "gpus", "ports",
                 "fabric", "other")


class Reason(str):
    """A refusal's words, which also say which of REFUSAL_KINDS it is."""

    kind: str

    def __new__(cls, kind: str, text: str) -> Reason:
        reason = super().__new__(cls, text)
        reason.kind = kind
        return reason


@dataclass(frozen=True, slots=True)
class Refusal:
    node_id: str
    reason: str
    # One of REFUSAL_KINDS, for metrics; the words are what a refusal is compared by.
    kind: str = field(default="other", compare=False)


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
    unused_gpus: int  # GPUs left free on the node after this shard
    shards: int
    holds_weights: bool
    warning: str | None = None


def _free_ports(node: Node, used: frozenset[int], count: int) -> tuple[int, ...]:
    low, high = node.port_range
    found: list[int] = []
    for port in range(low, high + 1):
        if port not in used and port not in node.ports_busy:
            found.append(port)
            if len(found) == count:
                break
    return tuple(found)


def static_refusal(model: Model, profile: Profile, node: Node) -> str | None:
    """Why ``node`` can never take this profile right now, whatever else runs on it."""
    if node.state is not NodeState.READY:
        return Reason("node_state", f"not ready ({node.state.value})")
    labels = dict(node.labels)
    for key, value in model.selector.labels:
        if labels.get(key) != value:
            have = f"{key}={labels[key]}" if key in labels else f"no {key} label"
            return Reason("selector", f"does not match the selector {key}={value} (has {have})")
    if model.selector.gpu_class:
        wanted = model.selector.gpu_class.lower()
        if not any(wanted in g.name.lower() for g in node.gpus):
            return Reason("gpu_class", f"has no {model.selector.gpu_class} GPU")
    if profile.engine in node.disabled_engines:
        return Reason("engine", f"{profile.engine} is disabled on this node")
    if profile.engine not in engine_names.BUILTIN:
        engine = node.engine(profile.engine)
        if engine is None:
            return Reason("engine", f"{profile.engine} is not installed")
        if not engine.usable:
            words = engine.detail or engine.state
            return Reason("engine", f"{profile.engine} {words}"
                          if engine.state != "installing" else words)
    if profile.require_avx2 and _slow_cpu(node):
        return Reason("cpu", "its CPU has no AVX2, which this profile requires")
    return None


def _slow_cpu(node: Node) -> bool:
    flags = node.cpu_flags
    return bool(flags) and _FAST_CPU_FLAG not in flags and not flags & _ARM_FLAGS


def _fit(model: Model, profile: Profile, node: Node, usage: NodeUsage,
         ports_wanted: int) -> _Fit | str:
    """The GPUs and up to ``ports_wanted`` ports (at least one) this node would give one
    shard, or why it cannot."""
    refusal = static_refusal(model, profile, node)
    if refusal:
        return refusal
    return _dynamic_fit(model, profile, node, usage, ports_wanted)


def _dynamic_fit(model: Model, profile: Profile, node: Node, usage: NodeUsage,
                 ports_wanted: int) -> _Fit | str:
    free = [
        g for g in node.gpus
        if g.index not in usage.gpus and g.memory_free_mib >= profile.gpu_memory_mib
    ]
    if len(free) < profile.gpus:
        need = f"{profile.gpus} GPU{'s' if profile.gpus != 1 else ''}"
        if profile.gpu_memory_mib:
            need += f" with {round(profile.gpu_memory_mib / 1024, 1):g} GiB free"
        return Reason("gpus", f"needs {need}, has {len(free)}" if node.gpus
                      else f"needs {need}, has no GPUs")
    ports = _free_ports(node, usage.ports, ports_wanted)
    if not ports:
        low, high = node.port_range
        return Reason("ports", f"no free port left in {low}-{high}")
    chosen = tuple(sorted(g.index for g in free)[: profile.gpus])
    unused_after = sum(1 for g in node.gpus if g.index not in usage.gpus) - len(chosen)
    warning = None
    if not profile.gpus and _slow_cpu(node):
        warning = f"{node.id}'s CPU has no AVX2: a CPU engine runs several times slower there"
    return _Fit(node, chosen, ports, unused_after, usage.shards,
                model.weights_key(profile) in node.weights,
                warning)


def _rank_key(fit: _Fit, strategy: Strategy) -> tuple:
    # Weights already there first; then binpack fills the fullest node that fits, spread
    # the emptiest. The id breaks ties, so a plan is the same every time for one input.
    if strategy == "binpack":
        return (not fit.holds_weights, fit.unused_gpus, -fit.shards, fit.node.id)
    return (not fit.holds_weights, -fit.unused_gpus, fit.shards, fit.node.id)


def place(model: Model, profile: Profile, nodes: Iterable[Node],
          usage: Mapping[str, NodeUsage], strategy: Strategy = "binpack") -> PlacementResult:
    """Choose nodes, GPUs and ports for one new replica of ``model`` with ``profile``."""
    placements, refusals = place_many(model, profile, nodes, usage, 1, strategy)
    return PlacementResult(placements[0] if placements else None,
                           () if placements else refusals)


def place_many(model: Model, profile: Profile, nodes: Iterable[Node],
               usage: Mapping[str, NodeUsage], count: int, strategy: Strategy = "binpack"
               ) -> tuple[list[Placement], tuple[Refusal, ...]]:
    """Up to ``count`` replicas; the refusals say why no more could be placed. ``usage``
    is not changed: the caller adds what it keeps."""
    if profile.nodes > 1:
        return _place_groups(model, profile, list(nodes), dict(usage), count, strategy)
    refusals: list[Refusal] = []
    ranked: list[tuple[tuple, _Fit]] = []
    for node in sorted(nodes, key=lambda n: n.id):
        result = _fit(model, profile, node, usage.get(node.id, NodeUsage()), 1)
        if isinstance(result, str):
            refusals.append(Refusal(node.id, result, result.kind))
        else:
            ranked.append((_rank_key(result, strategy), result))
    ranked.sort(key=lambda pair: pair[0])
    local = dict(usage)
    placements: list[Placement] = []
    while len(placements) < count and ranked:
        _, best = ranked.pop(0)
        node = best.node
        shard = ShardPlacement(0, node.id, node.address, best.ports[0], best.gpus)
        placements.append(Placement(model.name, profile.name, (shard,), node.fabric,
                                    warnings=(best.warning,) if best.warning else ()))
        if len(placements) == count:
            break
        local[node.id] = local.get(node.id, NodeUsage()).plus(best.gpus, best.ports[:1])
        again = _dynamic_fit(model, profile, node, local[node.id], 1)
        if isinstance(again, str):
            refusals.append(Refusal(node.id, again, again.kind))
        else:
            bisect.insort(ranked, (_rank_key(again, strategy), again), key=lambda p: p[0])
    return placements, tuple(refusals)


def _place_groups(model: Model, profile: Profile, nodes: list[Node],
                  usage: dict[str, NodeUsage], count: int, strategy: Strategy
                  ) -> tuple[list[Placement], tuple[Refusal, ...]]:
    """Multi-node replicas, one fabric each. The nodes are fitted and ranked once per
    fabric; after each replica only the nodes it took are fitted again."""
    refusals: dict[str, str] = {}
    ranked: dict[str, list[tuple[tuple, _Fit]]] = {}
    for node in sorted(nodes, key=lambda n: n.id):
        if not node.fabric:
            refusals[node.id] = Reason("fabric",
                                       "has no fabric set, needed for a multi-node replica")
            continue
        # A multi-node leader also binds its group's rendezvous port: ask for two ports,
        # and let a node with only one be a worker.
        fit = _fit(model, profile, node, usage.get(node.id, NodeUsage()), 2)
        if isinstance(fit, str):
            refusals[node.id] = fit
        else:
            ranked.setdefault(node.fabric, []).append((_rank_key(fit, strategy), fit))
    for members in ranked.values():
        members.sort(key=lambda pair: pair[0])
    # A fabric holds the weights if any node in it does, full or not: one shared filer or
    # the nodes already serving the model count the same.
    holding = {n.fabric for n in nodes if n.fabric and model.weights_key(profile) in n.weights}
    placements: list[Placement] = []
    fabric_refusals: dict[str, str] = {}
    while len(placements) < count:
        fabric_refusals = {}
        groups: list[tuple[tuple, str, list[_Fit]]] = []
        for fabric, members in sorted(ranked.items()):
            if len(members) < profile.nodes:
                fabric_refusals[f"fabric {fabric}"] = Reason(
                    "fabric", f"has {len(members)} of {profile.nodes} nodes that fit")
                continue
            leader = next((f for _, f in members if len(f.ports) >= 2), None)
            if leader is None:
                fabric_refusals[f"fabric {fabric}"] = Reason(
                    "ports", "no node has two free ports for the group's leader")
                continue
            workers = [f for _, f in members if f is not leader][: profile.nodes - 1]
            chosen = [leader, *workers]
            # A fabric that already holds the weights comes first, then the ranks.
            score = (fabric not in holding,
                     tuple(sorted(_rank_key(f, strategy) for f in chosen)))
            groups.append((score, fabric, chosen))
        if not groups:
            break
        _, fabric, chosen = min(groups)
        shards = tuple(ShardPlacement(rank, f.node.id, f.node.address, f.ports[0], f.gpus)
                       for rank, f in enumerate(chosen))
        placement = Placement(model.name, profile.name, shards, fabric,
                              rendezvous_port=chosen[0].ports[1],
                              warnings=tuple(f.warning for f in chosen if f.warning))
        placements.append(placement)
        taken = {f.node.id for f in chosen}
        members = [pair for pair in ranked[fabric] if pair[1].node.id not in taken]
        for f in chosen:
            node = f.node
            usage[node.id] = usage.get(node.id, NodeUsage()).plus(
                f.gpus, placement.ports_on(node.id))
            again = _dynamic_fit(model, profile, node, usage[node.id], 2)
            if isinstance(again, str):
                refusals[node.id] = again
            else:
                bisect.insort(members, (_rank_key(again, strategy), again),
                              key=lambda pair: pair[0])
        ranked[fabric] = members
    why = [Refusal(n, r, r.kind) for n, r in refusals.items()]
    why += [Refusal(n, r, r.kind) for n, r in fabric_refusals.items()]
    return placements, tuple(why)


def place_model(model: Model, nodes: Iterable[Node], usage: Mapping[str, NodeUsage],
                strategy: Strategy = "binpack") -> PlacementResult:
    """One replica, trying the model's profiles in the order declared."""
    placements, refusals = place_replicas(model, nodes, usage, strategy, 1)
    return PlacementResult(placements[0] if placements else None,
                           () if placements else refusals)


def place_replicas(model: Model, nodes: Iterable[Node], usage: Mapping[str, NodeUsage],
                   strategy: Strategy = "binpack", count: int = 1
                   ) -> tuple[list[Placement], tuple[Refusal, ...]]:
    """Up to ``count`` replicas, trying the model's profiles in the order declared: each
    profile takes what it can, the next one the rest."""
    nodes = list(nodes)
    local = dict(usage)
    placements: list[Placement] = []
    refusals: list[Refusal] = []
    for profile in model.profiles:
        if len(placements) == count:
            break
        got, why = place_many(model, profile, nodes, local, count - len(placements), strategy)
        for placement in got:
            for shard in placement.shards:
                local[shard.node_id] = local.get(shard.node_id, NodeUsage()).plus(
                    shard.gpus, placement.ports_on(shard.node_id))
        placements += got
        prefix = f"[{profile.name}] " if len(model.profiles) > 1 else ""
        refusals.extend(Refusal(r.node_id, prefix + r.reason, r.kind) for r in why)
    return placements, tuple(refusals)


def qualifications(models: Iterable[Model], node: Node) -> dict[str, str | None]:
    """For each model: ``None`` when ``node``'s inventory lets it run some profile of the
    model on its own (as if the node were idle and ready), else the first profile's reason.
    Comparing two of these tells an operator why a model placed only now."""
    idle = replace(node, state=NodeState.READY)
    found: dict[str, str | None] = {}
    for model in models:
        reasons = []
        for profile in model.profiles:
            fit = _fit(model, profile, idle, NodeUsage(), 1)
            if not isinstance(fit, str):
                reasons = []
                break
            reasons.append(fit)
        found[model.name] = reasons[0] if reasons else None
    return found


def newly_qualified(models: Iterable[Model], before: Node | None, after: Node) -> list[str]:
    """Log lines for the models ``after`` can run that ``before`` could not, with what
    stopped it before ("node05 now qualifies for qwen (before: needs 2 GPUs, has 1)")."""
    if before is None:
        return []  # a node seen for the first time is not news
    models = tuple(models)
    then = qualifications(models, before)
    return [f"{after.id} now qualifies for {name} (before: {then[name]})"
            for name, reason in qualifications(models, after).items()
            if reason is None and then[name] is not None]
