"""OpenTelemetry traces for the server and the agent (``tracing:`` in their YAML).

One :class:`Tracing` per process (per app in tests), never the global provider, so that
several servers in one process each keep their own. With no ``endpoint`` it is off: its
tracer is OpenTelemetry's no-op one, whose spans record nothing, and :meth:`carrier` is
empty, so commands on the agent stream carry no trace context.

On, spans go in batches over OTLP/HTTP (protobuf) to the collector. Sampling is decided
where a trace starts and followed below it (parent-based): a ``/v1`` request (a SERVER
span) starts a trace with probability ``sample_ratio`` unless the client's
``traceparent`` decided already; the controller's and the nodes' traces are few and all
kept. ``OTEL_BSP_SCHEDULE_DELAY`` and the other batch settings of OpenTelemetry's
environment apply.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

from llmgw import config

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_GETTER = DefaultGetter()


class Tracing:
    """The tracer of one process, and the trace context that crosses the agent stream."""

    def __init__(self, settings: config.Tracing | None = None, *,
                 default_service: str = "llmgw", instance: str | None = None,
                 exporter: object | None = None) -> None:
        """``exporter``: a SpanExporter to use instead of OTLP/HTTP to ``endpoint``."""
        settings = settings or config.Tracing()
        self.enabled = bool(settings.endpoint) or exporter is not None
        self._provider = None
        if not self.enabled:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            return
        # Imported only when on: the SDK and the exporter cost ~60 ms at start.
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attributes = {"service.name": settings.service_name or default_service,
                      "service.version": _llmgw_version()}
        if instance:
            attributes["service.instance.id"] = instance
        self._provider = TracerProvider(resource=Resource.create(attributes),
                                        sampler=_sampler(settings.sample_ratio))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
            exporter = OTLPSpanExporter(endpoint=settings.endpoint,
                                        headers=read_headers(settings.headers_file))
            # Its HTTP client would log a line per export at debug level.
            logging.getLogger("urllib3.connectionpool").setLevel(logging.INFO)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._provider.get_tracer("llmgw", _llmgw_version())
        log.info("tracing to %s (service %s, %g of /v1 requests sampled)",
                 settings.endpoint or "a local exporter", attributes["service.name"],
                 settings.sample_ratio)

    def start(self, name: str, *, parent: trace.Span | otel_context.Context | None = None,
              kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes = None,
              links: Sequence[Link] = (), start_time: int | None = None) -> trace.Span:
        """A span not made current (its end is the caller's): a child of ``parent`` (a
        span, or a context from :meth:`context_of`), else the root of a new trace."""
        if isinstance(parent, trace.Span):
            parent = trace.set_span_in_context(parent)
        elif parent is None:
            parent = _ROOT
        return self.tracer.start_span(name, context=parent, kind=kind, attributes=attributes,
                                      links=links, start_time=start_time)

    def carrier(self, span: trace.Span | None) -> dict[str, str]:
        """``span``'s W3C context (``traceparent``, ``tracestate``) for the agent stream;
        empty when tracing is off or the span is not sampled."""
        if not self.enabled or span is None or not span.get_span_context().is_valid:
            return {}
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def context_of(self, carrier: Mapping[str, str] | None) -> otel_context.Context | None:
        """The remote parent a command or a request's headers carry, or None."""
        if not self.enabled or not carrier:
            return None
        ctx = _PROPAGATOR.extract(carrier, getter=_GETTER)
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    def link_to(self, span: trace.Span | otel_context.Context | None) -> list[Link]:
        """A link to ``span`` (or a remote context's span), for a trace of its own that
        was caused by it."""
        if span is None or not self.enabled:
            return []
        if not isinstance(span, trace.Span):
            span = trace.get_current_span(span)
        span_context = span.get_span_context()
        return [Link(span_context)] if span_context.is_valid else []

    @contextlib.contextmanager
    def step(self, name: str, parent: trace.Span | None, **attributes: object
             ) -> Iterator[trace.Span]:
        """A child span of ``parent`` around a step, ended with an error status if the
        step raises; nothing at all when ``parent`` is not recorded (tracing off, or a
        trace not sampled)."""
        if parent is None or not parent.is_recording():
            yield trace.INVALID_SPAN
            return
        span = self.start(name, parent=parent, attributes={
            k: v for k, v in attributes.items() if v is not None})  # type: ignore[misc]
        try:
            yield span
        except BaseException as err:
            end(span, error=str(err) or type(err).__name__)
            raise
        end(span)

    def shutdown(self) -> None:
        """Send what is batched (a few seconds at most) and stop the exporter."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None


OFF = Tracing()
_ROOT = otel_context.Context()


def end(span: trace.Span, error: str | None = None, **attributes: object) -> None:
    """End ``span``, with ``attributes`` set first and an error status when ``error``."""
    if not span.is_recording():
        span.end()
        return
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)  # type: ignore[arg-type]
    if error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end()


def read_headers(path: str | None) -> dict[str, str]:
    """``Name: value`` lines of ``tracing.headers_file`` (blank lines and ``#`` comments
    skipped); a line without a colon is an error naming the file and line."""
    if not path:
        return {}
    headers: dict[str, str] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise config.ConfigError(f"tracing.headers_file: cannot read {path}: "
                                 f"{err.strerror}") from None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise config.ConfigError(f"tracing.headers_file: {path} line {number}: expected "
                                     "`Name: value`")
        headers[name.strip().lower()] = value.strip()
    return headers


def _sampler(ratio: float):
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_ON,
        ParentBased,
        Sampler,
        TraceIdRatioBased,
    )

    requests = ParentBased(TraceIdRatioBased(ratio))
    everything = ParentBased(ALWAYS_ON)

    class _ByKind(Sampler):
        """/v1 requests (SERVER spans) by the ratio; the rest always; parents decide
        first."""

        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None,
                          links=None, trace_state=None):
            chosen = requests if kind is SpanKind.SERVER else everything
            return chosen.should_sample(parent_context, trace_id, name, kind, attributes,
                                        links, trace_state)

        def get_description(self) -> str:
            return f"llmgw(requests={ratio:g}, else always; parent-based)"

    return _ByKind()


def _llmgw_version() -> str:
    try:
        return version("llmgw")
    except PackageNotFoundError:
        return "unknown"
