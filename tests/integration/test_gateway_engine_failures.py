"""What the gateway sends again when an engine fails, and what it never does.

A request written to an engine is not sent to another, however the engine fails: it may
have been working on it (the tokens would be generated twice), and a request that killed
one engine would go on to kill the next. One that reached no engine is sent again: a
refused connection and a 503 on another replica, and a kept-alive connection the engine
had closed before the request came on a new connection.

Real sim engines as processes on loopback; the gateway in process on the test's loop (its
routes on llmgw's HTTP server, or its upstream pool alone).
"""

from __future__ import annotations

import asyncio
import json
import select
import socket

import aiohttp
import pytest

from llmgw.config import Gateway
from llmgw.server.openai.proxy import upstream_pool
from tests.integration.gateway_state import engine_answering, gateway_front_in_process
from tests.integration.test_sim_engine import MODEL, Launcher, Sim, http

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "once only"}]
# Slow enough that a reply of LONG tokens is still being generated when the test kills
# its engine: minutes, against the client's CLIENT_S.
PACE = "5"
LONG = 1000
CLIENT_S = 20
# The sim engine's keep-alive time in the tests of a connection it closes while idle.
KEEPALIVE_S = 0.5


@pytest.fixture
def launcher(tmp_path_factory):
    started = Launcher(tmp_path_factory)
    yield started
    started.stop_all()


async def _unused(head, body, reader, writer) -> bool:
    raise AssertionError("the request went to the gateway's own test engine")


def _stats(sim: Sim) -> dict:
    return http(sim.port, "/sim/stats")[1]


