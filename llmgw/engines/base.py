"""What every engine adapter is: a pure function from a shard's placement to a launch.

An adapter never starts anything. It turns (profile, this shard's place, the node) into an
argv, an environment, the port it serves on and how to tell it is ready; one shared
launcher in the agent's runtime does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class EngineError(Exception):
    """A shard this engine cannot launch as asked; the message says what to change."""


@dataclass(frozen=True, slots=True)
class ShardRequest:
    """One shard of one replica, as the agent was asked to run it."""

    replica: str
    rank: int
    world_size: int
    model: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    port: int | None = None
    gpus: tuple[int, ...] = ()
    weights: str | None = None
    leader_address: str = ""
    rendezvous_port: int | None = None


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What the node knows that the control plane does not."""

    bind_address: str
    python: str  # the interpreter llmgw runs on, for engines that ship inside llmgw
    binaries: dict[str, str] = field(default_factory=dict)  # engine name -> binary path


@dataclass(frozen=True, slots=True)
class Launch:
    argv: tuple[str, ...]
    env: dict[str, str]
    port: int | None  # None: this rank serves no HTTP (a multi-node worker)
    health_path: str | None = "/health"
    description: str = ""


def gpu_env(gpus: tuple[int, ...]) -> dict[str, str]:
    """CUDA numbers GPUs as placement does only in PCI bus order."""
    if not gpus:
        return {}
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
    }
