"""``/metrics``: the gateway and the cluster in Prometheus' text format.

Each app has its own ``CollectorRegistry`` (never the process-global one), so a test can
build several servers in one process. Two kinds of series:

- **per request**, recorded by the gateway as requests finish (:meth:`Metrics.request_done`,
  :meth:`~Metrics.first_byte`, :meth:`~Metrics.retry`, :meth:`~Metrics.refused`). Each
  series is resolved once per (model, kind) and cached, and kept as plain numbers that the
  registry reads when scraped, so a call is a dict lookup and an addition or two: well
  under a microsecond, with no lock (only the event loop records and scrapes).
- **read at scrape time** from the router and the controller (queue lengths, requests in
  flight, replicas ready and wanted, nodes by state): nothing is updated per request, and
  the scrape runs on the event loop, where those structures live, so it needs no lock.

Label values come from fixed sets only. A ``model`` label is a name from the catalog and
anything else is ``unknown``: a client's ``model`` field never becomes a label as sent
(one series per typo would grow without bound). ``kind`` is one of :data:`KINDS`,
``status`` a class such as ``2xx``, a refusal's ``reason`` one of :data:`REFUSAL_REASONS`.

Who may scrape (:class:`Access`): nobody when ``metrics.enabled`` is false; otherwise a
request carrying the metrics token (``metrics.token_file``) or the admin token, and a
request from loopback without forwarding headers (``metrics.allow_loopback``, on by
default) — a Prometheus or node agent on the server's own host needs no secret, a remote
scraper gets a token of its own that opens nothing else.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from litestar import Request, Response, get
from litestar.di import NamedDependency
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

from llmgw.core.inventory import NodeState
from llmgw.core.names import is_loopback_host
from llmgw.core.replicas import ReplicaState
from llmgw.server.auth import admin_token_ok, bearer, read_secret_file
from llmgw.server.dependencies import from_states
from llmgw.server.errors import error_response

if TYPE_CHECKING:
    from llmgw.server.controller import Controller
    from llmgw.server.openai.router import Router

UNKNOWN_MODEL = "unknown"
KINDS = ("chat", "completions", "embeddings", "other")
REFUSAL_REASONS = ("queue_full", "queue_timeout", "rate_limit", "other")
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")

_KIND_OF_PATH = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                 "/v1/embeddings": "embeddings"}
# Answers take from milliseconds (embeddings) to minutes (long generations).
DURATION_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)
FIRST_BYTE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_FORWARDED = ("forwarded", "x-forwarded-for", "x-real-ip")


def endpoint_kind(path: str) -> str:
    """The ``kind`` label of a ``/v1`` path: chat, completions, embeddings or other."""
    return _KIND_OF_PATH.get(path, "other")


def status_class(status: int) -> str:
    return STATUS_CLASSES[_class_index(status)]


def _class_index(status: int) -> int:
    return min(max(status // 100, 1), 5) - 1


@dataclass(frozen=True, slots=True)
class Access:
    """Who may read ``/metrics``."""

    enabled: bool = True
    # A request from 127.0.0.0/8 or ::1 that no proxy forwarded needs no token.
    allow_loopback: bool = True
    # A bearer token for scrapers; opens /metrics and nothing else.
    token: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> Access:
        """From ``config.metrics`` (``enabled``, ``allow_loopback``, ``token_file``);
        the defaults where the config has no such section or key."""
        section = config.metrics
        return cls(enabled=section.enabled, allow_loopback=section.allow_loopback,
                   token=(read_secret_file(section.token_file, "metrics token")
                          if section.token_file else None))

    def allows(self, request: Request, admin_token: str | None) -> bool:
        token = bearer(request.headers.get("authorization"))
        if token is not None:
            if self.token is not None and admin_token_ok(self.token, token):
                return True
            return admin_token is not None and admin_token_ok(admin_token, token)
        if not self.allow_loopback or any(h in request.headers for h in _FORWARDED):
            return False
        return is_loopback_host(request.client.host if request.client else None)


class _ProcessCollector(ProcessCollector):
    """prometheus-client's process metrics, which read the boot time from /proc/stat and
    report nothing without it. systemd's ProcSubset=pid (the NixOS module's sandbox) hides
    that file and keeps /proc/self; the clock gives the same boot time."""

    def _boot_time(self) -> float:
        try:
            return super()._boot_time()
        except OSError:
            return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


class _Count:
    """One counter series: a number the event loop adds to."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class _Histogram:
    """One histogram series as plain numbers: an observation is a bisect and two additions
    (prometheus_client's takes a lock and walks its buckets in Python, 4-5 µs a request).
    Only the event loop observes and scrapes, so no lock is needed."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last one +Inf's
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative, as the exposition has them."""
        total, out = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append((floatToGoString(bound), total))
        return out


