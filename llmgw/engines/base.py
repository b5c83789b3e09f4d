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
    # "address:port" of every rank, indexed by rank (llama.cpp's leader dials its workers).
    peers: tuple[str, ...] = ()
    embeddings: bool = False
    launch_mode: str = "mp"  # vLLM only: "mp" (its own multi-process launch) or "ray"

    @property
    def serves(self) -> bool:
        """Rank 0 serves HTTP; the other ranks of a multi-node replica serve nothing."""
        return self.rank == 0

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What the node knows that the control plane does not."""

    bind_address: str
    python: str  # the interpreter llmgw runs on, for engines that ship inside llmgw
    binaries: dict[str, str] = field(default_factory=dict)  # engine name -> binary path


@dataclass(frozen=True, slots=True)
class Launch:
    """How to run one shard and how to tell it is ready.

    Readiness is ``health_path`` answering 200 on ``port`` when there is one; else, with
    ``tcp_ready``, ``port`` accepting connections (a worker that speaks no HTTP; once
    ready it is watched by its process only, see ShardSupervisor._watched_address); else simply
    running. ``wait_for`` are ``host:port`` addresses that must accept connections
    before the engine is started (a leader that dials its workers at start).
    """

    argv: tuple[str, ...]
    env: dict[str, str]
    port: int | None
    health_path: str | None = "/health"
    tcp_ready: bool = False
    wait_for: tuple[str, ...] = ()
    description: str = ""


def binary(node: NodeFacts, engine: str) -> str:
    path = node.binaries.get(engine)
    if not path:
        raise EngineError(
            f"no {engine} binary on this node: name one in agent.yaml under "
            f"engines.{engine}.binary"
        )
    return path


def need_port(req: ShardRequest) -> int:
    if req.port is None:
        raise EngineError(f"rank {req.rank} of {req.replica} needs a port and was given none")
    return req.port


def leader_rendezvous(req: ShardRequest) -> tuple[str, int]:
    if not req.leader_address or req.rendezvous_port is None:
        raise EngineError(
            f"{req.replica} spans {req.world_size} nodes but has no leader address and "
            "rendezvous port"
        )
    return req.leader_address, req.rendezvous_port


def two_nodes_of_eight_gpus() -> list[ShardRequest]:
    """engine-check's widest shape for a GPU engine: both ranks of a 2 x 8-GPU replica,
    the leader serving embeddings."""
    common = dict(replica="r-e1", world_size=2, model="org/m", weights="/w/org-m",
                  port=20001, leader_address="10.0.0.1", rendezvous_port=20002)
    return [
        ShardRequest(rank=0, gpus=tuple(range(8)), embeddings=True, **common),
        ShardRequest(rank=1, gpus=tuple(range(8)), **common),
    ]


def gpu_env(gpus: tuple[int, ...]) -> dict[str, str]:
    """CUDA numbers GPUs as placement does only in PCI bus order. A shard given no GPU
    sees none, so a CUDA-capable engine cannot take one placement did not give it."""
    if not gpus:
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
    }
