"""Engine adapters, one module per engine; shared by the agent and ``llmgw ctl``.

Every adapter module has the same shape: ``NAME``; ``render(request, node) -> Launch``,
pure; ``help_argv(argv)``, the command that prints the help of the program a rendered
argv runs (with how many tokens name the program, and how long a full help text is);
``widest()``, every shape of request llmgw can make of it (engine-check renders these and
checks each flag). ``ADAPTERS`` holds one per name in core.engine_names, the list of
engines (tests/unit/test_engines.py holds the two to each other).
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

from llmgw.engines import comfyui, llamacpp, sglang, sim, vllm
from llmgw.engines.base import EngineError, Launch, NodeFacts, ShardRequest

ADAPTERS: dict[str, ModuleType] = {
    m.NAME: m for m in (sim, llamacpp, vllm, sglang, comfyui)
}
# Paths an adapter may take from agent.yaml's engines beside the engine's own binary.
HELPER_BINARIES = frozenset({"llama.cpp-rpc", "comfyui-python"})


def adapter(engine: str) -> ModuleType:
    found = ADAPTERS.get(engine)
    if found is None:
        raise EngineError(
            f"this llmgw cannot launch engine {engine!r}; it knows " + ", ".join(sorted(ADAPTERS))
        )
    return found


def health_path(engine: str) -> str:
    """Where a serving rank 0 of ``engine`` answers 200 while it serves (the gateway's
    own check): ``HEALTH_PATH`` where an adapter names one, else /health."""
    return getattr(ADAPTERS.get(engine), "HEALTH_PATH", "/health")


def render(engine: str, req: ShardRequest, node: NodeFacts) -> Launch:
    """The launch for one shard: the adapter's, plus the profile's own environment."""
    launch = adapter(engine).render(req, node)
    return replace(launch, env={**dict(req.env), **launch.env})


__all__ = [
    "ADAPTERS", "HELPER_BINARIES", "EngineError", "Launch", "NodeFacts", "ShardRequest",
    "adapter", "render",
]
