"""An OTLP/HTTP trace receiver for tests: a real HTTP server on 127.0.0.1 that decodes
what llmgw's processes export (protobuf ExportTraceServiceRequest, gzip or not) into
plain :class:`Span` records a test can walk as trees."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    name: str
    attributes: dict
    events: list[tuple[str, dict]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    error: str | None = None  # the status message of a span that ended in error
    start_ns: int = 0
    end_ns: int = 0


def _value(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: list[KeyValue]) -> dict:
    return {pair.key: _value(pair.value) for pair in pairs}


class Receiver:
    """``endpoint`` is what a ``tracing.endpoint`` points at."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._take(self.path, body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def _take(self, path: str, body: bytes) -> None:
        assert path == "/v1/traces", path
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(Span(
                        service=service, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), name=s.name,
                        attributes=_attributes(s.attributes),
                        events=[(e.name, _attributes(e.attributes)) for e in s.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        error=s.status.message if s.status.code == 2 else None,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano))
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)

    # --- reading --------------------------------------------------------------------------

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def find(self, predicate: Callable[[Span], bool]) -> list[Span]:
        return [s for s in self.snapshot() if predicate(s)]

    def wait_for(self, predicate: Callable[[Span], bool], what: str,
                 timeout_s: float = 30) -> Span:
        """The first span received that matches, waiting for it up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.find(predicate)
            if found:
                return found[0]
            if time.monotonic() >= deadline:
                names = sorted({f"{s.service}: {s.name}" for s in self.snapshot()})
                raise AssertionError(f"no span {what} within {timeout_s:g} s; received: "
                                     f"{names}")
            time.sleep(0.05)

    def children(self, span: Span) -> list[Span]:
        return self.find(lambda s: s.parent_id == span.span_id
                         and s.trace_id == span.trace_id)

    def ancestors(self, span: Span) -> Iterator[Span]:
        by_id = {(s.trace_id, s.span_id): s for s in self.snapshot()}
        while span.parent_id:
            span = by_id.get((span.trace_id, span.parent_id))
            if span is None:
                return
            yield span
