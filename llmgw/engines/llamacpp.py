"""llama.cpp: ``llama-server`` for one node; over RPC for several.

A multi-node replica runs ``ggml-rpc-server`` on every worker (a TCP service, no HTTP)
and ``llama-server --rpc w1:port,w2:port`` on the leader, which offloads layers to the
workers as if they were local devices. The leader is started only once every worker
accepts connections: llama-server dials its RPC servers once, at load.
"""

from __future__ import annotations

import posixpath

from llmgw.engines.base import (
    EngineError,
    Launch,
    NodeFacts,
    ShardRequest,
    binary,
    gpu_env,
    need_port,
)

NAME = "llama.cpp"
# The RPC worker ships beside llama-server; its name changed between releases.
RPC_BINARY = "ggml-rpc-server"
# Offload every layer: to the GPUs, or to the RPC workers, which count as devices.
ALL_LAYERS = "999"


def _threads(args: tuple[str, ...]) -> str | None:
    """The profile's thread count, which the RPC workers share with the leader."""
    for i, arg in enumerate(args):
        if arg in ("-t", "--threads") and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return None


def rpc_binary(node: NodeFacts) -> str:
    return node.binaries.get("llama.cpp-rpc") or posixpath.join(
        posixpath.dirname(binary(node, NAME)), RPC_BINARY)


def render(req: ShardRequest, node: NodeFacts) -> Launch:
    port = need_port(req)
    env = gpu_env(req.gpus)
    if not req.serves:
        argv = [rpc_binary(node), "--host", node.bind_address, "--port", str(port)]
        threads = _threads(req.args)
        if threads:
            argv += ["--threads", threads]
        return Launch(tuple(argv), env, port, health_path=None, tcp_ready=True,
                      description=f"llama.cpp RPC worker {req.rank}/{req.world_size}")
    if not req.weights:
        raise EngineError(f"{req.model}: llama.cpp needs a GGUF file; set the profile's weights")
    layers = ALL_LAYERS if req.gpus or req.world_size > 1 else "0"
    argv = [
        binary(node, NAME),
        "--model", req.weights,
        "--alias", req.model,
        "--host", node.bind_address,
        "--port", str(port),
        "--n-gpu-layers", layers,
    ]
    if req.embeddings:
        argv.append("--embeddings")
    workers: tuple[str, ...] = ()
    if req.world_size > 1:
        workers = req.peers[1:]
        if len(workers) != req.world_size - 1:
            raise EngineError(f"{req.replica}: the leader needs the address of every worker")
        argv += ["--rpc", ",".join(workers)]
    argv += req.args
    return Launch(tuple(argv), env, port, health_path="/health", wait_for=workers,
                  description=f"llama-server {req.model}")


def help_argv(argv: tuple[str, ...]) -> tuple[tuple[str, ...], int, int]:
    """The command that prints the help of the program ``argv`` runs; how many leading
    tokens of ``argv`` name the program rather than pass flags to it; and how many lines a
    full help text has at least (llama-server's is about 730, ggml-rpc-server's 10)."""
    server = "--model" in argv
    return (argv[0], "--help"), 1, 500 if server else 8


def widest() -> list[ShardRequest]:
    """Every shape of command llmgw can produce, for engine-check: a flag used only in a
    multi-node launch is the one nobody notices has gone."""
    peers = ("10.0.0.1:20001", "10.0.0.2:20001")
    common = dict(replica="r-e1", world_size=2, model="m", port=20001, peers=peers,
                  leader_address="10.0.0.1", rendezvous_port=20002)
    return [
        ShardRequest(rank=0, gpus=(0, 1), weights="/m.gguf", embeddings=True, **common),
        ShardRequest(rank=1, gpus=(0,), args=("--threads", "4"), **common),
    ]
