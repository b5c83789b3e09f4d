"""``/metrics``: the gateway and the cluster in Prometheus' text format.

Each app has its own ``CollectorRegistry`` (never the process-global one), so a test can
build several servers in one process. Three kinds of series:

- **per request**, recorded by the gateway as requests finish (:meth:`Metrics.request_done`,
  :meth:`~Metrics.first_byte`, :meth:`~Metrics.stream_series`, :meth:`~Metrics.retry`,
  :meth:`~Metrics.refused`). Each series is resolved once per
  (model, kind) and cached, and kept as plain numbers (server/series.py) that the
  registry reads when scraped, so a call is a dict lookup and an addition or two: well
  under a microsecond, with no lock (only the event loop records and scrapes).
- **the controller's**, counted the same way into its ``ControllerStats`` (passes,
  actions, placement's refusals, agent streams, failed replicas).
- **read at scrape time** from the router, the controller, the store and the server's
  certificates (queue lengths, requests in flight, replicas by state, nodes by state,
  engine installs, whether each static endpoint answers this server's check
  (``llmgw_endpoint_up``), whether the store answers, when a certificate expires): nothing is
  updated per request, and the scrape runs on the event loop, where those structures
  live, so it needs no lock.

Label values come from fixed sets only. A ``model`` label is a name from the catalog and
anything else is ``unknown``: a client's ``model`` field never becomes a label as sent
(one series per typo would grow without bound). ``kind`` is one of :data:`KINDS`,
``status`` a class such as ``2xx``, a refusal's ``reason`` one of :data:`REFUSAL_REASONS`.
An ``owner`` is the username of the account that owns the request's API key: counted by
the account's id (from the key's record, which only the store makes), named when
scraped, at most :data:`MAX_OWNERS` of them; ``anonymous`` (no key), ``unowned`` (a key
of no account) and ``other`` (past the cap, or an id the store no longer names) else.

Who may scrape (:class:`Access`): nobody when ``metrics.enabled`` is false; otherwise a
request carrying the metrics token (``metrics.token_file``) or the admin token, and a
request from loopback without forwarding headers (``metrics.allow_loopback``, on by
default) — a Prometheus or node agent on the server's own host needs no secret, a remote
scraper gets a token of its own that opens nothing else.
"""

from __future__ import annotations

import logging
import time
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

from llmgw.core.names import is_loopback_host
from llmgw.server.auth import admin_token_ok, bearer, read_secret_file
from llmgw.server.cluster_metrics import (
    CertificateCollector,
    ClusterCollector,
    ControllerCollector,
    StoreCollector,
)
from llmgw.server.dependencies import from_states
from llmgw.server.errors import ApiError
from llmgw.server.series import Count, Histogram
from llmgw.store import StoreError

if TYPE_CHECKING:
    from llmgw.config import ServerTls
    from llmgw.core.usage import Usage
    from llmgw.server.controller import Controller
    from llmgw.server.controller_stats import ControllerStats
    from llmgw.server.openai.router import Router
    from llmgw.server.openai.trail import Trail
    from llmgw.store import ApiKeyRecord, Store

log = logging.getLogger(__name__)

UNKNOWN_MODEL = "unknown"
KINDS = ("chat", "completions", "embeddings", "other")
REFUSAL_REASONS = ("queue_full", "queue_timeout", "rate_limit", "other")
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
DIRECTIONS = ("input", "output")
# Owners named in llmgw_requests_by_owner_total at most; later accounts count as "other".
MAX_OWNERS = 1000
ANONYMOUS, UNOWNED, OTHER = "anonymous", "unowned", "other"
# What an owner is counted by, beside an account's id: no key, a key of no account, and
# an account past MAX_OWNERS.
_ANONYMOUS, _UNOWNED, _OTHER = -1, -2, -3
_OWNER_LABELS = {_ANONYMOUS: ANONYMOUS, _UNOWNED: UNOWNED, _OTHER: OTHER}
# How often the accounts' names are read again at a scrape when no new owner was counted
# (an account renamed).
_OWNERS_STALE_S = 300.0

