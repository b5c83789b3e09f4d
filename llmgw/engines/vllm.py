"""vLLM: ``vllm serve``, multi-node through its own multi-process launch by default.

In ``mp`` mode every node runs ``vllm serve`` with the node count, its rank and the
leader's address and port; the workers are headless. Within a node the GPUs are tensor
parallel, across nodes the stages are pipeline parallel. ``ray`` mode (for a vLLM too old
for mp's flags, or on request) starts a Ray head on the leader and a Ray worker on every
other node, and only the leader runs ``vllm serve``.
"""

from __future__ import annotations

import posixpath
import shlex

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

NAME = "vllm"


def _serve_argv(req: ShardRequest, node: NodeFacts) -> list[str]:
    argv = [
        binary(node, NAME), "serve", req.weights or req.model,
        "--served-model-name", req.model,
        "--tensor-parallel-size", str(max(1, req.gpu_count)),
    ]
    if req.embeddings:
        argv += ["--runner", "pooling"]
    return argv


def render(req: ShardRequest, node: NodeFacts) -> Launch:
    env = gpu_env(req.gpus)
    argv = _serve_argv(req, node)
    port = need_port(req) if req.serves else None
    if req.world_size > 1 and req.launch_mode == "ray":
        return _render_ray(req, node, argv, env, port)
    if req.world_size > 1:
        address, rendezvous = leader_rendezvous(req)
        argv += [
            "--distributed-executor-backend", "mp",
            "--pipeline-parallel-size", str(req.world_size),
            "--nnodes", str(req.world_size),
            "--node-rank", str(req.rank),
            "--master-addr", address,
            "--master-port", str(rendezvous),
        ]
        if not req.serves:
            argv.append("--headless")
    if req.serves:
        argv += ["--host", node.bind_address, "--port", str(port)]
    argv += req.args
    return Launch(tuple(argv), env, port, health_path="/health" if req.serves else None,
                  description=f"vllm {req.model} rank {req.rank}/{req.world_size}")


def _render_ray(req: ShardRequest, node: NodeFacts, argv: list[str], env: dict[str, str],
                port: int | None) -> Launch:
    address, rendezvous = leader_rendezvous(req)
    ray = posixpath.join(posixpath.dirname(binary(node, NAME)), "ray")
    if not req.serves:
        worker = (ray, "start", f"--address={hostport(address, rendezvous)}",
                  f"--node-ip-address={node.bind_address}", "--block")
        return Launch(worker, env, None, health_path=None,
                      description=f"ray worker for {req.model} rank {req.rank}")
    argv += ["--distributed-executor-backend", "ray",
             "--pipeline-parallel-size", str(req.world_size),
             "--host", node.bind_address, "--port", str(port), *req.args]
    head = (f"{shlex.quote(ray)} start --head --port={rendezvous} "
            f"--node-ip-address={shlex.quote(node.bind_address)} --disable-usage-stats")
    script = f"{head} && exec {shlex.join(argv)}"
    return Launch(("/bin/sh", "-c", script), env, port, health_path="/health",
                  description=f"vllm {req.model} on ray, leader")


def help_argv(argv: tuple[str, ...]) -> tuple[tuple[str, ...], int, int]:
    # Plain `--help` prints only the section names; `--help=all` is about 1,900 lines.
    return (argv[0], "serve", "--help=all"), 3, 1000


def widest() -> list[ShardRequest]:
    return two_nodes_of_eight_gpus()
