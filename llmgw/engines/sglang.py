"""SGLang: ``python -m sglang.launch_server``, multi-node with its own flags.

Every node runs the launcher with the node count, its rank and the leader's
``dist-init-addr``; tensor parallelism spans all GPUs of all nodes. Only rank 0 serves
HTTP.
"""

from __future__ import annotations

from llmgw.core.names import hostport
from llmgw.engines.base import (
    Launch,
    NodeFacts,
    ShardRequest,
    binary,
    gpu_env,
    leader_rendezvous,
    need_port,
    two_nodes_of_eight_gpus,
)

NAME = "sglang"
# The engine's "binary" is the Python of the environment SGLang is installed in.
MODULE = "sglang.launch_server"


def render(req: ShardRequest, node: NodeFacts) -> Launch:
    argv = [
        binary(node, NAME), "-m", MODULE,
        "--model-path", req.weights or req.model,
        "--served-model-name", req.model,
        "--tp-size", str(max(1, req.gpu_count) * req.world_size),
    ]
    if req.world_size > 1:
        address, rendezvous = leader_rendezvous(req)
        argv += [
            "--nnodes", str(req.world_size),
            "--node-rank", str(req.rank),
            "--dist-init-addr", hostport(address, rendezvous),
        ]
    if req.embeddings:
        argv.append("--is-embedding")
    port = None
    if req.serves:
        port = need_port(req)
        argv += ["--host", node.bind_address, "--port", str(port)]
    argv += req.args
    return Launch(tuple(argv), gpu_env(req.gpus), port,
                  health_path="/health" if req.serves else None,
                  description=f"sglang {req.model} rank {req.rank}/{req.world_size}")


def help_argv(argv: tuple[str, ...]) -> tuple[tuple[str, ...], int, int]:
    return (argv[0], "-m", MODULE, "--help"), 3, 1500


def widest() -> list[ShardRequest]:
    return two_nodes_of_eight_gpus()