_KIND_OF_PATH = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                 "/v1/embeddings": "embeddings"}
# Answers take from milliseconds (embeddings) to minutes (long generations).
DURATION_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)
FIRST_BYTE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Between two tokens: a few ms on a fast engine, a second on an overloaded one.
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                       0.2, 0.3, 0.5, 1.0, 2.5)
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

    def refusal(self, request: Request, admin_token: str | None, path: str
                ) -> ApiError | None:
        """Why ``request`` may not read ``path`` (/metrics, or what serves scrapers as it
        does), or None when it may."""
        if not self.enabled:
            return ApiError(404, f"there is no GET {path} here (metrics.enabled is false)")
        if not self.allows(request, admin_token):
            return ApiError(401, "send the metrics token as `Authorization: Bearer …` "
                            "(metrics.token_file), or scrape from the server's own host",
                            code="metrics_token_required",
                            headers={"www-authenticate": "Bearer"})
        return None

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


class _RequestSeries:
    """The series of one (model, kind), resolved once; its tokens are exposed per model."""

    __slots__ = ("by_status", "duration", "tokens")

    def __init__(self) -> None:
        self.by_status = tuple(Count() for _ in STATUS_CLASSES)
        self.duration = Histogram(DURATION_BUCKETS)
        self.tokens = [0, 0]  # input, output


class StreamSeries:
    """The series one streamed answer of a model adds to: its time to the first token and
    the time between its next reads (``openai.timing.StreamClock`` observes them)."""

    __slots__ = ("first_token", "inter_token")

    def __init__(self) -> None:
        self.first_token = Histogram(FIRST_BYTE_BUCKETS)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS)


class EndpointCollector:
    """``llmgw_endpoint_up``: per static endpoint (labelled with its model and the name it
    goes by, both from the catalog), 1 while it is routed to (it answers this server's
    check, or was not checked yet), 0 while it is not."""

    def __init__(self, controller: Controller, registry: CollectorRegistry) -> None:
        self._controller = controller
        registry.register(self)

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "llmgw_endpoint_up", "1 while a static endpoint is routed to (it answers this "
            "server's health check), 0 while it is not.", labels=["model", "endpoint"])

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        controller = self._controller
        for model in controller.catalog.models:
            if not model.endpoints:
                continue
            for state in controller.endpoints.states(model):
                family.add_metric([model.name, state.name], 0 if state.health == "down" else 1)
        yield family


