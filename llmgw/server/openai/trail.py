"""A ``/v1`` request's span and access-log line: what the gateway records of it beside
its metrics, when ``tracing`` or ``logging.access`` asks for either.

Both are made once the request is over, from a :class:`Done` that says how it went and
the :class:`Origin` read from its head when it came. Off (no tracing endpoint and no
access log), the app has no Trail at all: the gateway then creates no span, not even a
no-op one, and builds neither, and what it costs is a branch per request.

The span is a SERVER span in OpenTelemetry's GenAI semantic conventions: named
``{gen_ai.operation.name} {model}``, started at the request's arrival, a child of the
client's ``traceparent`` when it sent one (sampling is parent-based: a sampled parent is
always followed, else ``tracing.sample_ratio`` decides). ``gen_ai.provider.name`` is
``llmgw``: the conventions make it the discriminator of provider-specific attributes
(``openai.*`` for OpenAI itself), and the API a client reached is llmgw's, whatever
engine serves the model; the deprecated ``gen_ai.system`` is not set. Nothing of a
prompt or an answer is recorded.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
from opentelemetry.trace import SpanKind

from llmgw.core.usage import Usage
from llmgw.server.access_log import MODEL_CHARS, AccessLog
from llmgw.store import ApiKeyRecord
from llmgw.tracing import end

if TYPE_CHECKING:
    from llmgw.config import ServerConfig
    from llmgw.server.controller import Controller
    from llmgw.tracing import Tracing

# gen_ai.operation.name of each endpoint's metrics kind; other endpoints are "other".
OPERATIONS = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings"}
PROVIDER = "llmgw"
_TRACE_HEADERS = (b"traceparent", b"tracestate")


class Origin(msgspec.Struct):
    """What a request's head said that its span and log line use."""

    client: str | None = None  # host:port
    request_id: str | None = None
    trace: dict[str, str] | None = None  # traceparent, tracestate


class Done(msgspec.Struct, kw_only=True):
    """How a request went."""

    path: str
    kind: str  # its metrics kind (metrics.endpoint_kind)
    model: str | None  # as the client sent it; None before it was read
    status: int
    seconds: float  # from its arrival to its end
    stream: bool = False
    first_token: float | None = None  # seconds from its arrival
    usage: Usage | None = None  # as the engine reported it
    response_model: str | None = None  # the model the engine's answer named
    replica: str | None = None  # the replica that answered (the last one tried)
    retries: int = 0
    key: ApiKeyRecord | None = None


class Trail:
    """Where a request's span (``tracing``, when enabled) and access-log line (``log``)
    go. Made only when one of them is on (:func:`trail_for`)."""

    def __init__(self, tracing: Tracing | None, log: AccessLog | None,
                 controller: Controller) -> None:
        self.tracing = tracing if tracing is not None and tracing.enabled else None
        self.log = log
        # Whose catalog names the model in a span's name (else "unknown"), so that span
        # names stay few whatever clients send.
        self._controller = controller

    def origin(self, headers: dict[bytes, bytes], client: str | None) -> Origin:
        """From a request's head: its headers by lower-case name, the client's address."""
        trace = None
        if self.tracing is not None:
            for name in _TRACE_HEADERS:
                value = headers.get(name)
                if value is not None:
                    if trace is None:
                        trace = {}
                    trace[name.decode()] = value.decode("latin-1")
        request_id = headers.get(b"x-request-id") if self.log is not None else None
        return Origin(client=client, trace=trace,
                      request_id=None if request_id is None
                      else request_id.decode("latin-1")[:128])

    def record(self, done: Done, origin: Origin) -> None:
        """The request is over: its span and its line."""
        wall_end = time.time()
        if self.tracing is not None:
            self._span(done, origin, wall_end)
        if self.log is not None:
            self.log.write(done, origin, wall_end)

    def _span(self, done: Done, origin: Origin, wall_end: float) -> None:
        tracing = self.tracing
        assert tracing is not None
        parent = tracing.context_of(origin.trace) if origin.trace else None
        operation = OPERATIONS.get(done.kind, "other")
        model = done.model
        label = (model if model and self._controller.catalog.get(model) is not None
                 else "unknown")
        usage = done.usage
        server_error = done.status >= 500
        # All at the start, as one dict: the SDK checks a dict's values in one pass, and
        # each set_attribute after would take its lock again (about 2 µs an attribute).
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": None if model is None else model[:MODEL_CHARS],
            "gen_ai.response.model": (None if done.response_model is None
                                      else done.response_model[:MODEL_CHARS]),
            "gen_ai.request.stream": done.stream,
            "gen_ai.usage.input_tokens": None if usage is None else usage.prompt_tokens,
            "gen_ai.usage.output_tokens": None if usage is None else usage.completion_tokens,
            "http.request.method": "POST",
            "http.response.status_code": done.status,
            "url.path": done.path[:256],
            "client.address": origin.client,
            "error.type": str(done.status) if server_error else None,
            "llmgw.replica": done.replica,
            "llmgw.retries": done.retries,
            "llmgw.time_to_first_token_s": done.first_token,
            "llmgw.api_key_id": None if done.key is None else done.key.prefix,
        }
        span = tracing.start(
            f"{operation} {label}", parent=parent, kind=SpanKind.SERVER,
            attributes={name: value for name, value in attributes.items()
                        if value is not None},
            start_time=int((wall_end - done.seconds) * 1e9))
        end(span, error=f"answered {done.status}" if server_error else None)


def trail_for(config: ServerConfig, tracing: Tracing, controller: Controller
              ) -> Trail | None:
    """The server's Trail: None when neither tracing nor the access log is on."""
    log = AccessLog() if config.logging.access == "json" else None
    if not tracing.enabled and log is None:
        return None
    return Trail(tracing, log, controller)
