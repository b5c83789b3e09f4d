"""The controller: runs the pure planner on a loop and carries out what it decides.

It owns the replicas (the running shards are the truth, and agents report them again on
every connection, so a restarted controller adopts rather than restarts), the crash-loop
backoffs, and the routing table that the gateway reads. Events (a node registering, a
shard changing state) only wake the loop early; every pass looks at the whole picture.

Only the leader's controller plans (server/leadership.py): it writes its replica table to
the store after each pass that changed it, fenced by its term. On the other servers the
controller follows: it reads that table every ``follow_interval_s`` and routes by it. A
server starts from the stored table either way, so that it routes at once to what was
ready before it started; engines whose node has not reported to this server (or is
unreachable or lost) are routed to only while the gateway's own health check of them
passes (server/probe.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime

import msgspec
from opentelemetry import trace

import llmgw
from llmgw import config, wire
from llmgw.core import idle, reconcile
from llmgw.core.catalog import Catalog
from llmgw.core.desired_engines import (
    DEFAULT_CHOICE,
    BuildChoice,
    build_choices,
    desired_engines,
    settings_problems,
)
from llmgw.core.inventory import NodeState, inventory_changes, node_from_register
from llmgw.core.names import hostport, replica_id
from llmgw.core.placement import Refusal, newly_qualified
from llmgw.core.replicas import (
    Replica,
    ReplicaState,
    Shard,
    adopt,
    apply_status,
    fail,
    new_replica,
)
from llmgw.core.versions import behind_words
from llmgw.server import replica_table
from llmgw.server.activity import ModelActivity
from llmgw.server.agents.sessions import Close, NodeSession, NodeSessions
from llmgw.server.agents.shard_logs import ShardLogs
from llmgw.server.agents.upgrades import AgentUpgrades
from llmgw.server.catalog import catalog_of, entries
from llmgw.server.controller_stats import ControllerStats
from llmgw.server.endpoints import StaticEndpoints
from llmgw.server.engine_builds import BuildsRead, EngineBuilds
from llmgw.server.mirror import mirror_engines
from llmgw.store import NodeRecord, Store, StoreError, StoreUnavailable
from llmgw.store.leases import Fenced
from llmgw.tracing import OFF, Tracing, end

log = logging.getLogger(__name__)

# How long a stopping replica's GPUs and ports stay taken if its node never confirms.
_RELEASE_DEADLINE_S = 30.0
DRAINING_SETTING = "draining_nodes"
# The agent stream's close code for "this server does not lead; dial another".
CLOSE_NOT_LEADER = 4421


class Controller:
    def __init__(self, catalog: Catalog, store: Store, sessions: NodeSessions,
                 policy: reconcile.Policy, interval_s: float, heartbeat_interval_s: float,
                 clock: Callable[[], float] = time.time,
                 settings: config.ServerConfig | None = None,
                 follow_interval_s: float = 1.0):
        self.store = store
        self.sessions = sessions
        self.policy = policy
        self.interval_s = interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.clock = clock
        # Scale to zero (core/idle.py): when each model that can sleep was last asked for,
        # those asleep now (placed only to their min_replicas), and those a request woke
        # (model -> until when, wall clock, its requests wait for a replica).
        self.activity = ModelActivity(clock)
        self.asleep: frozenset[str] = frozenset()
        self.waking: dict[str, float] = {}
        self._take_catalog(catalog)
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
        # server.yaml's engines and overrides, the builds operators chose per node, and
        # what each node was last asked for.
        self.settings = settings or config.ServerConfig()
        self.engine_builds = EngineBuilds(store)
        self.engines_sent: dict[str, list[wire.EngineWanted]] = {}
        for problem in settings_problems(self.settings):
            log.warning("server.yaml: %s", problem)
        # Leadership (set by the server; a controller alone leads, unfenced). Holding the
        # lead: from taking the lease until deposed, even while not sure of it.
        self.term: int | None = None
        self.holds_lead = True
        self.leading: Callable[[], bool] = lambda: True
        self.not_leading: Callable[[], str] = lambda: "this server does not lead"
        self.follow_interval_s = follow_interval_s
        # Servers up (each routes with its share of an engine's slots).
        self.servers: Callable[[], int] = lambda: 1
        self._taking_over = True  # the next pass starts from the stored table's nodes
        # Replicas of a lost node: routed to while their engines answer and the model has
        # too few ready replicas without them (make before break); stopped when the node
        # returns. Not planned: placement sees them gone and places their replacements.
        self.orphans: dict[str, Replica] = {}
        # Replicas routed to only while the gateway's own check of their engine passes,
        # and those of them whose last check failed (server/probe.py).
        self.unsure: frozenset[str] = frozenset()
        self.probe_failed: frozenset[str] = frozenset()
        # Static endpoints (servers someone else runs, by URL), routed beside the
        # replicas while they answer this server's own check (server/endpoints.py).
        self.endpoints = StaticEndpoints()
        # Ready replicas whose node re-registered saying "starting": its agent restarted
        # and has not checked the engine yet. Kept routed, checked by the probe meanwhile.
        self._unconfirmed: set[str] = set()
        self._published: dict | None = None
        self._desired_due = 0.0  # when the leader next reads the models and drains
        # Traces (the server sets its own) and what /metrics reads.
        self.tracing: Tracing = OFF
        self.stats = ControllerStats()
        # `ctl logs` requests open on this server's node streams.
        self.shard_logs = ShardLogs(self.sessions.send)
        self.upgrades = AgentUpgrades(self.sessions.send)
        # Each replica's start, a span open from its placement until it serves or fails.
        self._starts: dict[str, trace.Span] = {}
        # Each unplaced model's refusals as last traced: a refusal is traced (and counted)
        # when it changes, not on every pass that repeats it.
        self._refusals_seen: dict[str, tuple[Refusal, ...]] = {}

    # --- the loop --------------------------------------------------------------------------

    def _take_catalog(self, catalog: Catalog) -> None:
        old = getattr(self, "catalog", Catalog())
        self.catalog = catalog
        # The models that can sleep: the only ones whose requests the gateway notes.
        self.sleepy = frozenset(m.name for m in catalog.models if m.idle_unload_s is not None)
        # A model new to the catalog is asleep until its first request (or the next pass,
        # or the leader's table, says otherwise); the others stay as they were.
        _, idle_now = idle.awake_catalog(catalog, self.activity.last, self.clock())
        self.asleep = frozenset(m for m in idle_now
                                if m in self.asleep or old.get(m) is None)

    def on_change(self, listener: Callable[[Controller], None]) -> None:
        self._listeners.append(listener)

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            leading = self.leading()
            try:
                if leading:
                    await self.pass_once()
                else:
                    await self.follow()
            except StoreUnavailable:
                pass  # the store logged the outage; the next pass tries again
            except Fenced as err:
                self.deposed(str(err))
            except Exception:
                log.exception("reconcile pass failed; the next pass will try again")
            self._wake.clear()
            # Not asyncio.wait_for: on 3.11 it can swallow a cancel that arrives as the
            # wait completes (CPython gh-86296), and the server would never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s if leading
                                           else self.follow_interval_s):
                    await self._wake.wait()

    # --- leadership ------------------------------------------------------------------------

    def took_lead(self, term: int) -> None:
        """This server leads from now, in ``term``: it plans from the next pass on,
        starting from the replica table it followed (or read at its start)."""
        self.term = term
        self.holds_lead = True
        self._taking_over = True
        self._desired_due = 0.0  # read the models and drains at once
        self.wake()

    def deposed(self, reason: str) -> None:
        """Another server leads: stop planning, and send this server's nodes to it."""
        if not self.holds_lead:
            return
        self.term, self.holds_lead = None, False
        closed = self.sessions.forget_all(Close(
            CLOSE_NOT_LEADER, "this server no longer leads the cluster; dial another"))
        log.warning("following from now (%s); closed %d agent stream(s) so that their "
                    "nodes dial the leader", reason, closed)
        self.releasing.clear()
        self.engines_sent.clear()
        self._unrecorded.clear()
        self._unconfirmed.clear()
        self._expected = set()
        self._published = None
        self._refusals_seen.clear()
        for rid in list(self._starts):
            self._start_ended(rid, "this server no longer leads; the new leader watches it")
        self.wake()

    async def load_table(self) -> None:
        """Start from the stored replica table: what was ready is routed to at once. And
        from the stored build choices, so that the first nodes to register are asked for
        the right builds."""
        self.engine_builds.take(await self.engine_builds.read())
        table = replica_table.decode(await self.store.get_setting(replica_table.SETTING))
        if table is not None:
            # Nothing this server heard of its nodes yet: all of it is checked by the probe.
            self._take_table(table, unsure=[*(r.id for r in table.replicas),
                                            *(r.id for r in table.orphans)])
            log.info("routing from the stored replica table (term %d): %d replica(s), "
                     "%d ready, checked by this server until their nodes report",
                     table.term, len(table.replicas),
                     sum(1 for r in table.replicas if r.state is ReplicaState.READY))

    def _take_table(self, table: replica_table.ReplicaTable, unsure: Iterable[str]) -> None:
        self.replicas = {r.id: r for r in table.replicas}
        self.orphans = {r.id: r for r in table.orphans}
        self.unsure = frozenset(unsure)
        self.unplaced = dict(table.unplaced)
        asleep = frozenset(table.asleep) & self.sleepy
        for name in asleep - self.asleep:
            self.waking.pop(name, None)  # the next request wakes it anew
        self.asleep = asleep
        self.changed()

    async def follow(self) -> None:
        """A follower's pass: the leader's table and the catalog as the store has them."""
        self._apply_desired(*await self._read_desired())
        await self._sync_activity()
        table = replica_table.decode(await self.store.get_setting(replica_table.SETTING))
        if table is not None and (encoded := replica_table.encode(table)) != self._published:
            self._published = encoded
            self._take_table(table, unsure=table.unsure)

    async def _read_desired(self) -> tuple[Catalog, set[str], BuildsRead]:
        """Models, drains and build choices as the store has them: any server's admin API
        changes them."""
        catalog = catalog_of(await entries(self.store, self.settings))
        draining = set(await self.store.get_setting(DRAINING_SETTING, []))
        return catalog, draining, await self.engine_builds.read()

    async def _sync_activity(self) -> None:
        """Merge when models that can sleep were asked for, here and in the store (where a
        follower's request wakes a model for the leader); nothing when none can."""
        if self.sleepy:
            self.activity.busy(self._busy())
            await self.activity.sync(self.store, self.sleepy)

    def _busy(self) -> set[str]:
        """The models that can sleep with requests in flight on this server."""
        found = set()
        for rid, count in self.load().items():
            replica = self.replicas.get(rid) or self.orphans.get(rid)
            if count and replica is not None and replica.model in self.sleepy:
                found.add(replica.model)
        return found

    def _apply_desired(self, catalog: Catalog, draining: set[str], builds: BuildsRead) -> None:
        if catalog != self.catalog:
            self._take_catalog(catalog)
            log.info("catalog (as stored): %s", ", ".join(
                f"{m.name} x{m.replicas}" for m in catalog.models) or "no models")
        for node_id in draining ^ self.sessions.draining:
            self.sessions.set_draining(node_id, node_id in draining)
        for node_id in sorted(self.engine_builds.take(builds)):
            # Another server's admin API chose a build: its node hears of it from here.
            if (session := self.sessions.get(node_id)) is not None:
                self._ask_for_engines(session.register)

    def _table(self) -> dict:
        return replica_table.encode(replica_table.ReplicaTable(
            term=self.term or 0, replicas=list(self.replicas.values()),
            orphans=list(self.orphans.values()), unsure=sorted(self.unsure),
            unplaced=self.unplaced, asleep=sorted(self.asleep)))

    async def _publish(self, table: dict) -> None:
        """Write the replica table, as a pass left it, for followers and for this server's
        next start; unless it is what was written last."""
        if table != self._published:
            await self.store.put_setting(replica_table.SETTING, table, term=self.term)
            self._published = table

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
        if not self.leading():
            return reconcile.Plan()
        began, began_ns = time.perf_counter(), time.time_ns()
        # Read before the lock, at most once an interval: a pass runs at each registration,
        # and registrations wait for the lock (a reconnect storm of thousands of nodes).
        desired = None
        if self.clock() >= self._desired_due:
            desired = await self._read_desired()
            self._desired_due = self.clock() + self.interval_s
        async with self._lock:
            if self._taking_over:
                await self._expect_known_nodes()
                self._taking_over = False
            if desired is not None:
                self._apply_desired(*desired)
                await self._sync_activity()
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
                if new is NodeState.LOST and self.sessions.close(node_id, _LOST_OPEN):
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
                plan = reconcile.Plan(unplaced=self.unplaced)
            else:
                self.activity.busy(self._busy())
                awake, asleep = idle.awake_catalog(self.catalog, self.activity.last, now)
                self._note_sleep(asleep)
                plan = reconcile.plan(awake, self.sessions.nodes(),
                                      self.replicas.values(), self.backoffs, now, self.policy,
                                      load=self.load(),
                                      held=[r for r, _ in self.releasing.values()])
                refused = self._new_refusals(plan)
                span = self._pass_span(plan, refused, began_ns)
                try:
                    for action in plan.actions:
                        await self._apply(action, now, span)
                    self._trace_refusals(refused, plan, span)
                finally:
                    end(span)
                self.unplaced = dict(plan.unplaced)
            self._after_pass()
            table = self._table()
        # Written after the lock: registrations need not wait for the store's write.
        await self._publish(table)
        self.stats.pass_done(time.perf_counter() - began)
        return plan

    def _note_sleep(self, asleep: frozenset[str]) -> None:
        for name in sorted(asleep - self.asleep):
            self.waking.pop(name, None)  # the next request wakes it anew
            model = self.catalog.get(name)
            if model is not None:
                log.info("model %s: no request for %g s; keeping %d of its %d replica(s) "
                         "until the next one", name, model.idle_unload_s,
                         min(model.min_replicas, model.replicas), model.replicas)
        for name in sorted(self.asleep - asleep):
            if name in self.waking:
                log.info("model %s: woken by a request", name)
        self.asleep = asleep

    def refusals_of(self, model: str) -> tuple[Refusal, ...]:
        """Placement's reason per node turned down, while ``model`` is unplaced for want of
        room (the last pass's; none while it waits for another reason)."""
        return self._refusals_seen.get(model, ()) if model in self.unplaced else ()

    def _new_refusals(self, plan: reconcile.Plan) -> dict[str, tuple[Refusal, ...]]:
        """The models whose refusals differ from the last pass's; each counted once."""
        changed = {model: refusals for model, refusals in plan.refusals.items()
                   if self._refusals_seen.get(model) != refusals}
        self._refusals_seen = dict(plan.refusals)
        for refusals in changed.values():
            for refusal in refusals:
                self.stats.refused(refusal.kind)
        return changed

    def _pass_span(self, plan: reconcile.Plan, refused: dict, began_ns: int) -> trace.Span:
        """A pass that does something is a trace of its own; one that changes nothing is
        not traced at all."""
        if not self.tracing.enabled or not (plan.actions or refused):
            return trace.INVALID_SPAN
        return self.tracing.start("reconcile", start_time=began_ns, attributes={
            "llmgw.term": self.term or 0, "llmgw.actions": len(plan.actions),
            "llmgw.nodes": len(self.sessions.nodes())})

    def _trace_refusals(self, refused: dict[str, tuple[Refusal, ...]], plan: reconcile.Plan,
                        parent: trace.Span) -> None:
        """A model placement could not place: a span listing every node turned down."""
        if not parent.is_recording():
            return
        for model, refusals in refused.items():
            span = self.tracing.start(f"place {model}", parent=parent, attributes={
                "llmgw.model": model, "llmgw.placed": False,
                "llmgw.reason": plan.unplaced.get(model, ""),
                "llmgw.candidates_refused": len(refusals)})
            for refusal in refusals:
                span.add_event("refused", {"llmgw.node": refusal.node_id,
                                           "llmgw.reason": refusal.reason,
                                           "llmgw.reason_class": refusal.kind})
            end(span, error=f"{model} could not be placed")

    def _after_pass(self) -> None:
        self._forget_orphans()
        self.unsure = frozenset(self._unsure())
        self.changed()

    def _unsure(self) -> Iterator[str]:
        yield from self.orphans
        yield from self._unconfirmed
        for replica in self.replicas.values():
            for shard in replica.shards:
                session = self.sessions.get(shard.node_id)
                if session is None or session.state not in (NodeState.READY,
                                                             NodeState.DRAINING):
                    yield replica.id
                    break

    def _forget_orphans(self) -> None:
        """An orphan leaves routing once its model has enough ready replicas without it
        (it is still stopped if its node returns: see _adopt)."""
        for rid, orphan in list(self.orphans.items()):
            if orphan.state is not ReplicaState.READY:
                continue  # replaced already: kept only to be stopped
            model = self.catalog.get(orphan.model)
            if model is None:
                del self.orphans[rid]
                continue
            ready = sum(1 for r in self.replicas.values()
                        if r.model == orphan.model and r.state is ReplicaState.READY)
            if ready >= model.replicas:
                log.info("replica %s of %s, on a lost node, is no longer routed to: its "
                         "replacement serves", rid, orphan.model)
                self.orphans[rid] = replace(orphan, state=ReplicaState.STOPPED,
                                            reason="replaced while its node was lost")

    async def _apply(self, action: reconcile.Action, now: float,
                     parent: trace.Span = trace.INVALID_SPAN) -> None:
        if isinstance(action, reconcile.Place):
            self.stats.action("place")
            await self._place(action, now, parent)
            return
        replica = self.replicas.get(action.replica)
        if replica is None:
            return
        kind, name = _action_kind(action, replica, self._all_lost(replica))
        self.stats.action(kind)
        span = (self.tracing.start(f"{name} {replica.id}", parent=parent, attributes={
            "llmgw.model": replica.model, "llmgw.replica": replica.id,
            "llmgw.action": name, "llmgw.reason": action.reason,
            "llmgw.nodes": [s.node_id for s in replica.shards]})
            if parent.is_recording() else trace.INVALID_SPAN)
        try:
            self._apply_to(action, replica, now, span)
        finally:
            end(span)

    def _apply_to(self, action: reconcile.Action, replica: Replica, now: float,
                  span: trace.Span) -> None:
        self._start_ended(replica.id, action.reason)
        if isinstance(action, reconcile.Reap):
            self.replicas.pop(action.replica)
            if action.crashed:
                self.stats.failed(replica.model)
                log.warning("replica %s of %s failed: %s", replica.id, replica.model,
                            action.reason)
                self.backoffs[replica.model] = reconcile.after_failure(
                    self.backoffs.get(replica.model, reconcile.Backoff()), now, self.policy)
            elif replica.state is ReplicaState.READY and self._all_lost(replica):
                # Its node is lost, not necessarily its engine: routed to while the engine
                # answers, until the replacement placed now serves. (Not a replica with a
                # shard on a node still here: a rank is gone, and it cannot serve.)
                log.warning("replica %s of %s is placed again: %s; it is routed to while "
                            "its engine answers, until the new one serves", replica.id,
                            replica.model, action.reason)
                self.orphans[replica.id] = replica
                return
            else:
                log.warning("replica %s of %s is placed again: %s", replica.id,
                            replica.model, action.reason)
            self._stop_shards(replica, action.reason, now, span)
        elif isinstance(action, reconcile.Evict):
            self.replicas.pop(action.replica)
            log.warning("preempting replica %s of %s: %s", replica.id, replica.model,
                        action.reason)
            self._stop_shards(replica, action.reason, now, span)
        elif isinstance(action, reconcile.Stop):
            self.replicas.pop(action.replica)
            log.info("stopping replica %s of %s: %s", replica.id, replica.model, action.reason)
            self._stop_shards(replica, action.reason, now, span)

    async def _place(self, action: reconcile.Place, now: float,
                     parent: trace.Span = trace.INVALID_SPAN) -> None:
        placement = action.placement
        model = self.catalog.get(placement.model)
        profile = model.profile(placement.profile)
        epoch = await self.store.next_epoch(term=self.term)
        replica = new_replica(replica_id(model.name, epoch), placement, epoch, now)
        self.replicas[replica.id] = replica
        log.info("replica %s of %s: %s", replica.id, model.name, placement.describe())
        start = trace.INVALID_SPAN
        if parent.is_recording():
            where = {"llmgw.model": model.name, "llmgw.replica": replica.id,
                     "llmgw.profile": profile.name, "llmgw.engine": profile.engine,
                     "llmgw.nodes": [s.node_id for s in placement.shards],
                     "llmgw.gpus": [g for s in placement.shards for g in s.gpus]}
            span = self.tracing.start(f"place {model.name}", parent=parent, attributes={
                **where, "llmgw.placed": True, "llmgw.placement": placement.describe()})
            # Open until the replica serves (or fails): the nodes continue it.
            start = self._starts[replica.id] = self.tracing.start(
                f"start {replica.id}", parent=span, attributes=where)
            end(span)
        carried = self.tracing.carrier(start)
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
                rendezvous_port=placement.rendezvous_port, peers=peers, term=self.term or 0,
                trace=carried,
            )
            if not self.sessions.send(shard.node_id, message):
                self.replicas[replica.id] = fail(
                    self.replicas[replica.id], f"node {shard.node_id} disconnected before start")
                self._start_ended(replica.id, f"node {shard.node_id} disconnected before start")
                self.wake()

    def _start_ended(self, replica_id: str, error: str | None) -> None:
        """The replica serves (``error`` None), or will not: its start span ends."""
        span = self._starts.pop(replica_id, None)
        if span is not None:
            end(span, error=error)

    def _node_words(self, replica: Replica) -> str:
        """Why this server cannot vouch for the replica through its node, in words."""
        node = replica.shards[0].node_id if replica.shards else "its node"
        session = self.sessions.get(node)
        if session is not None:
            return f"its node {node} is {session.state.value}"
        if self.leading():
            return f"its node {node} has not reported to this server since it took the lead"
        return f"the leader cannot vouch for it through its node {node}"

    def _all_lost(self, replica: Replica) -> bool:
        return all((session := self.sessions.get(shard.node_id)) is None
                   or session.state is NodeState.LOST for shard in replica.shards)

    def _stop_shards(self, replica: Replica, reason: str, now: float,
                     span: trace.Span = trace.INVALID_SPAN) -> None:
        """Ask every live shard to stop, and hold the replica's GPUs and ports until they
        say they have (or a deadline passes), so nothing new is placed onto them early."""
        stopping = False
        carried = self.tracing.carrier(span)
        for shard in replica.shards:
            if shard.state in ("failed", "stopped"):
                continue
            if self.sessions.send(shard.node_id, wire.StopShard(
                    replica=replica.id, rank=shard.rank, epoch=replica.epoch, reason=reason,
                    term=self.term or 0, trace=carried)):
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
            self.stats.stream_connects.n += 1
            log.info("node %s registered from %s with %d running shard(s)", msg.node_id,
                     msg.address, len(msg.running))
            behind = behind_words(llmgw.__version__, msg.agent_version)
            if behind:
                log.warning("node %s: %s", msg.node_id, behind)
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
        self.changed()
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
        self.changed()
        self.wake()

    def _ask_for_engines(self, msg: wire.Register) -> bool:
        """Send the node the engines it should have, when that differs from what it was
        last sent on this stream (a new label or GPU, or a build chosen, can change it);
        whether it was sent."""
        wanted = desired_engines(self.settings, msg, mirror_engines(self.settings),
                                 self.engine_builds.of(msg.node_id))
        if self.engines_sent.get(msg.node_id) == wanted:
            return False
        # The node's installs continue this trace.
        span = (self.tracing.start(f"engines for {msg.node_id}", attributes={
            "llmgw.node": msg.node_id,
            "llmgw.engines": [f"{e.name} {e.version}" for e in wanted]})
            if self.tracing.enabled else trace.INVALID_SPAN)
        sent = self.sessions.send(msg.node_id, wire.InstallEngines(
            engines=wanted, trace=self.tracing.carrier(span)))
        end(span, error=None if sent else "the node disconnected")
        if sent:
            self.engines_sent[msg.node_id] = wanted
            log.info("asked %s for engines: %s", msg.node_id, ", ".join(
                f"{e.name} {e.version}" + (f" ({e.build} build)" if e.build != "auto" else "")
                for e in wanted) or "none")
        return sent

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
            orphan = self.orphans.pop(running.replica, None)
            stop = None
            if model is None or model.profile(running.profile) is None:
                stop = f"model {running.model} is not declared"
            elif orphan is not None and orphan.state is ReplicaState.STOPPED:
                stop = "replaced while its node was lost"
            if stop is not None:
                log.info("stopping %s on %s: %s", running.replica, msg.node_id, stop)
                self.sessions.send(msg.node_id, wire.StopShard(
                    replica=running.replica, rank=running.rank, epoch=running.epoch,
                    reason=stop, term=self.term or 0))
                continue
            existing = self.replicas.get(running.replica)
            shard = Shard(running.rank, msg.node_id, msg.address, running.port,
                          state=running.state)
            if existing is not None and existing.shard(running.rank) is not None:
                old = existing.shard(running.rank)
                shard = replace(shard, gpus=old.gpus)
                if (old.state == "ready" and running.state == "starting"
                        and existing.epoch == running.epoch):
                    # Its agent restarted and has not checked the engine yet: a ready
                    # engine is not taken out of routing for that (the probe checks it).
                    shard = replace(shard, state="ready")
                    self._unconfirmed.add(running.replica)
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
        self._unconfirmed.discard(msg.replica)
        updated = apply_status(replica, rank=msg.rank, epoch=msg.epoch, state=msg.state,
                               now=now, port=msg.port, detail=msg.detail,
                               output_tail=tuple(msg.output_tail))
        self.replicas[msg.replica] = updated
        if updated.state != replica.state:
            if updated.state is ReplicaState.READY:
                self._start_ended(replica.id, None)
            elif updated.state is ReplicaState.FAILED:
                self._start_ended(replica.id, updated.reason or "failed")
            log.info("replica %s of %s: %s -> %s%s", replica.id, replica.model,
                     replica.state.value, updated.state.value,
                     f" ({updated.reason})" if updated.state == "failed" else "")
            if msg.output_tail and msg.state == "failed":
                log.warning("last output of %s rank %d:\n%s", replica.id, msg.rank,
                            "\n".join(msg.output_tail[-10:]))
            self.changed()
            self.wake()

    async def set_catalog(self, catalog: Catalog) -> None:
        """Models were added, removed or scaled over the admin API: plan with them now.
        Swapped under the pass lock, so no pass sees half of the change."""
        async with self._lock:
            self._take_catalog(catalog)
        log.info("catalog: %s", ", ".join(f"{m.name} x{m.replicas}" for m in catalog.models)
                 or "no models")
        await self.pass_once()

    async def set_draining(self, node_id: str, draining: bool) -> None:
        """An operator drains a node: its replicas move elsewhere, each stopping once its
        replacement serves; nothing new is placed there until it is undrained."""
        self.sessions.set_draining(node_id, draining)
        stored = set(await self.store.get_setting(DRAINING_SETTING, []))
        (stored.add if draining else stored.discard)(node_id)
        await self.store.put_setting(DRAINING_SETTING, sorted(stored))
        log.info("node %s: %s", node_id, "draining" if draining else "undrained")
        # A pass now, so the answer to the operator already shows the new state.
        await self.pass_once()

    async def set_engine_build(self, node_id: str, engine: str, choice: str) -> str:
        """An operator chose ``node_id``'s build of ``engine`` (auto, a build name, none, or
        ``default`` to go back to server.yaml's): kept in the store, and the node told now
        where this server holds its stream. Says, in words, when the node hears of it."""
        await self.engine_builds.put(node_id, engine,
                                     None if choice == DEFAULT_CHOICE else choice)
        log.info("node %s: %s build %s", node_id, engine,
                 "as server.yaml says" if choice == DEFAULT_CHOICE else f"{choice}, chosen")
        session = self.sessions.get(node_id)
        if not self.holds_lead:
            return (f"{self.not_leading()}; the leader tells {node_id} within "
                    f"{self.interval_s:g} s")
        if session is None or session.outbox is None:
            return f"{node_id} is not connected: it is told when it registers"
        if self._ask_for_engines(session.register):
            return f"{node_id} was told now"
        words = f"what {node_id} is asked for is unchanged: nothing to tell it"
        if choice != "none" and engine not in {e.name for e in self.engines_sent.get(
                node_id, [])}:
            words += (f" (it is asked for no {engine}: server.yaml does not name it for this "
                      "node, or its agent cannot install it or disables it)")
        return words

    def build_choices(self, register: wire.Register) -> dict[str, BuildChoice]:
        """The build of each engine the node is asked about, and what decided it."""
        return build_choices(self.settings, register, self.engine_builds.of(register.node_id))

    def node_disconnected(self, node_id: str, connection: int) -> None:
        self.sessions.detach(node_id, connection)
        self.stats.stream_disconnects.n += 1
        log.info("node %s disconnected", node_id)
        self.wake()

    # --- what the gateway and the admin API read -------------------------------------------

    def changed(self) -> None:
        """Tell the listeners (the router) that what they read has changed."""
        for listener in self._listeners:
            listener(self)

    def requested(self, model: str) -> None:
        """A request came for ``model``, which can sleep: noted, and, when it sleeps, it
        is woken (the leader plans at once; a follower tells the store at once)."""
        self.activity.asked(model)
        if model in self.asleep and model not in self.waking:
            found = self.catalog.get(model)
            if found is not None:
                self.waking[model] = self.clock() + found.wake_timeout_s
                self.wake()

    def wake_left(self, model: str) -> float:
        """How long a request may still wait for ``model``'s replica to be placed and
        start after a request woke it (its ``wake_timeout_s``); 0 when it is not waking."""
        due = self.waking.get(model)
        if due is None:
            return 0.0
        left = due - self.clock()
        if left <= 0 or (model not in self.asleep and model in self.ready_models()):
            del self.waking[model]
            return 0.0
        return left

    def expecting(self, model: str) -> bool:
        """Whether a ready replica of ``model`` may come soon, so that a request is better
        kept waiting than refused: this leader still hears from its nodes after it
        started or took the lead, a request woke the model from its sleep, or a replica
        of the model stopped answering this server's check (its node may come back, or
        its replacement be ready)."""
        if self._expected and self.clock() < self._settle_until:
            return True
        if self.waking and self.wake_left(model) > 0:
            return True
        return any(r.model == model and r.id in self.probe_failed
                   for r in (*self.replicas.values(), *self.orphans.values()))

    def set_probe_failed(self, failed: frozenset[str]) -> None:
        if failed != self.probe_failed:
            self.probe_failed = failed
            self.changed()

    def unsure_endpoints(self) -> dict[str, tuple[str, str, int]]:
        """What the probe checks: (engine, address, port) of each unsure ready replica."""
        found = {}
        for rid in self.unsure:
            replica = self.replicas.get(rid) or self.orphans.get(rid)
            endpoint = replica.endpoint() if replica is not None else None
            model = self.catalog.get(replica.model) if replica is not None else None
            profile = model.profile(replica.profile) if model is not None else None
            if endpoint is not None and profile is not None:
                found[rid] = (profile.engine, *endpoint)
        return found

    def ready_endpoints(self) -> dict[str, list[tuple[str, str, int, int | None]]]:
        """Per model, the (replica, address, port, slots) of every replica ready to serve:
        those on nodes it cannot vouch for only while their engines answer its check."""
        routes: dict[str, list[tuple[str, str, int, int | None]]] = {}
        failed = self.probe_failed
        for replica in (*self.replicas.values(), *self.orphans.values()):
            endpoint = replica.endpoint()
            if endpoint is not None and replica.id not in failed:
                model = self.catalog.get(replica.model)
                profile = model.profile(replica.profile) if model else None
                slots = profile.slots if profile else None
                if slots is not None:
                    slots = -(-slots // self.servers())  # this server's share, rounded up
                routes.setdefault(replica.model, []).append((replica.id, *endpoint, slots))
        for model_name, static in self.endpoints.routes(self.catalog, self.servers()).items():
            routes.setdefault(model_name, []).extend(static)  # type: ignore[arg-type]
        return routes

    def ready_models(self) -> set[str]:
        return {r.model for r in (*self.replicas.values(), *self.orphans.values())
                if r.state is ReplicaState.READY and r.id not in self.probe_failed}

    def why_not_ready(self, model: str) -> str:
        """In words an operator can act on: why ``model`` has no ready replica right now,
        nor a static endpoint that answers."""
        declared = self.catalog.get(model)
        if declared is None or not declared.endpoints:
            return self._why_no_replica(model)
        static = self.endpoints.why_not(declared)
        if not declared.profiles:
            return static
        return f"{static}; and {self._why_no_replica(model)}"

    def _why_no_replica(self, model: str) -> str:
        if model in self.asleep:
            found = self.catalog.get(model)
            idle_s = found.idle_unload_s if found is not None else 0
            return (f"it is asleep (no request for {idle_s:g} s) and a request's wake did "
                    "not reach the cluster's leader in time; see the leader's log")
        if model in self.unplaced:
            return self.unplaced[model]
        mine = [r for r in self.replicas.values() if r.model == model]
        unanswered = [r for r in (*mine, *self.orphans.values())
                      if r.model == model and r.id in self.probe_failed]
        if unanswered:
            return "; ".join(f"{r.id} did not answer this server's health check, and "
                             f"{self._node_words(r)}" for r in unanswered)
        if not mine:
            found = self.catalog.get(model)
            if found is not None and found.replicas == 0:
                return (f"it is scaled to 0 replicas; scale it up (`llmgw ctl models scale "
                        f"{model} N`), or give it idle_unload_s so that requests wake it")
            return "no replica is placed yet"
        return "; ".join(f"{r.id} is {r.state.value}" + (f" ({r.reason})" if r.reason else "")
                         for r in mine)


def _action_kind(action: reconcile.Action, replica: Replica, all_lost: bool
                 ) -> tuple[str, str]:
    """The action's kind for metrics (controller_stats.ACTIONS) and its span's name."""
    if isinstance(action, reconcile.Reap):
        if action.crashed:
            return "reap", "restart"
        if replica.state is ReplicaState.READY and all_lost:
            return "orphan", "replace"
        return "reap", "reap"
    if isinstance(action, reconcile.Evict):
        return "evict", "preempt"
    return "stop", action.cause


_LOST_OPEN = Close(4408, "declared lost with its stream still open; register again")


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _inventory_dict(inventory: wire.Inventory) -> dict:
    return msgspec.to_builtins(inventory)
