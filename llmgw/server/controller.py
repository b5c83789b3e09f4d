"""The controller: runs the pure planner on a loop and carries out what it decides.

It owns the replicas (in memory: the running shards are the truth, and agents report
them again on every connection, so a restarted controller adopts rather than restarts),
the crash-loop backoffs, and the routing table that the gateway reads. Events (a node
registering, a shard changing state) only wake the loop early; every pass looks at the
whole picture.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime

import msgspec

from llmgw import config, wire
from llmgw.core import reconcile
from llmgw.core.catalog import Catalog
from llmgw.core.desired_engines import desired_engines, settings_problems
from llmgw.core.inventory import NodeState, inventory_changes, node_from_register
from llmgw.core.names import hostport, replica_id
from llmgw.core.placement import newly_qualified
from llmgw.core.replicas import (
    Replica,
    ReplicaState,
    Shard,
    adopt,
    apply_status,
    fail,
    new_replica,
)
from llmgw.server.agents.sessions import NodeSession, NodeSessions
from llmgw.store import NodeRecord, Store, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

# How long a stopping replica's GPUs and ports stay taken if its node never confirms.
_RELEASE_DEADLINE_S = 30.0
DRAINING_SETTING = "draining_nodes"


class Controller:
    def __init__(self, catalog: Catalog, store: Store, sessions: NodeSessions,
                 policy: reconcile.Policy, interval_s: float, heartbeat_interval_s: float,
                 clock: Callable[[], float] = time.time,
                 settings: config.ServerConfig | None = None):
        self.catalog = catalog
        self.store = store
        self.sessions = sessions
        self.policy = policy
        self.interval_s = interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        # Replicas being stopped: their GPUs and ports stay taken until the shards let go.
        self.releasing: dict[str, tuple[Replica, float]] = {}
        # Requests in flight per replica, for choosing which replica to scale down.
        self.load: Callable[[], dict[str, int]] = dict
        self.backoffs: dict[str, reconcile.Backoff] = {}
        self.unplaced: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._expected: set[str] = set()
        # Nodes that registered while the store did not answer: written by the next pass.
        self._unrecorded: set[str] = set()
        self._settle_until = 0.0
        self._listeners: list[Callable[[Controller], None]] = []
        self._lock = asyncio.Lock()
        # server.yaml's engines and overrides, and what each node was last asked for.
        self.settings = settings or config.ServerConfig()
        self.engines_sent: dict[str, list[wire.EngineWanted]] = {}
        for problem in settings_problems(self.settings):
            log.warning("server.yaml: %s", problem)

    # --- the loop --------------------------------------------------------------------------

    def on_change(self, listener: Callable[[Controller], None]) -> None:
        self._listeners.append(listener)

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        await self._expect_known_nodes()
        while True:
            try:
                await self.pass_once()
            except StoreUnavailable:
                pass  # the store logged the outage; the next pass tries again
            except Exception:
                log.exception("reconcile pass failed; the next pass will try again")
            self._wake.clear()
            # Not asyncio.wait_for: on 3.11 it can swallow a cancel that arrives as the
            # wait completes (CPython gh-86296), and the server would never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()

    async def _expect_known_nodes(self) -> None:
        """After a restart, give the nodes that were up a grace period to report what they
        run before placing anything: a replica placed while its node is still dialling
        back would be a duplicate, and the scale-down would then stop the original."""
        known = {n.id for n in await self.store.list_nodes() if n.state != "lost"}
        if known:
            self._expected = known
            self._settle_until = self.clock() + self.policy.adoption_grace_s
            log.info("waiting up to %g s for %d known node(s) to report what they run",
                     self.policy.adoption_grace_s, len(known))

    def _settling(self, now: float) -> str | None:
        if not self._expected:
            return None
        missing = sorted(n for n in self._expected if self.sessions.get(n) is None)
        if not missing or now >= self._settle_until:
            if missing:
                log.warning("placing without %s: not back within %g s", ", ".join(missing),
                            self.policy.adoption_grace_s)
            self._expected = set()
            return None
        return (f"waiting for {', '.join(missing)} to report what they run after a "
                f"restart (at most {self._settle_until - now:.0f} s more)")

    async def pass_once(self) -> reconcile.Plan:
        async with self._lock:
            now = self.clock()
            for node_id in sorted(self._unrecorded):  # seen during an outage
                try:
                    await self._record_node(node_id, now)
                except StoreUnavailable:
                    break  # still out: the pass goes on from memory
            for node_id, old, new in self.sessions.refresh(now):
                log.info("node %s: %s -> %s", node_id, old.value, new.value)
                try:
                    await self.store.set_node_state(node_id, new.value, _utc(now))
                except StoreUnavailable:
                    self._unrecorded.add(node_id)  # its state too, once the store answers
                except StoreError as err:
                    # One node the store does not have yet (its registration is still
                    # being written, and writes the state with it): not a reason to drop
                    # the whole pass for every other node.
                    log.info("node %s: state not recorded: %s", node_id, err)
                if new is NodeState.LOST and self.sessions.close(node_id):
                    # Its stream outlived the silence (a paused VM, a short partition): make
                    # it register again, so what it still runs is adopted afresh.
                    log.warning("node %s was lost with its stream still open; closing it so "
                                "the node registers again", node_id)
            self.backoffs = reconcile.settle_backoffs(
                self.backoffs, self.replicas.values(), now, self.policy)
            self._let_go(now)
            settling = self._settling(now)
            if settling:
                self.unplaced = {m.name: settling for m in self.catalog.models}
                self._changed()
                return reconcile.Plan(unplaced=self.unplaced)
            plan = reconcile.plan(self.catalog, self.sessions.nodes(), self.replicas.values(),
                                  self.backoffs, now, self.policy, load=self.load(),
                                  held=[r for r, _ in self.releasing.values()])
            for action in plan.actions:
                await self._apply(action, now)
            self.unplaced = dict(plan.unplaced)
            self._changed()
            return plan

    async def _apply(self, action: reconcile.Action, now: float) -> None:
        if isinstance(action, reconcile.Place):
            await self._place(action, now)
        elif isinstance(action, reconcile.Reap):
            replica = self.replicas.pop(action.replica)
            if action.crashed:
                log.warning("replica %s of %s failed: %s", replica.id, replica.model,
                            action.reason)
                self.backoffs[replica.model] = reconcile.after_failure(
                    self.backoffs.get(replica.model, reconcile.Backoff()), now, self.policy)
            else:
                log.warning("replica %s of %s is placed again: %s", replica.id,
                            replica.model, action.reason)
            self._stop_shards(replica, action.reason, now)
        elif isinstance(action, reconcile.Evict):
            replica = self.replicas.pop(action.replica)
            log.warning("preempting replica %s of %s: %s", replica.id, replica.model,
                        action.reason)
            self._stop_shards(replica, action.reason, now)
        elif isinstance(action, reconcile.Stop):
            replica = self.replicas.pop(action.replica)
            log.info("stopping replica %s of %s: %s", replica.id, replica.model, action.reason)
            self._stop_shards(replica, action.reason, now)

    async def _place(self, action: reconcile.Place, now: float) -> None:
        placement = action.placement
        model = self.catalog.get(placement.model)
        profile = model.profile(placement.profile)
        epoch = await self.store.next_epoch()
        replica = new_replica(replica_id(model.name, epoch), placement, epoch, now)
        self.replicas[replica.id] = replica
        log.info("replica %s of %s: %s", replica.id, model.name, placement.describe())
        leader = placement.shards[0]
        peers = [hostport(s.address, s.port) for s in placement.shards]
        for shard in placement.shards:
            message = wire.StartShard(
                replica=replica.id, rank=shard.rank, world_size=replica.world_size,
                epoch=epoch, model=model.name,
                profile=wire.ShardProfile(
                    name=profile.name, engine=profile.engine, args=list(profile.args),
                    env=dict(profile.env), weights=profile.weights, source=profile.source,
                    files=list(profile.files), weights_key=model.weights_key(profile),
                    startup_timeout_s=profile.startup_timeout_s,
                    embeddings=profile.embeddings, launch_mode=profile.launch_mode,
                    sidecars=[wire.Sidecar(name=sc.name, command=list(sc.command),
                                           env=dict(sc.env), port=sc.port,
                                           startup_timeout_s=sc.startup_timeout_s)
                              for sc in profile.sidecars]),
                port=shard.port, gpus=list(shard.gpus), leader_address=leader.address,
                rendezvous_port=placement.rendezvous_port, peers=peers,
            )
            if not self.sessions.send(shard.node_id, message):
                self.replicas[replica.id] = fail(
                    self.replicas[replica.id], f"node {shard.node_id} disconnected before start")
                self.wake()

    def _stop_shards(self, replica: Replica, reason: str, now: float) -> None:
        """Ask every live shard to stop, and hold the replica's GPUs and ports until they
        say they have (or a deadline passes), so nothing new is placed onto them early."""
        stopping = False
        for shard in replica.shards:
            if shard.state in ("failed", "stopped"):
                continue
            if self.sessions.send(shard.node_id, wire.StopShard(
                    replica=replica.id, rank=shard.rank, epoch=replica.epoch, reason=reason)):
                stopping = True
        if stopping:
            held = replace(replica, state=ReplicaState.STOPPED, reason=reason)
            self.releasing[replica.id] = (held, now + _RELEASE_DEADLINE_S)

    def _let_go(self, now: float) -> None:
        for rid, (replica, deadline) in list(self.releasing.items()):
            done = all(s.state in ("failed", "stopped") for s in replica.shards)
            if done or now >= deadline:
                del self.releasing[rid]

    # --- events from the stream ------------------------------------------------------------

    async def node_registered(self, msg: wire.Register, now: float
                              ) -> tuple[NodeSession, int]:
        async with self._lock:
            before = self.sessions.get(msg.node_id)
            old_inventory = before.register.inventory if before is not None else None
            session, connection = self.sessions.attach(msg, now)
            log.info("node %s registered from %s with %d running shard(s)", msg.node_id,
                     msg.address, len(msg.running))
            self._log_inventory_change(msg, old_inventory)
            self._adopt(msg, now)
            self.sessions.refresh_node(msg.node_id, now)
            self.engines_sent.pop(msg.node_id, None)
            self._ask_for_engines(msg)
        try:
            await self._record_node(msg.node_id, now)
        except StoreUnavailable:
            # The node serves from memory meanwhile; a pass writes it once the store
            # answers (the store logged the outage).
            self._unrecorded.add(msg.node_id)
        self._changed()
        self.wake()
        return session, connection

    async def _record_node(self, node_id: str, now: float) -> None:
        session = self.sessions.get(node_id)
        msg = session.register
        await self.store.put_node(NodeRecord(
            id=node_id, address=msg.address, state=session.state.value,
            inventory=_inventory_dict(msg.inventory), registered_at=_utc(now),
            last_seen_at=_utc(now)))
        self._unrecorded.discard(node_id)

    def node_welcomed(self, node_id: str, now: float) -> None:
        """The node was told it is welcome: its liveness clock starts now, since it sends
        heartbeats only from here. (From its Register, a pass in progress and the store
        write stood between; in a reconnect storm, long enough to call it unreachable.)"""
        self.sessions.seen(node_id, now)

    async def inventory_changed(self, node_id: str, msg: wire.InventoryUpdate,
                                now: float) -> None:
        """A node's inventory changed while connected (more RAM, an engine, weights)."""
        session = self.sessions.get(node_id)
        if session is None:
            return
        old = session.register
        self.sessions.update_inventory(node_id, msg.inventory, now)
        self._log_inventory_change(self.sessions.get(node_id).register, old.inventory)
        self._ask_for_engines(self.sessions.get(node_id).register)
        try:
            stored = await self.store.get_node(node_id)
            await self.store.put_node(NodeRecord(
                id=node_id, address=old.address, state=session.state.value,
                inventory=_inventory_dict(msg.inventory),
                registered_at=stored.registered_at if stored else _utc(now),
                last_seen_at=_utc(now)))
        except StoreUnavailable:
            self._unrecorded.add(node_id)  # written by a pass once the store answers
        self._changed()
        self.wake()

    def _ask_for_engines(self, msg: wire.Register) -> None:
        """Send the node the engines it should have, when that differs from what it was
        last sent on this stream (a new label or GPU can change it)."""
        wanted = desired_engines(self.settings, msg)
        if self.engines_sent.get(msg.node_id) == wanted:
            return
        if self.sessions.send(msg.node_id, wire.InstallEngines(engines=wanted)):
            self.engines_sent[msg.node_id] = wanted
            log.info("asked %s for engines: %s", msg.node_id,
                     ", ".join(f"{e.name} {e.version}" for e in wanted) or "none")

    def _log_inventory_change(self, msg: wire.Register, old: wire.Inventory | None) -> None:
        # "The node now qualifies" answers why a model placed an hour after it was asked for.
        if old is None:
            return
        changes = inventory_changes(old, msg.inventory)
        if not changes:
            return
        log.info("node %s changed: %s", msg.node_id, "; ".join(changes))
        state = NodeState.READY
        before = node_from_register(msgspec.structs.replace(msg, inventory=old), state, 0.0)
        after = node_from_register(msg, state, 0.0)
        for line in newly_qualified(self.catalog.models, before, after):
            log.info("%s", line)

    def _adopt(self, msg: wire.Register, now: float) -> None:
        reported = {(s.replica, s.rank) for s in msg.running}
        # Shards this node should have but no longer reports are gone.
        for rid, replica in list(self.replicas.items()):
            for shard in replica.shards:
                if shard.node_id == msg.node_id and (rid, shard.rank) not in reported:
                    self.replicas[rid] = apply_status(
                        self.replicas[rid], rank=shard.rank, epoch=replica.epoch,
                        state="failed", now=now,
                        detail=f"{msg.node_id} came back without it")
        for running in msg.running:
            model = self.catalog.get(running.model)
            if model is None or model.profile(running.profile) is None:
                log.info("stopping %s on %s: model %s is not declared", running.replica,
                         msg.node_id, running.model)
                self.sessions.send(msg.node_id, wire.StopShard(
                    replica=running.replica, rank=running.rank, epoch=running.epoch,
                    reason=f"model {running.model} is not declared"))
                continue
            existing = self.replicas.get(running.replica)
            shard = Shard(running.rank, msg.node_id, msg.address, running.port,
                          state=running.state)
            if existing is not None and existing.shard(running.rank) is not None:
                old = existing.shard(running.rank)
                shard = replace(shard, gpus=old.gpus)
            self.replicas[running.replica] = adopt(
                existing, replica_id=running.replica, model=running.model,
                profile=running.profile, epoch=running.epoch, world_size=running.world_size,
                shard=shard, now=now)

    def shard_status(self, node_id: str, msg: wire.ShardStatus, now: float) -> None:
        releasing = self.releasing.get(msg.replica)
        if releasing is not None and msg.state in ("stopped", "failed"):
            replica, deadline = releasing
            shards = tuple(replace(s, state="stopped") if s.rank == msg.rank else s
                           for s in replica.shards)
            self.releasing[msg.replica] = (replace(replica, shards=shards), deadline)
            self.wake()
            return
        replica = self.replicas.get(msg.replica)
        if replica is None:
            return
        shard = replica.shard(msg.rank)
        if shard is None or shard.node_id != node_id:
            log.warning("%s reported rank %d of %s, which is not placed there; ignored",
                        node_id, msg.rank, msg.replica)
            return
        updated = apply_status(replica, rank=msg.rank, epoch=msg.epoch, state=msg.state,
                               now=now, port=msg.port, detail=msg.detail,
                               output_tail=tuple(msg.output_tail))
        self.replicas[msg.replica] = updated
        if updated.state != replica.state:
            log.info("replica %s of %s: %s -> %s%s", replica.id, replica.model,
                     replica.state.value, updated.state.value,
                     f" ({updated.reason})" if updated.state == "failed" else "")
            if msg.output_tail and msg.state == "failed":
                log.warning("last output of %s rank %d:\n%s", replica.id, msg.rank,
                            "\n".join(msg.output_tail[-10:]))
            self._changed()
            self.wake()

    async def load_draining(self) -> None:
        for node_id in await self.store.get_setting(DRAINING_SETTING, []):
            self.sessions.set_draining(node_id, True)

    async def set_catalog(self, catalog: Catalog) -> None:
        """Models were added, removed or scaled over the admin API: plan with them now.
        Swapped under the pass lock, so no pass sees half of the change."""
        async with self._lock:
            self.catalog = catalog
        log.info("catalog: %s", ", ".join(f"{m.name} x{m.replicas}" for m in catalog.models)
                 or "no models")
        await self.pass_once()

    async def set_draining(self, node_id: str, draining: bool) -> None:
        """An operator drains a node: its replicas move elsewhere, each stopping once its
        replacement serves; nothing new is placed there until it is undrained."""
        self.sessions.set_draining(node_id, draining)
        await self.store.put_setting(DRAINING_SETTING, sorted(self.sessions.draining))
        log.info("node %s: %s", node_id, "draining" if draining else "undrained")
        # A pass now, so the answer to the operator already shows the new state.
        await self.pass_once()

    def node_disconnected(self, node_id: str, connection: int) -> None:
        self.sessions.detach(node_id, connection)
        log.info("node %s disconnected", node_id)
        self.wake()

    # --- what the gateway and the admin API read -------------------------------------------

    def _changed(self) -> None:
        for listener in self._listeners:
            listener(self)

    def ready_endpoints(self) -> dict[str, list[tuple[str, str, int, int | None]]]:
        """Per model, the (replica, address, port, slots) of every replica ready to serve."""
        routes: dict[str, list[tuple[str, str, int, int | None]]] = {}
        for replica in self.replicas.values():
            endpoint = replica.endpoint()
            if endpoint is not None:
                model = self.catalog.get(replica.model)
                profile = model.profile(replica.profile) if model else None
                routes.setdefault(replica.model, []).append(
                    (replica.id, *endpoint, profile.slots if profile else None))
        return routes

    def why_not_ready(self, model: str) -> str:
        """In words an operator can act on: why ``model`` has no ready replica right now."""
        if model in self.unplaced:
            return self.unplaced[model]
        mine = [r for r in self.replicas.values() if r.model == model]
        if not mine:
            return "no replica is placed yet"
        return "; ".join(f"{r.id} is {r.state.value}" + (f" ({r.reason})" if r.reason else "")
                         for r in mine)



def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _inventory_dict(inventory: wire.Inventory) -> dict:
    return msgspec.to_builtins(inventory)
