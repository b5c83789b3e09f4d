"""The engine builds operators chose per node, as this server last read or wrote them.

The store keeps them (``llmgw.store.engine_builds``), so they survive restarts and every
server of a cluster shares them. The leader reads them with the models and the drains, at
most once a controller interval, and again whenever it writes one; a choice made over a
follower's admin API reaches the node within the leader's next read. A read that began
before this server wrote a choice is not taken: it would undo the choice for a moment,
and the node would be told the old build and then the new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.core.desired_engines import ChosenBuilds
from llmgw.store import Store


@dataclass(frozen=True, slots=True)
class BuildsRead:
    """What one read of the store found, and which of this server's writes it may miss."""

    by_node: dict[str, dict[str, str]]
    generation: int


@dataclass
class EngineBuilds:
    store: Store
    by_node: dict[str, dict[str, str]] = field(default_factory=dict)
    # Bumped by each write of this server: a read from before one is stale.
    generation: int = 0

    def of(self, node_id: str) -> ChosenBuilds:
        return self.by_node.get(node_id, {})

    async def read(self) -> BuildsRead:
        generation = self.generation
        return BuildsRead(await self.store.engine_builds(), generation)

    def take(self, found: BuildsRead) -> set[str]:
        """Take what a read found; the nodes whose choices changed. A stale read is left."""
        if found.generation != self.generation or found.by_node == self.by_node:
            return set()
        changed = {n for n in found.by_node.keys() | self.by_node.keys()
                   if found.by_node.get(n) != self.by_node.get(n)}
        self.by_node = found.by_node
        return changed

    async def put(self, node_id: str, engine: str, build: str | None) -> None:
        """Keep ``build`` as ``node_id``'s choice of ``engine`` (None: forget it), in the
        store and here."""
        await self.store.put_engine_build(node_id, engine, build)
        self.generation += 1
        chosen = dict(self.of(node_id))
        if build is None:
            chosen.pop(engine, None)
        else:
            chosen[engine] = build
        self.by_node = {**self.by_node, node_id: chosen}
        if not chosen:
            del self.by_node[node_id]
