"""The scrape-time collectors of ``/metrics``: what the router, the controller, the store
and the certificates say when Prometheus asks. Nothing here is updated per request; each
collector runs on the event loop, where what it reads lives. See server/metrics.py for
the families recorded per request and the label rules.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from cryptography import x509
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from llmgw.core import engine_names
from llmgw.core.endpoints import model_of_endpoint
from llmgw.core.inventory import NodeState
from llmgw.core.placement import REFUSAL_KINDS
from llmgw.core.replicas import ReplicaState
from llmgw.server.controller_stats import ACTIONS

if TYPE_CHECKING:
    from llmgw.server.controller_stats import ControllerStats
    from llmgw.server.metrics import Metrics
    from llmgw.store import Store

log = logging.getLogger(__name__)

# An engine's install as a node reports it (wire.Engine.state); anything else is "other".
INSTALL_STATES = ("installed", "configured", "installing", "failed")


class ClusterCollector:
    """Gauges read from the router and the controller when Prometheus scrapes."""

    def __init__(self, metrics: Metrics, registry: CollectorRegistry) -> None:
        self._metrics = metrics
        registry.register(self)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._fill(self._families()))

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("llmgw_queue_length",
                              "Requests waiting for a free slot on one of the model's "
                              "replicas.", labels=["model"]),
            GaugeMetricFamily("llmgw_in_flight", "Requests the model's replicas are serving.",
                              labels=["model"]),
            GaugeMetricFamily("llmgw_replicas_ready", "Replicas ready to serve.",
                              labels=["model"]),
            GaugeMetricFamily("llmgw_replicas_wanted", "Replicas the catalog asks for.",
                              labels=["model"]),
            GaugeMetricFamily("llmgw_nodes", "Nodes known to the controller, by state.",
                              labels=["state"]),
            GaugeMetricFamily("llmgw_replicas", "Replicas the controller knows, by state.",
                              labels=["model", "state"]),
            GaugeMetricFamily("llmgw_engine_installs",
                              "Nodes by the state of an engine's install on them.",
                              labels=["engine", "state"]),
        ]

    def _fill(self, families: list[GaugeMetricFamily]) -> list[GaugeMetricFamily]:
        queue, in_flight, ready, wanted, nodes, replicas, installs = families
        metrics = self._metrics
        controller, router = metrics.controller, metrics.router
        label = metrics.model_label
        names = controller.catalog.names()
        counts: dict[str, dict[str, float]] = {
            "queue": dict.fromkeys(names, 0), "in_flight": dict.fromkeys(names, 0),
            "ready": dict.fromkeys(names, 0)}
        for model, waiting in router.queue_lengths().items():
            _add(counts["queue"], label(model), waiting)
        model_of = {rid: r.model for rid, r in controller.replicas.items()}
        for replica, serving in router.in_flight().items():
            _add(counts["in_flight"], label(model_of.get(replica) or model_of_endpoint(replica)),
                 serving)
        by_state = {(model, state.value): 0 for model in names for state in ReplicaState}
        for replica in controller.replicas.values():
            model = label(replica.model)
            if replica.state is ReplicaState.READY:
                _add(counts["ready"], model, 1)
            _add(by_state, (model, replica.state.value), 1)  # type: ignore[arg-type]
        for family, key in ((queue, "queue"), (in_flight, "in_flight"), (ready, "ready")):
            for model, value in counts[key].items():
                family.add_metric([model], value)
        for model in controller.catalog.models:
            wanted.add_metric([model.name], model.replicas)
        for (model, state), count in by_state.items():
            replicas.add_metric([model, state], count)
        by_node_state = dict.fromkeys((s.value for s in NodeState), 0)
        engines = {(e, s): 0 for e in engine_names.ALL for s in INSTALL_STATES}
        for session in controller.sessions.all():
            by_node_state[session.state.value] += 1
            for engine in session.register.inventory.engines:
                name = engine.name if engine.name in engine_names.ALL else "other"
                state = engine.state if engine.state in INSTALL_STATES else "other"
                _add(engines, (name, state), 1)  # type: ignore[arg-type]
        for state, count in by_node_state.items():
            nodes.add_metric([state], count)
        for (engine, state), count in engines.items():
            installs.add_metric([engine, state], count)
        return families


def _add(counts: dict, key: Any, value: float) -> None:
    counts[key] = counts.get(key, 0) + value


class ControllerCollector:
    """The controller's own counts (``ControllerStats``), read when scraped."""

    def __init__(self, stats: ControllerStats, model_label: Any,
                 registry: CollectorRegistry) -> None:
        self._stats = stats
        self._model_label = model_label
        registry.register(self)

    def describe(self) -> Iterator[Any]:
        return iter(self._families())

    @staticmethod
    def _families() -> list[Any]:
        return [
            HistogramMetricFamily("llmgw_controller_pass_seconds",
                                  "How long each of the controller's passes took."),
            CounterMetricFamily("llmgw_controller_actions", "What the controller's passes "
                                "did, by action.", labels=["action"]),
            CounterMetricFamily("llmgw_placement_refusals", "Nodes placement turned down "
                                "for a replica, by reason class.", labels=["reason"]),
            CounterMetricFamily("llmgw_agent_stream_connects",
                                "Agent streams that connected."),
            CounterMetricFamily("llmgw_agent_stream_disconnects",
                                "Agent streams that closed."),
            CounterMetricFamily("llmgw_replica_failures", "Replicas that failed (crashed, "
                                "or never became ready).", labels=["model"]),
        ]

    def collect(self) -> Iterator[Any]:
        stats = self._stats
        passes, actions, refusals, connects, disconnects, failures = families = \
            self._families()
        passes.add_metric([], stats.pass_seconds.buckets(), stats.pass_seconds.sum)
        for action in ACTIONS:
            actions.add_metric([action], stats.actions[action].n)
        by_reason = dict.fromkeys(REFUSAL_KINDS, 0)
        for reason, count in stats.refusals.items():
            _add(by_reason, reason if reason in by_reason else "other", count.n)
        for reason, n in by_reason.items():
            refusals.add_metric([reason], n)
        connects.add_metric([], stats.stream_connects.n)
        disconnects.add_metric([], stats.stream_disconnects.n)
        by_model: dict[str, int] = {}
        for model, count in stats.failures.items():
            _add(by_model, self._model_label(model), count.n)
        for model, n in by_model.items():
            failures.add_metric([model], n)
        return iter(families)


