"""What the gateway does on the way to an engine: a connect that hangs is given up after
``gateway.connect_timeout_s``; the client's body reaches the engine byte for byte; a
stream from an endpoint llmgw has no route for (the generic ``/v1`` mount) is relayed as
it comes.

In process, on loopback: the engine client's Pool alone, or the gateway's routes on
llmgw's HTTP server (gateway_state.py) in front of a raw asyncio engine.
"""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import openai
import pytest

from llmgw.config import Gateway
from llmgw.transport.errors import ConnectError
from llmgw.transport.pool import Pool
from tests.integration.gateway_state import engine_answering, gateway_front_in_process

MODEL = "forwarding-model"
CONNECT_S = 0.5
# What a loaded two-core machine may add to a limit before the answer is seen.
MARGIN_S = 3.0
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def full_listener():
    """The port of a loopback listener whose accept queue is full: it never accepts, so
    the kernel drops SYNs to it and a connect hangs (not refused) until the client gives
    up. Checked here: the probe connect that finds the queue full must time out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    address = listener.getsockname()
    queued: list[socket.socket] = []
    try:
        for _ in range(8):  # backlog 0 holds one or two, depending on the kernel
            probe = socket.socket()
            probe.settimeout(1.0)
            try:
                probe.connect(address)
            except TimeoutError:
                probe.close()
                break
            queued.append(probe)
        else:
            pytest.fail("a listener that never accepts took 8 connections: no connect "
                        "hangs on this machine")
        yield address[1]
    finally:
        for sock in queued:
            sock.close()
        listener.close()


async def _until(predicate, what: str, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, f"waited {timeout_s} s for {what}"
        await asyncio.sleep(0.01)


# --- a connect that hangs ---------------------------------------------------------------


async def test_a_connect_that_hangs_is_a_timed_out_connect_error_at_the_connect_timeout(
        full_listener):
    pool = Pool(connect_timeout_s=CONNECT_S)
    loop = asyncio.get_running_loop()
    began = loop.time()
    try:
        with pytest.raises(ConnectError) as caught:
            # Bounded here too: without the pool's limit the kernel gives up after minutes.
            await asyncio.wait_for(pool.post(
                "127.0.0.1", full_listener, "/v1/chat/completions", b"{}",
                b"application/json", first_byte_timeout_s=30, idle_timeout_s=30),
                CONNECT_S + MARGIN_S)
        took = loop.time() - began
    finally:
        await pool.close()
    assert caught.value.timed_out and not caught.value.answered
    assert str(caught.value) == (f"no connection to 127.0.0.1:{full_listener} "
                                 f"within {CONNECT_S:g} s")
    # It waited for the limit (a refused connect fails at once), and not much longer.
    assert CONNECT_S - 0.05 <= took < CONNECT_S + MARGIN_S, took
    assert pool._idle == {}


async def test_a_replica_that_never_accepts_is_a_503_at_the_connect_timeout_and_frees_its_slot(
        full_listener):
    async def unused(head, body, reader, writer) -> bool:
        raise AssertionError("the request went to the engine that accepts")

    gateway = Gateway(connect_timeout_s=CONNECT_S, first_byte_timeout_s=30)
    async with gateway_front_in_process(MODEL, engine_answering(unused), gateway) as running:
        state = running.front.state
        # The one replica of the model is now the listener that never accepts.
        state.router.update({MODEL: [("r0", "127.0.0.1", full_listener)]})
        registry = state.metrics.registry
        retries = {"model": MODEL}
        before = registry.get_sample_value("llmgw_upstream_retries_total", retries) or 0
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1",
                                    api_key="unused", max_retries=0,
                                    timeout=CONNECT_S + MARGIN_S + 5)
        loop = asyncio.get_running_loop()
        try:
            began = loop.time()
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES)
            took = loop.time() - began
        finally:
            await client.close()
        err = caught.value
        assert err.status_code == 503, err.body
        # Nothing was sent to the engine: a refusal, tried on another replica if there
        # were one; none is, so the refusal is in the message.
        assert (err.code, err.type) == ("no_ready_replica", "service_unavailable")
        assert err.body["message"] == (
            f"no replica of {MODEL!r} can take the request: r0: no connection to "
            f"127.0.0.1:{full_listener} within {CONNECT_S:g} s")
        assert err.response.headers["retry-after"] == "5"
        assert CONNECT_S - 0.05 <= took < CONNECT_S + MARGIN_S, took
        assert registry.get_sample_value("llmgw_upstream_retries_total",
                                         retries) == before + 1
        await _until(lambda: state.router.in_flight() == {"r0": 0}, "r0's slot freed")
        assert running.front.served_now == 0


# --- the body as the client wrote it ----------------------------------------------------


def _odd_body(stream: bool) -> bytes:
    """A valid chat request no JSON encoder writes: whitespace of every kind, ``model``
    last, an escaped and a raw é, an escaped surrogate pair and the raw character, a key
    the gateway does not know, and numbers no float or int64 holds."""
    template = ('\r\n {\t"stream" :STREAM,\n  "messages":[ {"content" : "caf\\u00e9 café '
                '\\ud83e\\udd99 🦙 \\/ \\"q\\"",   "role":"user"}\n ] ,\n'
                '\t"x_unknown_extra": {"huge": 1e400, "big": 12345678901234567890, '
                '"tiny": -0.0e-400, "list": [ ]},\n'
                '  "seed" : 12345678901234567890,"model"  :  "MODEL"\n}\n\t ')
    return template.replace("STREAM", "true" if stream else "false").replace(
        "MODEL", MODEL).encode()


WHOLE = b'{"choices":[{"message":{"content":"ok"}}]}'
EVENTS = b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("path", ["task", "callbacks"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_clients_request_body_reaches_the_engine_byte_for_byte(stream, path):
    received: list[tuple[bytes, bytes]] = []

    async def answer(head, body, reader, writer) -> None:
        received.append((head, body))
        if b"accept: text/event-stream" in head.lower():
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
                         % (len(EVENTS), EVENTS))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (len(WHOLE), WHOLE))

    sent = _odd_body(stream)
    json.loads(sent)  # valid JSON, as the test means it to be
    async with gateway_front_in_process(MODEL, engine_answering(answer)) as running, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        url = f"http://127.0.0.1:{running.port}/v1/chat/completions"
        if path == "callbacks":
            # Opens the kept-alive connection the next request is sent on from callbacks.
            async with http.post(url, json={"model": MODEL, "messages": MESSAGES}) as resp:
                assert (resp.status, await resp.read()) == (200, WHOLE)
        # Raw bytes, not json=: the client's own formatting is what is checked.
        async with http.post(url, data=sent,
                             headers={"content-type": "application/json"}) as resp:
            assert resp.status == 200
            assert await resp.read() == (EVENTS if stream else WHOLE)
        assert running.front.served_now == (path == "callbacks")
        head, body = received[-1]
        assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert b"\r\ncontent-length: %d\r\n" % len(sent) in head.lower()
        assert body == sent
        assert running.front.state.router.in_flight() == {"r0": 0}


# --- a stream through the generic /v1 mount ---------------------------------------------


def _event(data: dict) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (data["type"].encode(), json.dumps(data).encode())


RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1, "model": MODEL,
            "status": "in_progress", "output": []}
DELTAS = ["Hel", "lo, ", "wor", "ld"]
STREAM_EVENTS = [
    {"type": "response.created", "sequence_number": 0, "response": RESPONSE},
    *({"type": "response.output_text.delta", "sequence_number": n, "item_id": "msg_1",
       "output_index": 0, "content_index": 0, "delta": delta, "logprobs": []}
      for n, delta in enumerate(DELTAS, 1)),
    {"type": "response.completed", "sequence_number": len(DELTAS) + 1,
     "response": {**RESPONSE, "status": "completed"}},
]


async def test_a_responses_stream_through_the_generic_mount_is_relayed_as_it_comes():
    received: list[tuple[bytes, bytes]] = []
    first_read = asyncio.Event()  # set by the test once its client has the first event
    ended = asyncio.Event()

    async def stream(head, body, reader, writer) -> None:
        received.append((head, body))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for n, data in enumerate(STREAM_EVENTS):
            event = _event(data)
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
            await writer.drain()
            if n == 0:
                # The rest only once the client has the first: a gateway that held the
                # stream back until its end would never let it.
                await asyncio.wait_for(first_read.wait(), 20)
            else:
                await asyncio.sleep(0.02)  # events apart, as an engine writes them
        writer.write(b"0\r\n\r\n")
        ended.set()

    async with gateway_front_in_process(MODEL, engine_answering(stream)) as running:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1",
                                    api_key="unused", max_retries=0, timeout=30)

        async def first_event():
            events = await client.responses.create(model=MODEL, input="hello", stream=True)
            return events, await events.__anext__()

        try:
            try:
                events, first = await asyncio.wait_for(first_event(), 10)
            except TimeoutError:
                pytest.fail("no first event in 10 s, while the engine waited for the "
                            "client to have it: the gateway held the stream back")
            got = [first]
            assert not ended.is_set()
            first_read.set()
            got += [event async for event in events]
        finally:
            await client.close()
        assert ended.is_set()
        assert [event.to_dict() for event in got] == STREAM_EVENTS
        assert "".join(e.delta for e in got if e.type == "response.output_text.delta") \
            == "Hello, world"
        (head, body), = received
        # To the same endpoint on the engine, asking for a stream.
        assert head.startswith(b"POST /v1/responses HTTP/1.1\r\n")
        assert b"\r\naccept: text/event-stream\r\n" in head.lower()
        assert json.loads(body) == {"model": MODEL, "input": "hello", "stream": True}
        assert running.front.served_now == 0  # not a route of llmgw's own
        await _until(lambda: running.front.state.router.in_flight() == {"r0": 0},
                     "r0's slot freed")
