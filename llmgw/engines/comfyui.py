"""ComfyUI: one process on one GPU; its API is its own, not OpenAI's.

The engine's binary is ComfyUI's ``main.py``; it runs on the Python of the environment
beside it (``<dir>/venv/bin/python``), which is how the agent installs it.
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

NAME = "comfyui"
# ComfyUI has no /health; this answers 200 once it serves.
HEALTH_PATH = "/system_stats"


def python_for(main: str, node: NodeFacts) -> str:
    return node.binaries.get("comfyui-python") or posixpath.join(
        posixpath.dirname(main), "venv", "bin", "python")


def render(req: ShardRequest, node: NodeFacts) -> Launch:
    if req.world_size > 1 or req.gpu_count > 1:
        raise EngineError(f"{req.model}: ComfyUI runs on one GPU of one node; "
                          "set the profile to nodes: 1 and gpus: 1")
    main = binary(node, NAME)
    port = need_port(req)
    argv = [python_for(main, node), main, "--listen", node.bind_address, "--port", str(port)]
    # No --cuda-device: ComfyUI would overwrite CUDA_VISIBLE_DEVICES with it, and the
    # placed GPU is already the only one it can see. Without a GPU it must be told.
    if not req.gpus:
        argv.append("--cpu")
    argv += req.args
    return Launch(tuple(argv), gpu_env(req.gpus), port, health_path=HEALTH_PATH,
                  description=f"comfyui {req.model}")


def help_argv(argv: tuple[str, ...]) -> tuple[tuple[str, ...], int, int]:
    return (argv[0], argv[1], "--help"), 2, 60


def widest() -> list[ShardRequest]:
    return [ShardRequest("r-e1", 0, 1, "flux", port=20001, gpus=(3,)),
            ShardRequest("r-e1", 0, 1, "flux", port=20001)]