class Metrics:
    """The per-app registry, what the gateway records, and the scrape-time collectors.

    What the gateway records per request is kept in plain series of its own (``Count``,
    ``Histogram``) and handed to the registry when it is scraped (``collect``).

    ``trail`` is the gateway's other record of each request, its span and access-log
    line (``openai.trail``); None when neither is asked for, so that a request's end
    costs a branch for both. The gateway finds it here because this is what it tells of
    every request's end already.

    ``stats``, ``store`` and ``tls`` (the server's ``config.tls``) feed the controller's
    series, ``llmgw_store_up``, the owners' names and the certificates' expiry; without
    them those series are not exposed."""

    def __init__(self, controller: Controller, router: Router,
                 access: Access | None = None, *, process: bool = True,
                 stats: ControllerStats | None = None, store: Store | None = None,
                 tls: ServerTls | None = None, trail: Trail | None = None) -> None:
        self.controller = controller
        self.router = router
        self.access = access or Access()
        self.store = store
        self.trail = trail
        self.registry = CollectorRegistry(auto_describe=True)
        if process:
            _ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        # Each family's series by their labels: what a scrape exposes.
        self._request_series: dict[tuple[str, str], _RequestSeries] = {}
        self._first_byte_series: dict[str, Histogram] = {}
        self._retry_series: dict[str, Count] = {}
        self._refusal_series: dict[tuple[str, str], Count] = {}
        self._fallback_series: dict[tuple[str, str], Count] = {}
        self._stream_series: dict[str, StreamSeries] = {}
        # The same series keyed by what callers pass, but only ever for catalog names (and
        # the fixed kinds): an unknown model goes to the `unknown` series without a cache
        # entry of its own.
        self._series: dict[tuple[str | None, str], _RequestSeries] = {}
        self._first_bytes: dict[str | None, Histogram] = {}
        self._retry_counts: dict[str | None, Count] = {}
        self._refusal_counts: dict[tuple[str | None, str], Count] = {}
        self._streams: dict[str | None, StreamSeries] = {}
        # Requests by the owner of their key: by account id (or _ANONYMOUS, _UNOWNED,
        # _OTHER), named when scraped from what the store last said (id -> username);
        # and the same by what callers pass (an account id, None for a key of none),
        # accounts past the cap left out.
        self._owners: dict[int, tuple[Count, ...]] = {}
        self._owner_counts: dict[int | None, tuple[Count, ...]] = {}
        self._accounts = 0  # account ids among them
        self._owner_names: dict[int, str] = {}
        self._owners_read_at: float | None = None
        self._owners_asked: set[int] = set()  # the owners counted at that read
        self.registry.register(self)
        ClusterCollector(self, registry=self.registry)
        EndpointCollector(controller, registry=self.registry)
        if stats is not None:
            ControllerCollector(stats, self.model_label, registry=self.registry)
        if store is not None:
            StoreCollector(store, registry=self.registry)
        if tls is not None:
            CertificateCollector({"ca": tls.ca_file, "server": tls.cert_file},
                                  registry=self.registry)

    # --- the request path ------------------------------------------------------------------

    def model_label(self, model: str | None) -> str:
        """``model`` if the catalog declares it, else ``unknown``."""
        if model and self.controller.catalog.get(model) is not None:
            return model
        return UNKNOWN_MODEL

    def request_done(self, model: str | None, kind: str, status: int, seconds: float,
                     key: ApiKeyRecord | None = None, usage: Usage | None = None) -> None:
        """One request answered (a stream: when its last byte is sent). ``model`` as the
        client sent it, or None before it was read; ``kind`` from :func:`endpoint_kind`;
        ``key`` the record of its API key, None without one; ``usage`` the tokens its
        engine reported, if any."""
        series = self._series.get((model, kind))
        if series is None:
            series = self._child(self._request_series, self._series, (model, kind),
                                 (self.model_label(model), kind if kind in KINDS else "other"),
                                 _RequestSeries)
        index = _class_index(status)
        series.by_status[index].n += 1
        series.duration.observe(seconds)
        if usage is not None:
            tokens = series.tokens
            tokens[0] += usage[0]
            tokens[1] += usage[1]
        owner = _ANONYMOUS if key is None else key.account_id
        by_owner = self._owner_counts.get(owner)
        if by_owner is None:
            by_owner = self._owner(owner)
        by_owner[index].n += 1

    def _owner(self, owner: int | None) -> tuple[Count, ...]:
        counted = _UNOWNED if owner is None else owner
        if counted >= 0 and counted not in self._owners:
            if self._accounts >= MAX_OWNERS:
                counted = _OTHER  # past the cap: every later account is one series
            else:
                self._accounts += 1
        series = self._owners.get(counted)
        if series is None:
            series = self._owners[counted] = tuple(Count() for _ in STATUS_CLASSES)
        if counted != _OTHER:  # an account past the cap is looked up again each time
            self._owner_counts[owner] = series
        return series

    def first_byte(self, model: str | None, seconds: float) -> None:
        """A streamed answer's first chunk arrived, ``seconds`` after the request did."""
        child = self._first_bytes.get(model)
        if child is None:
            child = self._child(self._first_byte_series, self._first_bytes, model,
                                self.model_label(model),
                                lambda: Histogram(FIRST_BYTE_BUCKETS))
        child.observe(seconds)

    def stream_series(self, model: str | None) -> StreamSeries:
        """The series a streamed answer of ``model`` adds to as it goes."""
        child = self._streams.get(model)
        if child is None:
            child = self._child(self._stream_series, self._streams, model,
                                self.model_label(model), StreamSeries)
        return child

    def retry(self, model: str | None) -> None:
        """A replica refused before answering and the request goes to another one."""
        child = self._retry_counts.get(model)
        if child is None:
            child = self._child(self._retry_series, self._retry_counts, model,
                                self.model_label(model), Count)
        child.n += 1

    def refused(self, model: str | None, reason: str) -> None:
        """A 429; ``reason`` one of :data:`REFUSAL_REASONS` (anything else counts as
        ``other``)."""
        child = self._refusal_counts.get((model, reason))
        if child is None:
            why = reason if reason in REFUSAL_REASONS else "other"
            child = self._child(self._refusal_series, self._refusal_counts, (model, reason),
                                (self.model_label(model), why), Count)
        child.n += 1

    def fell_back(self, model: str, fallback: str) -> None:
        """A request ``model`` could not take goes on to its fallback ``fallback`` (both
        catalog names: admission resolved them)."""
        labels = (self.model_label(model), self.model_label(fallback))
        child = self._fallback_series.get(labels)
        if child is None:
            child = self._fallback_series[labels] = Count()
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

    async def name_owners(self) -> None:
        """Read the accounts' names from the store, before a scrape, when an owner was
        counted since the last read that has no name yet, or the names were read long
        ago. A store that does not answer leaves the names it gave last."""
        if self.store is None:
            return
        now = time.monotonic()
        read_at = self._owners_read_at
        new = any(owner >= 0 and owner not in self._owner_names
                  and owner not in self._owners_asked for owner in self._owners)
        if read_at is not None and not new and now - read_at < _OWNERS_STALE_S:
            return
        self._owners_read_at = now
        self._owners_asked = set(self._owners)
        try:
            accounts = await self.store.list_accounts()
        except StoreError as err:
            log.debug("the accounts' names for /metrics were not read: %s", err)
            return
        self._owner_names = {a.id: a.username for a in accounts if a.id is not None}

    def describe(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        """The per-request series, for the registry (which calls this when scraped)."""
        families = self._families()
        (requests, duration, first_byte, retries, refusals, fallbacks, tokens, first_token,
         inter_token, by_owner) = families
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
        for (model, fallback), count in self._fallback_series.items():
            fallbacks.add_metric([model, fallback], count.n)
        by_model: dict[str, list[int]] = {}
        for (model, _), series in self._request_series.items():
            summed = by_model.setdefault(model, [0, 0])
            summed[0] += series.tokens[0]
            summed[1] += series.tokens[1]
        for model, counts in by_model.items():
            for direction, n in zip(DIRECTIONS, counts, strict=True):
                tokens.add_metric([model, direction], n)
        for model, stream in self._stream_series.items():
            first_token.add_metric([model], stream.first_token.buckets(),
                                   stream.first_token.sum)
            inter_token.add_metric([model], stream.inter_token.buckets(),
                                   stream.inter_token.sum)
        owners: dict[str, list[int]] = {}
        for owner, counts in self._owners.items():
            name = _OWNER_LABELS.get(owner) or self._owner_names.get(owner, OTHER)
            summed = owners.setdefault(name, [0] * len(STATUS_CLASSES))
            for index, count in enumerate(counts):
                summed[index] += count.n
        for name, counts in owners.items():
            for status, n in zip(STATUS_CLASSES, counts, strict=True):
                by_owner.add_metric([name, status], n)
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
            CounterMetricFamily("llmgw_fallbacks", "Requests a model could not take (no "
                                "ready replica, its queue refused) sent on to a fallback, "
                                "before anything was sent to an engine.",
                                labels=["model", "fallback"]),
            CounterMetricFamily("llmgw_tokens", "Tokens of answers, as their engines "
                                "reported them: input (prompt) and output (completion).",
                                labels=["model", "direction"]),
            HistogramMetricFamily("llmgw_time_to_first_token_seconds",
                                  "For streamed answers: from the request's arrival to "
                                  "the first chunk that carries generated text.",
                                  labels=["model"]),
            HistogramMetricFamily("llmgw_inter_token_latency_seconds",
                                  "For streamed answers: the time between two reads of "
                                  "the engine's stream after the first token (a read is "
                                  "a token or a few).", labels=["model"]),
            CounterMetricFamily("llmgw_requests_by_owner",
                                "Requests answered on /v1 by the account that owns their "
                                "API key, and status class.", labels=["owner", "status"]),
        ]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


@get("/metrics", include_in_schema=False,
     dependencies=from_states("metrics", "admin_token"))
async def metrics_endpoint(request: Request, metrics: NamedDependency[Metrics],
                           admin_token: NamedDependency[str]) -> Response:
    """Prometheus' text format, for whom :class:`Access` lets in. Async on purpose: the
    collectors read the router and controller, which only the event loop may touch."""
    refusal = metrics.access.refusal(request, admin_token, "/metrics")
    if refusal is not None:
        return refusal.response()
    await metrics.name_owners()
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

