"""Node upgrades in flight (``POST /api/nodes/{node}/upgrade``, ``llmgw ctl upgrade``).

One node at a time, cluster-wide: the route sends the node's agent an UpgradeAgent with
the wheels of the llmgw release the mirror holds; the agent reports its steps
(UpgradeStatus), installs, and restarts into the new llmgw, which registers again. The
upgrade is done when the node is back with the new version, every shard it ran when asked
was adopted (the new agent found it running: same process, no restart), and each of
those replicas serves again. It fails on the agent's word, on the node coming back with
another version, on a shard not adopted, or when ``timeout_s`` passes; the node runs on
as it was in each case but the last two, which say what happened instead.

The state is the leader's, in memory: a new leader knows of no upgrade in flight, and a
node's version in ``GET /api/nodes`` says where it stands.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from llmgw import wire
from llmgw.core.replicas import Replica, ReplicaState

# UpgradeView.state
SENT = "sent"  # told; the agent has not answered yet
WORKING = "working"  # the agent is downloading, installing or checking
RESTARTING = "restarting"  # installed; the new llmgw has not registered yet
ADOPTING = "adopting"  # back with the new version; its replicas are not all ready yet
DONE = "done"
FAILED = "failed"
FINISHED = frozenset({DONE, FAILED})


class UpgradeView(msgspec.Struct, kw_only=True):
    node: str
    version: str  # the release it is going to
    from_version: str
    state: str
    detail: str
    started_at: float
    finished_at: float | None = None
    # The replicas the node served when asked, each to be adopted and ready again.
    replicas: list[str] = []


class UpgradeBusy(Exception):
    """Another node is upgrading; the message names it."""


@dataclass
class _Upgrade:
    view: UpgradeView
    request: str
    timeout_s: float
    shards: frozenset[tuple[str, int]] = field(default_factory=frozenset)


class AgentUpgrades:
    def __init__(self, send: Callable[[str, wire.Down], bool]):
        self._send = send
        self._by_node: dict[str, _Upgrade] = {}

    def get(self, node: str) -> UpgradeView | None:
        found = self._by_node.get(node)
        return found.view if found is not None else None

    def under_way(self) -> UpgradeView | None:
        return next((u.view for u in self._by_node.values()
                     if u.view.state not in FINISHED), None)

    def begin(self, node: str, message_version: str, wheels: list[wire.UpgradeWheel],
              from_version: str, shards: Iterable[tuple[str, int]], now: float,
              timeout_s: float) -> UpgradeView:
        """Send the node its UpgradeAgent; UpgradeBusy when another node is upgrading.
        ``shards``: (replica, rank) of what the node serves now, each to be adopted."""
        busy = self.under_way()
        if busy is not None:
            raise UpgradeBusy(f"node {busy.node} is upgrading to llmgw {busy.version} "
                              f"({busy.state}: {busy.detail}); one node at a time: wait for "
                              "it (llmgw ctl upgrade waits)")
        request = secrets.token_hex(8)
        shards = frozenset(shards)
        view = UpgradeView(node=node, version=message_version,
                           from_version=from_version or "unknown", state=SENT,
                           detail="asked the agent to upgrade", started_at=now,
                           replicas=sorted({replica for replica, _ in shards}))
        self._by_node[node] = _Upgrade(view, request, timeout_s, shards)
        if not self._send(node, wire.UpgradeAgent(request=request, version=message_version,
                                                  wheels=wheels)):
            self._finish(self._by_node[node], FAILED, now,
                         f"node {node} disconnected just now; try again once it is back")
        return view

    @staticmethod
    def _finish(upgrade: _Upgrade, state: str, now: float, detail: str) -> None:
        upgrade.view.state, upgrade.view.detail = state, detail
        upgrade.view.finished_at = now

    def reported(self, node: str, message: wire.UpgradeStatus, now: float) -> None:
        """The agent's word on the upgrade it was asked for."""
        upgrade = self._by_node.get(node)
        # After RESTARTING, a late word from the old agent's stream changes nothing.
        if (upgrade is None or upgrade.request != message.request
                or upgrade.view.state not in (SENT, WORKING)):
            return
        if message.state == wire.UPGRADE_FAILED:
            self._finish(upgrade, FAILED, now, f"the agent did not upgrade: {message.detail}")
        elif message.state == wire.UPGRADE_RESTARTING:
            upgrade.view.state, upgrade.view.detail = RESTARTING, message.detail
        else:
            upgrade.view.state, upgrade.view.detail = WORKING, message.detail

    def registered(self, msg: wire.Register, now: float) -> None:
        """The node registered: the new llmgw (or not) is back."""
        upgrade = self._by_node.get(msg.node_id)
        if upgrade is None or upgrade.view.state in FINISHED:
            return
        view = upgrade.view
        if msg.agent_version != view.version:
            # Once it was told to restart, or came back new, another version is a failure.
            if view.state not in (SENT, WORKING):
                self._finish(upgrade, FAILED, now,
                             f"the node came back running llmgw {msg.agent_version or '?'}, "
                             f"not {view.version}: the new installation did not start (its "
                             "agent's log says why); the node runs the llmgw it came back "
                             "with")
            # Earlier, it reconnected mid-install (a network blip): the agent carries on.
            return
        running = {(s.replica, s.rank) for s in msg.running}
        lost = sorted(upgrade.shards - running)
        if lost:
            named = ", ".join(f"{replica} rank {rank}" for replica, rank in lost)
            self._finish(upgrade, FAILED, now,
                         f"llmgw {view.version} runs, but it did not find {named} running "
                         "as before: the control plane starts them again")
            return
        view.state = ADOPTING
        view.detail = (f"llmgw {view.version} registered and adopted "
                       f"{len(upgrade.shards)} shard(s)")

    def refresh(self, now: float, replicas: Mapping[str, Replica]) -> None:
        """Finish the upgrade whose replicas all serve again, or whose time is up."""
        for upgrade in self._by_node.values():
            view = upgrade.view
            if view.state in FINISHED:
                continue
            if view.state == ADOPTING:
                waiting = [r for r in view.replicas if r in replicas
                           and replicas[r].state is not ReplicaState.READY]
                if not waiting:
                    self._finish(upgrade, DONE, now,
                                 f"llmgw {view.version} runs; "
                                 + (f"{len(view.replicas)} replica(s) adopted and ready"
                                    if view.replicas else "no replica ran there"))
                    continue
                view.detail = f"waiting for {', '.join(waiting)} to be ready again"
            if now - view.started_at > upgrade.timeout_s:
                self._finish(upgrade, FAILED, now,
                             f"not done within {upgrade.timeout_s:g} s; last: {view.detail}")