class _RequestSeries:
    """The series of one (model, kind), resolved once."""

    __slots__ = ("by_status", "duration")

    def __init__(self) -> None:
        self.by_status = tuple(_Count() for _ in STATUS_CLASSES)
        self.duration = _Histogram(DURATION_BUCKETS)


class Metrics:
    """The per-app registry, what the gateway records, and the scrape-time collectors.

    What the gateway records per request is kept in plain series of its own (``_Count``,
    ``_Histogram``) and handed to the registry when it is scraped (``collect``)."""

    def __init__(self, controller: Controller, router: Router,
                 access: Access | None = None, *, process: bool = True) -> None:
        self.controller = controller
        self.router = router
        self.access = access or Access()
        self.registry = CollectorRegistry(auto_describe=True)
        if process:
            _ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        # Each family's series by their labels: what a scrape exposes.
        self._request_series: dict[tuple[str, str], _RequestSeries] = {}
        self._first_byte_series: dict[str, _Histogram] = {}
        self._retry_series: dict[str, _Count] = {}
        self._refusal_series: dict[tuple[str, str], _Count] = {}
        # The same series keyed by what callers pass, but only ever for catalog names (and
        # the fixed kinds): an unknown model goes to the `unknown` series without a cache
        # entry of its own.
        self._series: dict[tuple[str | None, str], _RequestSeries] = {}
        self._first_bytes: dict[str | None, _Histogram] = {}
        self._retry_counts: dict[str | None, _Count] = {}
        self._refusal_counts: dict[tuple[str | None, str], _Count] = {}
        self.registry.register(self)
        _ClusterCollector(self, registry=self.registry)

    # --- the request path ------------------------------------------------------------------

    def model_label(self, model: str | None) -> str:
        """``model`` if the catalog declares it, else ``unknown``."""
        if model and self.controller.catalog.get(model) is not None:
            return model
        return UNKNOWN_MODEL

    def request_done(self, model: str | None, kind: str, status: int, seconds: float) -> None:
        """One request answered (a stream: when its last byte is sent). ``model`` as the
        client sent it, or None before it was read; ``kind`` from :func:`endpoint_kind`."""
        series = self._series.get((model, kind))
        if series is None:
            series = self._child(self._request_series, self._series, (model, kind),
                                 (self.model_label(model), kind if kind in KINDS else "other"),
                                 _RequestSeries)
        series.by_status[_class_index(status)].n += 1
        series.duration.observe(seconds)

    def first_byte(self, model: str | None, seconds: float) -> None:
        """A streamed answer's first chunk arrived, ``seconds`` after the request did."""
        child = self._first_bytes.get(model)
        if child is None:
            child = self._child(self._first_byte_series, self._first_bytes, model,
                                self.model_label(model),
                                lambda: _Histogram(FIRST_BYTE_BUCKETS))
        child.observe(seconds)

    def retry(self, model: str | None) -> None:
        """A replica refused before answering and the request goes to another one."""
        child = self._retry_counts.get(model)
        if child is None:
            child = self._child(self._retry_series, self._retry_counts, model,
                                self.model_label(model), _Count)
        child.n += 1

    def refused(self, model: str | None, reason: str) -> None:
        """A 429; ``reason`` one of :data:`REFUSAL_REASONS` (anything else counts as
        ``other``)."""
        child = self._refusal_counts.get((model, reason))
        if child is None:
            why = reason if reason in REFUSAL_REASONS else "other"
            child = self._child(self._refusal_series, self._refusal_counts, (model, reason),
                                (self.model_label(model), why), _Count)
        child.n += 1

    @staticmethod
    def _child(family: dict, cache: dict, key: Any, labels: Any, make: Any) -> Any:
        """The series of ``labels`` in ``family`` (made if new), remembered in ``cache``
        under the caller's ``key`` only when that key is the labels themselves: the
        cache never holds a name a client made up."""
        child = family.get(labels)
        if child is None:
            child = family[labels] = make()
        if key == labels:
            cache[key] = child
        return child

    # --- the scrape ------------------------------------------------------------------------

    def describe(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        """The per-request series, for the registry (which calls this when scraped)."""
        requests, duration, first_byte, retries, refusals = families = self._families()
        for (model, kind), series in self._request_series.items():
            for status, count in zip(STATUS_CLASSES, series.by_status, strict=True):
                requests.add_metric([model, kind, status], count.n)
            duration.add_metric([model, kind], series.duration.buckets(),
                                series.duration.sum)
        for model, histogram in self._first_byte_series.items():
            first_byte.add_metric([model], histogram.buckets(), histogram.sum)
        for model, count in self._retry_series.items():
            retries.add_metric([model], count.n)
        for (model, reason), count in self._refusal_series.items():
            refusals.add_metric([model, reason], count.n)
        return iter(families)

    @staticmethod
    def _families() -> list[CounterMetricFamily | HistogramMetricFamily]:
        return [
            CounterMetricFamily("llmgw_requests", "Requests answered on /v1, by status class.",
                                labels=["model", "kind", "status"]),
            HistogramMetricFamily("llmgw_request_duration_seconds",
                                  "From the request's arrival to the end of its answer "
                                  "(a stream's last byte).", labels=["model", "kind"]),
            HistogramMetricFamily("llmgw_time_to_first_byte_seconds",
                                  "For streamed answers: from the request's arrival to "
                                  "the engine's first chunk.", labels=["model"]),
            CounterMetricFamily("llmgw_upstream_retries",
                                "Requests sent to another replica after one refused.",
                                labels=["model"]),
            CounterMetricFamily("llmgw_refusals", "Requests refused with 429, by reason.",
                                labels=["model", "reason"]),
        ]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _ClusterCollector:
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
        ]

    def _fill(self, families: list[GaugeMetricFamily]) -> list[GaugeMetricFamily]:
        queue, in_flight, ready, wanted, nodes = families
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
            _add(counts["in_flight"], label(model_of.get(replica)), serving)
        for replica in controller.replicas.values():
            if replica.state is ReplicaState.READY:
                _add(counts["ready"], label(replica.model), 1)
        for family, key in ((queue, "queue"), (in_flight, "in_flight"), (ready, "ready")):
            for model, value in counts[key].items():
                family.add_metric([model], value)
        for model in controller.catalog.models:
            wanted.add_metric([model.name], model.replicas)
        by_state = dict.fromkeys((s.value for s in NodeState), 0)
        for session in controller.sessions.all():
            by_state[session.state.value] += 1
        for state, count in by_state.items():
            nodes.add_metric([state], count)
        return families


def _add(counts: dict[str, float], key: str, value: float) -> None:
    counts[key] = counts.get(key, 0) + value


@get("/metrics", include_in_schema=False,
     dependencies=from_states("metrics", "admin_token"))
async def metrics_endpoint(request: Request, metrics: NamedDependency[Metrics],
                           admin_token: NamedDependency[str]) -> Response:
    """Prometheus' text format, for whom :class:`Access` lets in. Async on purpose: the
    collectors read the router and controller, which only the event loop may touch."""
    if not metrics.access.enabled:
        return error_response(404, "there is no GET /metrics here (metrics.enabled is "
                              "false)")
    if not metrics.access.allows(request, admin_token):
        return error_response(401, "send the metrics token as `Authorization: Bearer …` "
                              "(metrics.token_file), or scrape from the server's own host",
                              code="metrics_token_required",
                              headers={"www-authenticate": "Bearer"})
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

