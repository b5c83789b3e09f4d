"""Engine adapters, one module per engine; shared by the agent and ``llmgw ctl``."""

from __future__ import annotations

from types import ModuleType

from llmgw.engines import sim
from llmgw.engines.base import EngineError, Launch, NodeFacts, ShardRequest

ADAPTERS: dict[str, ModuleType] = {sim.NAME: sim}


def render(engine: str, req: ShardRequest, node: NodeFacts) -> Launch:
    adapter = ADAPTERS.get(engine)
    if adapter is None:
        raise EngineError(
            f"this agent cannot launch engine {engine!r}; it knows " + ", ".join(sorted(ADAPTERS))
        )
    return adapter.render(req, node)


__all__ = ["ADAPTERS", "EngineError", "Launch", "NodeFacts", "ShardRequest", "render"]