async def _until(check, what: str, timeout_s: float = 10.0):
    """``check()`` (run in a thread: it may ask an engine) until it is truthy; its value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (value := await asyncio.to_thread(check)):
        assert loop.time() < deadline, f"waited {timeout_s} s for {what}"
        await asyncio.sleep(0.02)
    return value


async def _chat(session: aiohttp.ClientSession, port: int, max_tokens: int,
                user: str = "") -> tuple[int, dict]:
    async with session.post(f"http://127.0.0.1:{port}{CHAT}", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens,
            "user": user}) as resp:
        return resp.status, await resp.json()


def _route_to(front, sims: dict[str, Sim]) -> None:
    front.state.router.update({MODEL: [(name, "127.0.0.1", sim.port)
                                       for name, sim in sims.items()]})


@pytest.mark.parametrize("way", ["task", "callback"])
async def test_a_chat_whose_engine_is_killed_mid_generation_is_a_502_no_other_replica_sees(
        launcher, way):
    sims = {"a": launcher.ready("--tokens-per-second", PACE),
            "b": launcher.ready("--tokens-per-second", PACE)}
    async with gateway_front_in_process(MODEL, engine_answering(_unused)) as running, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_S)) as session:
        front = running.front
        if way == "callback":
            # A kept-alive connection to each engine: the request goes from callbacks.
            for name, sim in sims.items():
                _route_to(front, {name: sim})
                assert (await _chat(session, running.port, 1))[0] == 200
        _route_to(front, sims)
        before = {name: _stats(sim)["requests_total"] for name, sim in sims.items()}
        reply = asyncio.ensure_future(_chat(session, running.port, LONG))
        try:
            (working,) = await _until(
                lambda: [n for n, s in sims.items() if _stats(s)["in_flight"]],
                "an engine generating the reply")
            sims[working].proc.kill()  # SIGKILL, by its PID: as a health watch would
            sims[working].proc.wait()
            status, body = await reply
        finally:
            reply.cancel()
        assert status == 502, body
        assert body["error"]["code"] == "upstream_error"
        assert body["error"]["message"] == (
            f"{working}: the engine closed the connection before answering; not retried: "
            "the engine may have been working on it")
        assert front.served_now == (1 if way == "callback" else 0)
        (other,) = set(sims) - {working}
        # The other engine never saw it.
        assert _stats(sims[other]) == {"in_flight": 0, "requests_total": before[other]}
        assert front.state.router.in_flight() == {"a": 0, "b": 0}
        assert front.state.metrics.registry.get_sample_value(
            "llmgw_upstream_retries_total", {"model": MODEL}) in (None, 0.0)


async def test_a_replica_whose_engine_is_gone_is_still_tried_on_another(launcher):
    sims = {"gone": launcher.ready("--tokens-per-second", "0"),
            "up": launcher.ready("--tokens-per-second", "0")}
    async with gateway_front_in_process(MODEL, engine_answering(_unused)) as running, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_S)) as session:
        front = running.front
        for name, sim in sims.items():  # a kept-alive connection to each, as in use
            _route_to(front, {name: sim})
            assert (await _chat(session, running.port, 1))[0] == 200
        _route_to(front, sims)
        assert sims["gone"].stop() == 0  # before the requests: its port refuses them
        retries = front.state.metrics.registry
        sent = 0
        while not retries.get_sample_value("llmgw_upstream_retries_total", {"model": MODEL}):
            assert sent < 20, "20 requests and none was routed to the engine that is gone"
            # Each its own affinity key: routed across the replicas.
            status, body = await _chat(session, running.port, 2, user=f"user-{sent}")
            assert status == 200, body
            sent += 1
        assert _stats(sims["up"])["requests_total"] == 1 + sent
        assert front.state.router.in_flight() == {"gone": 0, "up": 0}


def _wait_for_its_close(conn) -> None:
    """Block, without giving the loop a turn, until the engine's close of ``conn`` (a
    pooled connection) reached this end: the pool still holds it as idle, as one that the
    engine closed just as it was picked."""
    readable, _, _ = select.select([conn.transport.get_extra_info("socket")], [], [],
                                   KEEPALIVE_S + 10)
    assert readable, "the engine did not close the idle connection"


async def test_a_pooled_connection_the_engine_closed_is_sent_again_on_a_new_one(launcher):
    sim = launcher.ready("--tokens-per-second", "0", "--keepalive-timeout", str(KEEPALIVE_S))
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 3}).encode()
    pool = upstream_pool(Gateway())

    async def post():
        answer = await pool.post("127.0.0.1", sim.port, CHAT, body, b"application/json",
                                 first_byte_timeout_s=10, idle_timeout_s=10)
        content = await answer.read()
        answer.close()
        return answer, content

    try:
        first, content = await post()
        assert first.status == 200, content
        (stale,) = pool._idle[("127.0.0.1", sim.port)]
        _wait_for_its_close(stale)
        again, content = await post()  # on the closed connection first
    finally:
        await pool.close()
    assert again.status == 200, content
    assert json.loads(content)["usage"]["completion_tokens"] == 3
    assert again._conn is not stale  # the second try, on a new connection
    assert _stats(sim)["requests_total"] == 2  # the request reached the engine once


def _answer(client: socket.socket) -> tuple[int, bytes]:
    """One whole HTTP answer with a length, read from ``client``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += client.recv(65536) or b"<closed>"
        assert not data.endswith(b"<closed>"), data
    head, _, content = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(content) < length:
        more = client.recv(65536)
        assert more, content
        content += more
    return int(head.split(b" ")[1]), content


async def test_a_request_from_callbacks_on_a_connection_the_engine_closed_is_sent_again(
        launcher):
    sim = launcher.ready("--tokens-per-second", "0", "--keepalive-timeout", str(KEEPALIVE_S))
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 3}).encode()
    request = (f"POST {CHAT} HTTP/1.1\r\nhost: llmgw\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    async with gateway_front_in_process(MODEL, engine_answering(_unused)) as running:
        front = running.front
        _route_to(front, {"r0": sim})
        with socket.create_connection(("127.0.0.1", running.port), timeout=CLIENT_S) as client:
            client.sendall(request)  # opens the gateway's connection to the engine
            assert (await asyncio.to_thread(_answer, client))[0] == 200
            assert front.served_now == 0
            (stale,) = front.state.upstream._idle[("127.0.0.1", sim.port)]
            # The next request is in the gateway's socket before the engine's close comes
            # to its connection: the loop sees the request first and sends it on that
            # connection, from callbacks.
            client.sendall(request)
            _wait_for_its_close(stale)
            status, content = await asyncio.to_thread(_answer, client)
        assert status == 200, content
        assert json.loads(content)["usage"]["completion_tokens"] == 3
        assert front.served_now == 1  # sent on the closed connection
        assert _stats(sim)["requests_total"] == 2  # and reached the engine once
        assert front.state.router.in_flight() == {"r0": 0}
