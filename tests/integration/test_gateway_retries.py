"""Retries happen only before anything was sent to the client, and never duplicate tokens.

The gateway's real routing and forwarding (router, leases, aiohttp, ASGI send) against real
engines: a replica whose port refuses connections, one that answers 503 (a sim leader
whose worker never joined), and a healthy sim engine. Every request must be answered
exactly once, by the healthy engine, which sees each request once.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket

import pytest

from llmgw.config import Gateway
from llmgw.server.openai import routes
from llmgw.server.openai.admission import Ask
from llmgw.server.openai.proxy import upstream_pool
from llmgw.server.openai.router import Router
from llmgw.transport.pool import JSON_TYPE
from tests.integration.cluster import free_port
from tests.integration.gateway_state import gateway_state
from tests.integration.test_sim_engine import MODEL, Launcher, http, wait_for


@pytest.fixture
def engines(tmp_path_factory):
    launcher = Launcher(tmp_path_factory)
    healthy = launcher.ready("--tokens-per-second", "0")
    # A leader waiting for a worker that never comes answers every request with 503.
    lonely = launcher("--world-size", "2", "--rendezvous", f"127.0.0.1:{free_port()}",
                      port=free_port())
    wait_for("the lonely leader's 503", lambda: http(lonely.port, "/health")[0] == 503)
    refusing = free_port()  # nothing listens there
    yield healthy, lonely, refusing
    launcher.stop_all()


async def test_refused_and_503_replicas_are_retried_and_tokens_come_once(engines):
    healthy, lonely, refusing = engines
    router = Router(rng=random.Random(7))  # seeded: the same draws every run
    router.update({MODEL: [("refusing", "127.0.0.1", refusing), ("lonely", "127.0.0.1",
                                                                 lonely.port),
                           ("healthy", "127.0.0.1", healthy.port)]})
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "once"}]}).encode()
    head = routes._parse(body, "messages")
    before = http(healthy.port, "/sim/stats")[1]["requests_total"]
    pool = upstream_pool(Gateway())
    try:
        state = gateway_state(MODEL, router, pool)
        for _ in range(12):
            sent: list[dict] = []

            async def send(message: dict, sent=sent) -> None:
                sent.append(message)

            ask = Ask("/v1/chat/completions", "chat", head, body, JSON_TYPE, None)
            await routes._route(state, ask, send, routes._Seen(state.metrics), None)
            starts = [m for m in sent if m["type"] == "http.response.start"]
            assert [m["status"] for m in starts] == [200]  # one answer, started once
            text = b"".join(m.get("body", b"") for m in sent).decode()
            assert text.count("data: [DONE]") == 1
            tokens = [json.loads(line[6:])["choices"][0]["delta"].get("content")
                      for line in text.splitlines()
                      if line.startswith("data: {") and '"choices":[{' in line]
            assert sum(1 for t in tokens if t) == 8  # eight tokens, none twice
    finally:
        await pool.close()
    # The healthy engine saw each request exactly once; every slot was given back.
    assert http(healthy.port, "/sim/stats")[1]["requests_total"] - before == 12
    assert router.in_flight() == {"refusing": 0, "lonely": 0, "healthy": 0}
    retries = state.metrics.registry.get_sample_value("llmgw_upstream_retries_total",
                                                      {"model": MODEL})
    assert retries and retries >= 1


async def test_a_stream_broken_after_its_first_byte_is_not_retried():
    # A listener that accepts, answers the headers and a first event, then hangs up.
    breaker = socket.socket()
    breaker.bind(("127.0.0.1", 0))
    breaker.listen()
    port = breaker.getsockname()[1]

    async def serve_once(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n"
                     b"1a\r\ndata: {\"choices\":[]}\r\n\r\n\r\n")
        await writer.drain()
        writer.transport.abort()

    server = await asyncio.start_server(serve_once, sock=breaker)
    router = Router()
    router.update({MODEL: [("breaking", "127.0.0.1", port)]})
    body = json.dumps({"model": MODEL, "stream": True,
                       "messages": [{"role": "user", "content": "x"}]}).encode()
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    pool = upstream_pool(Gateway())
    try:
        state = gateway_state(MODEL, router, pool)
        ask = Ask("/v1/chat/completions", "chat", routes._parse(body, "messages"), body,
                  JSON_TYPE, None)
        await routes._route(state, ask, send, routes._Seen(state.metrics), None)
    finally:
        await pool.close()
        server.close()
        await server.wait_closed()
    text = b"".join(m.get("body", b"") for m in sent).decode()
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]
    assert text.startswith('data: {"choices":[]}')
    assert '"code":"upstream_error"' in text  # the stream ends with an error event
    assert state.metrics.registry.get_sample_value(
        "llmgw_upstream_retries_total", {"model": MODEL}) in (None, 0.0)
    assert router.in_flight() == {"breaking": 0}
