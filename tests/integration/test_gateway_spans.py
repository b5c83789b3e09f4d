"""Each /v1 request as a SERVER span in OpenTelemetry's GenAI conventions, made by the
gateway when tracing is on, into an in-memory exporter; none at all when it is off.

In process, on loopback: the gateway's routes on llmgw's HTTP server (requests served
from callbacks and from tasks alike), in front of a raw asyncio engine that answers as
OpenAI-shaped engines do, usage and model included.
"""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from llmgw import config
from llmgw.server.access_log import AccessLog
from llmgw.server.openai.trail import Trail, trail_for
from llmgw.tracing import Tracing
from tests.integration.gateway_state import engine_answering, gateway_front_in_process

MODEL = "span-model"
PROMPT = "the secret prompt 7f3a"
ANSWERED_BY = "engine-model-v1"
USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _engine(head: bytes, body: bytes, reader, writer) -> None:
    """A chat engine: a stream of three tokens and a usage event, or a whole answer;
    500 for a request whose user is "break"."""
    request = json.loads(body)
    if request.get("user") == "break":
        error = b'{"error":{"message":"boom"}}'
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json"
                     b"\r\ncontent-length: %d\r\n\r\n%b" % (len(error), error))
        return
    if not request.get("stream"):
        answer = json.dumps({"model": ANSWERED_BY, "choices": [
            {"message": {"role": "assistant", "content": "hi"}}], "usage": USAGE}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(answer), answer))
        return
    events = [{"model": ANSWERED_BY, "choices": [{"delta": {"role": "assistant",
                                                            "content": ""}}]},
              *({"model": ANSWERED_BY, "choices": [{"delta": {"content": t}}]}
                for t in ("a", "b", "c")),
              {"model": ANSWERED_BY, "choices": [], "usage": USAGE}]
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
    for event in events:
        writer.write(_chunked(b"data: " + json.dumps(event).encode() + b"\n\n"))
        await writer.drain()
    writer.write(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def _post(http: aiohttp.ClientSession, port: int, headers: dict | None = None,
                **body) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], **body}
    async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                         headers=headers or {}) as resp:
        await resp.read()
        return resp.status


def _tracing(ratio: float) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing(config.Tracing(sample_ratio=ratio), exporter=exporter), exporter


@pytest.mark.parametrize("plain_uvicorn", [False, True], ids=["llmgw-server", "uvicorn"])
async def test_each_request_is_a_server_span_with_genai_attributes(plain_uvicorn):
    tracing, exporter = _tracing(1.0)
    async with gateway_front_in_process(MODEL, engine_answering(_engine),
                                        plain_uvicorn=plain_uvicorn) as running:
        state = running.front.state
        state.metrics.trail = Trail(tracing, None, state.controller)
        async with aiohttp.ClientSession() as http:
            assert await _post(http, running.port) == 200  # opens the engine connection
            assert await _post(http, running.port, headers={
                "traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}) == 200
            assert await _post(http, running.port, stream=True,
                               stream_options={"include_usage": True}) == 200
            assert await _post(http, running.port, model="no-such-model") == 404
            assert await _post(http, running.port, user="break") == 500
        if not plain_uvicorn:
            assert running.front.served_now >= 2  # the callback path made spans too
    tracing.shutdown()
    spans = exporter.get_finished_spans()
    assert len(spans) == 5
    whole, child, stream, missing, broken = spans
    for span in spans:
        assert span.kind is SpanKind.SERVER
        assert span.attributes["gen_ai.operation.name"] == "chat"
        assert span.attributes["gen_ai.provider.name"] == "llmgw"
        assert span.attributes["http.request.method"] == "POST"
        assert span.attributes["url.path"] == "/v1/chat/completions"
        assert span.start_time < span.end_time
        # Nothing of a prompt or an answer, anywhere in a span.
        assert not any(PROMPT in str(v) or v == "hi" for v in span.attributes.values())
    assert whole.name == "chat span-model"
    expected = {"gen_ai.request.model": MODEL, "gen_ai.response.model": ANSWERED_BY,
                "gen_ai.request.stream": False, "gen_ai.usage.input_tokens": 11,
                "gen_ai.usage.output_tokens": 3, "http.response.status_code": 200,
                "llmgw.replica": "r0", "llmgw.retries": 0}
    assert {name: whole.attributes.get(name) for name in expected} == expected
    # The first request (which opened the engine's connection) came by the task path,
    # which knows the client's address.
    assert whole.attributes.get("client.address") == "127.0.0.1"
    assert whole.parent is None
    assert whole.status.status_code is StatusCode.UNSET

    # The client's traceparent is the span's parent: one trace across both.
    assert child.parent is not None and child.parent.is_remote
    assert f"{child.parent.span_id:016x}" == PARENT_SPAN
    assert f"{child.context.trace_id:032x}" == PARENT_TRACE

    assert stream.attributes["gen_ai.request.stream"] is True
    assert stream.attributes["gen_ai.usage.output_tokens"] == 3
    assert stream.attributes["gen_ai.response.model"] == ANSWERED_BY
    ttft = stream.attributes["llmgw.time_to_first_token_s"]
    assert 0 < ttft < (stream.end_time - stream.start_time) / 1e9

    assert missing.name == "chat unknown"  # span names stay few: not the name as sent
    assert missing.attributes["gen_ai.request.model"] == "no-such-model"
    assert missing.attributes["http.response.status_code"] == 404
    assert "llmgw.replica" not in missing.attributes
    assert missing.status.status_code is StatusCode.UNSET

    assert broken.attributes["http.response.status_code"] == 500
    assert broken.attributes["error.type"] == "500"
    assert broken.status.status_code is StatusCode.ERROR


async def test_sampling_is_parent_based():
    """With a ratio of 0 no request starts a trace, and a client's sampled traceparent is
    still followed; an unsampled one is too (nothing recorded)."""
    tracing, exporter = _tracing(0.0)
    async with gateway_front_in_process(MODEL, engine_answering(_engine)) as running:
        state = running.front.state
        state.metrics.trail = Trail(tracing, None, state.controller)
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                assert await _post(http, running.port) == 200
            assert await _post(http, running.port, headers={
                "traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-00"}) == 200
            assert await _post(http, running.port, headers={
                "traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}) == 200
    tracing.shutdown()
    spans = exporter.get_finished_spans()
    assert len(spans) == 1
    assert f"{spans[0].parent.span_id:016x}" == PARENT_SPAN


async def test_tracing_off_creates_no_span_at_all(monkeypatch):
    """Off, the app has no trail (``trail_for`` gives None); with the access log alone, a
    trail without spans. Either way no tracer is asked for a span, not even the no-op
    one: its start_span is made to fail here, and every request still succeeds."""
    assert trail_for(config.ServerConfig(), Tracing(), None) is None  # type: ignore[arg-type]

    def no_span(*args, **kwargs):
        raise AssertionError("a span was started with tracing off")

    monkeypatch.setattr(trace.NoOpTracer, "start_span", no_span)
    logged = AccessLog(logging.getLogger("tests.gateway_spans.access"))
    for trail in (None, "log only"):
        async with gateway_front_in_process(MODEL, engine_answering(_engine)) as running:
            state = running.front.state
            if trail is not None:
                state.metrics.trail = Trail(Tracing(), logged, state.controller)
                assert state.metrics.trail.tracing is None
            async with aiohttp.ClientSession() as http:
                for stream in (False, False, True):
                    assert await _post(http, running.port, stream=stream) == 200
