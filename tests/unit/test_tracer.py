"""llmgw.tracing: off is the no-op tracer and an empty carrier; on, /v1 requests are
sampled by the ratio unless the client's traceparent decided, everything else is kept;
the headers file is read strictly."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from llmgw import config
from llmgw.tracing import OFF, Tracing, end, read_headers

CLIENT_SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CLIENT_NOT_SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def test_off_records_nothing_and_carries_nothing() -> None:
    assert not OFF.enabled
    span = OFF.start("reconcile")
    assert not span.is_recording()
    assert OFF.carrier(span) == {}
    assert OFF.context_of({"traceparent": CLIENT_SAMPLED}) is None
    with OFF.step("weights", span) as step:
        assert not step.is_recording()


def test_requests_follow_the_ratio_and_the_client_everything_else_is_kept() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(config.Tracing(sample_ratio=0.0), exporter=exporter)
    assert not tracing.start("chat m", kind=SpanKind.SERVER).is_recording()
    honoured = tracing.start("chat m", kind=SpanKind.SERVER,
                             parent=tracing.context_of({"traceparent": CLIENT_SAMPLED}))
    declined = tracing.start("chat m", kind=SpanKind.SERVER,
                             parent=tracing.context_of({"traceparent": CLIENT_NOT_SAMPLED}))
    assert honoured.is_recording() and not declined.is_recording()
    assert f"{honoured.get_span_context().trace_id:032x}" == CLIENT_SAMPLED.split("-")[1]
    assert tracing.start("reconcile").is_recording()

    everything = Tracing(config.Tracing(sample_ratio=1.0), exporter=InMemorySpanExporter())
    assert everything.start("chat m", kind=SpanKind.SERVER).is_recording()


def test_a_carrier_continues_the_trace_on_the_other_side() -> None:
    server_spans, node_spans = InMemorySpanExporter(), InMemorySpanExporter()
    server = Tracing(config.Tracing(), exporter=server_spans)
    start = server.start("start m-e1")
    carrier = server.carrier(start)
    node = Tracing(config.Tracing(), exporter=node_spans)
    shard = node.start("start llmgw-shard-m-e1-0", parent=node.context_of(carrier))
    with node.step("launch", shard):
        pass
    with pytest.raises(RuntimeError), node.step("readiness", shard):
        raise RuntimeError("exited with code 1")
    end(shard, error="exited with code 1")
    end(start)
    server.shutdown()
    node.shutdown()
    spans = {s.name: s for s in node_spans.get_finished_spans()}
    assert spans["start llmgw-shard-m-e1-0"].parent.span_id == start.get_span_context().span_id
    assert spans["launch"].parent.span_id == shard.get_span_context().span_id
    assert spans["readiness"].status.description == "exited with code 1"


def test_the_headers_file_is_read_as_name_value_lines(tmp_path) -> None:
    path = tmp_path / "headers"
    path.write_text("# the collector's key\nAuthorization: Bearer s3cret\n\nX-Scope: a:b\n")
    assert read_headers(str(path)) == {"authorization": "Bearer s3cret", "x-scope": "a:b"}
    path.write_text("Authorization Bearer s3cret\n")
    with pytest.raises(config.ConfigError, match=r"line 1: expected `Name: value`"):
        read_headers(str(path))
    with pytest.raises(config.ConfigError, match=r"tracing\.headers_file: cannot read"):
        read_headers(str(tmp_path / "missing"))
