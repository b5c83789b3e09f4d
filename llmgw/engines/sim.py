"""The built-in ``sim`` engine: deterministic, OpenAI-compatible, runs anywhere.

Multi-node like a real engine: the leader binds a rendezvous port and serves nothing until
every worker has joined; workers serve no HTTP at all.
"""

from __future__ import annotations

from llmgw.engines.base import EngineError, Launch, NodeFacts, ShardRequest, gpu_env

NAME = "sim"
# Flags this adapter relies on (checked against `python -m llmgw.sim --help`).
FLAGS = ("--host", "--port", "--model", "--rank", "--world-size", "--rendezvous")


def render(req: ShardRequest, node: NodeFacts) -> Launch:
    argv = [node.python, "-m", "llmgw.sim", "--model", req.model]
    if req.world_size > 1:
        if req.rendezvous_port is None or not req.leader_address:
            raise EngineError(
                "a multi-node sim shard needs the leader's address and rendezvous port"
            )
        argv += [
            "--rank", str(req.rank),
            "--world-size", str(req.world_size),
            "--rendezvous", f"{req.leader_address}:{req.rendezvous_port}",
        ]
    serves = req.rank == 0
    if serves:
        if req.port is None:
            raise EngineError("the serving rank needs a port")
        argv += ["--host", node.bind_address, "--port", str(req.port)]
    argv += list(req.args)
    env = {**dict(req.env), **gpu_env(req.gpus)}
    return Launch(
        argv=tuple(argv),
        env=env,
        port=req.port if serves else None,
        health_path="/health" if serves else None,
        description=f"sim {req.model} rank {req.rank}/{req.world_size}",
    )
