"""What the controller counts for ``/metrics``: its passes, its actions, placement's
refusals, the agent streams, and replicas that failed.

Plain numbers (server/series.py) the controller adds to on the event loop; the metrics
collector reads them when scraped. Every label comes from a fixed set or the catalog.
"""

from __future__ import annotations

from llmgw.server.series import Count, Histogram

# What a pass may do: place a replica, stop one (scale down, a model removed, a drain),
# reap a failed one or one whose node was lost, evict one for a model of higher priority,
# keep one routed as an orphan while its replacement starts.
ACTIONS = ("place", "stop", "reap", "evict", "orphan")
# A pass takes milliseconds; thousands of nodes, or a slow store, make it seconds.
PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0)


class ControllerStats:
    def __init__(self) -> None:
        self.pass_seconds = Histogram(PASS_BUCKETS)
        self.actions = {kind: Count() for kind in ACTIONS}
        # Placement's refusals, by reason class (core.placement.REFUSAL_KINDS): one per
        # node turned down, counted once per change of a model's refusals, not every pass.
        self.refusals: dict[str, Count] = {}
        # Replicas that failed (crashed, or never became ready), per catalog model.
        self.failures: dict[str, Count] = {}
        self.stream_connects = Count()
        self.stream_disconnects = Count()

    def pass_done(self, seconds: float) -> None:
        self.pass_seconds.observe(seconds)

    def action(self, kind: str) -> None:
        self.actions[kind].n += 1

    def refused(self, kind: str) -> None:
        count = self.refusals.get(kind)
        if count is None:
            count = self.refusals[kind] = Count()
        count.n += 1

    def failed(self, model: str) -> None:
        """``model``: a name from the catalog (the controller reaps only those)."""
        count = self.failures.get(model)
        if count is None:
            count = self.failures[model] = Count()
        count.n += 1
