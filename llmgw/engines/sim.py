"""The built-in ``sim`` engine: deterministic, OpenAI-compatible, runs anywhere.

Multi-node like a real engine: the leader binds a rendezvous port and serves nothing until
every worker has joined; workers serve no HTTP at all.
"""

from __future__ import annotations

from llmgw.core.names import hostport
from llmgw.engines.base import (
    Launch,
    NodeFacts,
    ShardRequest,
    gpu_env,
    leader_rendezvous,
    need_port,
)

NAME = "sim"
MODULE = "llmgw.sim"


def render(req: ShardRequest, node: NodeFacts) -> Launch:
    argv = [node.python, "-m", MODULE, "--model", req.model]
    if req.world_size > 1:
        address, rendezvous = leader_rendezvous(req)
        argv += [
            "--rank", str(req.rank),
            "--world-size", str(req.world_size),
            "--rendezvous", hostport(address, rendezvous),
        ]
    port = None
    if req.serves:
        port = need_port(req)
        argv += ["--host", node.bind_address, "--port", str(port)]
    argv += req.args
    return Launch(tuple(argv), {**dict(req.env), **gpu_env(req.gpus)}, port,
                  health_path="/health" if req.serves else None,
                  description=f"sim {req.model} rank {req.rank}/{req.world_size}")


def help_argv(argv: tuple[str, ...]) -> tuple[tuple[str, ...], int, int]:
    return (argv[0], "-m", MODULE, "--help"), 3, 10


def widest() -> list[ShardRequest]:
    common = dict(replica="r-e1", world_size=2, model="m", port=20001,
                  leader_address="10.0.0.1", rendezvous_port=20002)
    return [ShardRequest(rank=0, **common), ShardRequest(rank=1, **common)]