class StoreCollector:
    """``llmgw_store_up``: whether the store answered last (it keeps its outage)."""

    def __init__(self, store: Store, registry: CollectorRegistry) -> None:
        self._store = store
        registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("llmgw_store_up", "1 while the store answers, 0 during an "
                                "outage (as its last statement found it).",
                                value=0 if self._store.outage is not None else 1)


class CertificateCollector:
    """When the server's certificates expire, read from their files: each parsed once,
    and again when its file changes (a renewal replaces it)."""

    def __init__(self, paths: dict[str, str], registry: CollectorRegistry) -> None:
        self._paths = paths
        # name -> (the file's mtime and size as last read, its expiry or None)
        self._read: dict[str, tuple[tuple[int, int], float | None]] = {}
        registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("llmgw_certificate_expiry_timestamp_seconds",
                                   "When the certificate expires (Unix time).",
                                   labels=["certificate"])
        for name, path in self._paths.items():
            expiry = self._expiry(name, path)
            if expiry is not None:
                family.add_metric([name], expiry)
        yield family

    def _expiry(self, name: str, path: str) -> float | None:
        try:
            stat = os.stat(path)
        except OSError as err:
            self._failed(name, (0, 0), f"cannot read {path}: {err.strerror}")
            return None
        version = (stat.st_mtime_ns, stat.st_size)
        known = self._read.get(name)
        if known is not None and known[0] == version:
            return known[1]
        try:
            with open(path, "rb") as pem:
                certificate = x509.load_pem_x509_certificate(pem.read())
        except (OSError, ValueError) as err:
            self._failed(name, version, f"{path} holds no PEM certificate that could be "
                         f"read: {err}")
            return None
        expiry = certificate.not_valid_after_utc.timestamp()
        self._read[name] = (version, expiry)
        return expiry

    def _failed(self, name: str, version: tuple[int, int], why: str) -> None:
        known = self._read.get(name)
        if known is None or known[0] != version:  # once per version of the file
            log.warning("llmgw_certificate_expiry_timestamp_seconds{certificate=%s}: %s",
                        name, why)
            self._read[name] = (version, None)
