"""Input an attacker sends the gateway: a body nested 100,000 deep, a body that is not
UTF-8, a path with dot segments. Each is refused with a 400 that names the problem, in
OpenAI's envelope, before anything reaches an engine; what looks like them but is valid
still goes through, the fast way where it went that way before.

In process first (the gateway's routes on llmgw's HTTP server in front of a raw asyncio
engine that records what reaches it), on every way a request can take: served from the
server's callbacks, in the app's task, and through the generic ``/v1`` mount. Then the
same attacks on real processes: a server, an agent and the sim engine.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from llmgw.server.openai.routes import TOO_DEEP
from tests.integration.cluster import Cluster
from tests.integration.conftest import SIM_SMALL, one_node_cluster
from tests.integration.gateway_state import engine_answering, gateway_front_in_process

MODEL = "bad-input-model"
WHOLE = b'{"choices":[{"message":{"content":"ok"}}]}'
GOOD = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
# Deeper than any decoder's recursion limit; the attack as it was found.
ATTACK_DEPTH = 100_000


def _nested(depth: int, where: str = "messages", model: str = MODEL) -> bytes:
    """A chat body with ``depth`` arrays nested in ``where``."""
    return (b'{"model":"%b","%b":' % (model.encode(), where.encode())
            + b"[" * depth + b"]" * depth + b"}")


async def _post(port: int, target: bytes, body: bytes,
                reader_writer: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
                ) -> tuple[int, bytes, bytes]:
    """One POST written byte for byte (no client's URL normalising), on the given kept-alive
    connection or a new one: the answer's status, head and body (read by its length)."""
    reader, writer = reader_writer or await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%b" % (target, len(body), body))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    answer = await asyncio.wait_for(_content(head, reader), 10)
    if reader_writer is None:
        writer.close()
    return int(head.split(b" ", 2)[1]), head, answer


async def _content(head: bytes, reader: asyncio.StreamReader) -> bytes:
    """An answer's body, read by its length or its chunks."""
    if b"content-length: " in head.lower():
        return await reader.readexactly(
            int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
    content = b""
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
        content += (await reader.readexactly(size + 2))[:-2]
    await reader.readexactly(2)
    return content


def _error(answer: bytes) -> dict:
    return json.loads(answer)["error"]


class _Engine:
    """A test engine that answers every request with WHOLE and keeps what reached it."""

    def __init__(self) -> None:
        self.received: list[tuple[bytes, bytes]] = []

    async def answer(self, head: bytes, body: bytes, reader, writer) -> None:
        self.received.append((head, body))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(WHOLE), WHOLE))


@pytest.fixture
async def gateway():
    """The gateway in process in front of a recording engine: (port, front, engine)."""
    engine = _Engine()
    async with gateway_front_in_process(MODEL, engine_answering(engine.answer)) as running:
        yield running.port, running.front, engine


# The ways a request goes: from the server's callbacks (a known endpoint, its replica's
# kept-alive connection open), in the app's task (a query string: not a target the server
# holds for the callbacks), and as an endpoint llmgw does not know, forwarded by its model.
WAYS = {"callbacks": b"/v1/chat/completions", "task": b"/v1/chat/completions?via=task",
        "other-endpoint": b"/v1/responses"}


async def _refused_before_the_engine(gateway, target: bytes, body: bytes) -> dict:
    """Send ``body`` after a good request on the same connection (which opens the replica's
    kept-alive connection, so the callbacks try it first); it must be refused with a 400
    without reaching the engine, and a good request after it must still be served."""
    port, front, engine = gateway
    connection = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert (await _post(port, target, GOOD, connection))[0] == 200
        before = len(engine.received)
        status, head, answer = await _post(port, target, body, connection)
        assert status == 400, answer[:300]
        assert b"content-type: application/json" in head.lower()
        assert len(engine.received) == before, "a refused request reached the engine"
        assert (await _post(port, target, GOOD, connection))[0] == 200
    finally:
        connection[1].close()
    assert front.state.router.in_flight() == {"r0": 0}
    return _error(answer)


# --- 1. nesting ---------------------------------------------------------------------------


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("body", [
    _nested(ATTACK_DEPTH),
    _nested(ATTACK_DEPTH, where="x_unknown"),  # passed over, not read: nested all the same
    _nested(ATTACK_DEPTH).rstrip(b"]}"),  # never closed
    b'{"model":"%b","messages":[' % MODEL.encode() + b'{"a":' * ATTACK_DEPTH
    + b"1" + b"}" * ATTACK_DEPTH + b"]}",
], ids=["arrays", "unknown-field", "unclosed", "objects"])
async def test_a_body_nested_past_the_decoder_is_a_400_that_says_so(gateway, way, body):
    error = await _refused_before_the_engine(gateway, WAYS[way], body)
    assert error == {"message": TOO_DEEP, "type": "invalid_request_error", "param": None,
                     "code": "invalid_json"}


async def test_a_body_nested_as_deep_as_a_request_needs_is_forwarded_byte_for_byte(gateway):
    # A tool whose JSON schema nests 100 objects deep (a real one nests a handful), sent on
    # a warm connection: served from the callbacks, untouched.
    port, front, engine = gateway
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"inner": schema}}
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "tools": [{"type": "function", "function": {
                           "name": "deep", "parameters": schema}}]}).encode()
    await _forwarded_as_sent(port, front, engine, body)


async def _forwarded_as_sent(port: int, front, engine, body: bytes) -> None:
    """``body`` goes on the callback path (the fast one) and reaches the engine byte for
    byte."""
    connection = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert (await _post(port, WAYS["callbacks"], GOOD, connection))[0] == 200
        served = front.served_now
        assert (await _post(port, WAYS["callbacks"], body, connection))[0] == 200
    finally:
        connection[1].close()
    assert front.served_now == served + 1
    assert engine.received[-1][1] == body


# --- 4. UTF-8 -----------------------------------------------------------------------------


def _chat_with(content: bytes) -> bytes:
    return (b'{"model":"%b","messages":[{"role":"user","content":"%b"}]}'
            % (MODEL.encode(), content))


NOT_UTF8 = {
    "a stray byte": (_chat_with(b"caf\xe9"), "invalid continuation byte"),
    "0xff": (_chat_with(b"\xff"), "invalid start byte"),
    "cut short": (_chat_with(b"\xe2\x82"), "invalid continuation byte"),
    "a surrogate": (_chat_with(b"\xed\xa0\x80"), "invalid continuation byte"),
    "overlong": (_chat_with(b"\xc0\xaf"), "invalid start byte"),
    "in a key": (b'{"model":"%b","\xff":1,"messages":[1]}' % MODEL.encode(),
                 "invalid start byte"),
    "in a field passed over": (b'{"model":"%b","messages":[1],"user":"\xfe"}'
                               % MODEL.encode(), "invalid start byte"),
    # The one string routing reads: msgspec's own check raised (a 500) before.
    "in the model": (b'{"model":"m\xff","messages":[1]}', "invalid start byte"),
}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("case", NOT_UTF8)
async def test_a_body_that_is_not_utf8_is_a_400_before_any_engine(gateway, way, case):
    body, reason = NOT_UTF8[case]
    error = await _refused_before_the_engine(gateway, WAYS[way], body)
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"the request body is not valid UTF-8 ({reason} at "
                                       "byte "), error
    assert error["message"].endswith("; a JSON body must be UTF-8")


async def test_a_body_in_utf8_past_ascii_goes_the_fast_way_untouched(gateway):
    # Raw UTF-8 (what json.dumps(ensure_ascii=False) and JavaScript's JSON.stringify
    # write): é, CJK, an emoji, a character past the BMP; served from the callbacks.
    port, front, engine = gateway
    body = json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "café — 日本語 🦙 𝄞"}]}, ensure_ascii=False).encode()
    assert not body.isascii()
    await _forwarded_as_sent(port, front, engine, body)


# --- 5. dot segments ----------------------------------------------------------------------


DOT_PATHS = [b"/v1/%2e%2e/sim/stats", b"/v1/%2E%2E/sim/stats", b"/v1/%2e%2E/sim/stats",
             b"/v1/.%2e/sim/stats", b"/v1/../sim/stats", b"/v1/./responses",
             b"/v1/%2e/responses", b"/v1/responses/..", b"/v1/responses/.",
             b"/v1/chat/completions/../../sim/stats", b"/v1/x%2f..%2fsim/stats",
             b"/v1/x%2F%2E%2E%2Fsim/stats", b"/v1/responses/%2e%2e?x=1"]


@pytest.mark.parametrize("target", DOT_PATHS, ids=[p.decode() for p in DOT_PATHS])
async def test_a_path_with_a_dot_segment_is_a_400_and_is_not_forwarded(gateway, target):
    port, _, engine = gateway
    status, head, answer = await _post(port, target, GOOD)
    assert status == 400, answer
    assert b"content-type: application/json" in head.lower()
    path = target.decode().split("?", 1)[0]
    assert _error(answer) == {
        "message": f"the path {path} has a `.` or `..` segment (plain or escaped as %2e): "
                   "it is not forwarded; name the endpoint's own path",
        "type": "invalid_request_error", "param": None, "code": "invalid_path"}
    assert engine.received == []


@pytest.mark.parametrize("target", [b"/v1/responses", b"/v1/a..b/x", b"/v1/.../x",
                                    b"/v1/.well-known/x", b"/v1/x./y", b"/v1/%2e%2e%2e",
                                    b"/v1/%252e%252e/x"])
async def test_dots_that_are_not_a_segment_of_their_own_are_forwarded_as_written(
        gateway, target):
    port, _, engine = gateway
    status, _, answer = await _post(port, target, GOOD)
    assert (status, answer) == (200, WHOLE)
    assert engine.received[-1][0].startswith(b"POST %b HTTP/1.1\r\n" % target)


# --- the attacks on real processes ----------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    with one_node_cluster(tmp_path_factory.mktemp("bad-input"), request, [SIM_SMALL]) as c:
        yield c


def _raw_post(c: Cluster, target: bytes, body: bytes, token: str) -> tuple[int, bytes]:
    """A POST to the running server written byte for byte: httpx would resolve the dot
    segments before sending them."""
    with socket.create_connection(("127.0.0.1", c.port), timeout=30) as sock:
        sock.sendall(b"POST %b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                     b"authorization: Bearer %b\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b"
                     % (target, token.encode(), len(body), body))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, content = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]
    if b"transfer-encoding: chunked" in head.lower():
        chunks, content = content, b""
        while size := int(chunks.split(b"\r\n", 1)[0], 16):
            chunks = chunks.split(b"\r\n", 1)[1]
            content, chunks = content + chunks[:size], chunks[size + 2:]
    return int(head.split(b" ", 2)[1]), content


def test_the_attacks_as_found_are_refused_by_a_running_server(cluster):
    key = cluster.api_key
    deep = _nested(ATTACK_DEPTH, model="sim-small")
    for target in (b"/v1/chat/completions", b"/v1/chat/completions?via=task",
                   b"/v1/rerank"):
        status, answer = _raw_post(cluster, target, deep, key)
        assert (status, _error(answer)["message"]) == (400, TOO_DEEP), answer[:300]

    # The model API: a body nested in `profiles`, with the admin token.
    status, answer = _raw_post(cluster, b"/api/models",
                               b'{"name":"deep","profiles":' + b"[" * ATTACK_DEPTH
                               + b"]" * ATTACK_DEPTH + b"}", cluster.admin_token)
    assert status == 400, answer[:300]
    assert _error(answer)["message"].startswith("the JSON body is nested too deeply")
    assert _error(answer)["code"] == "invalid_json"
    assert "deep" not in [m["name"] for m in cluster.admin("GET", "/api/models").json()]
    # Every other /api body is read by the same decoder: not UTF-8 is a 400, and deep
    # nesting is refused at its first level, where a typed field wants no array.
    for target, bad, code in [
            (b"/api/keys", b'{"name":' + b"[" * ATTACK_DEPTH + b"]" * ATTACK_DEPTH + b"}",
             "invalid_value"),
            (b"/api/keys", b'{"name":"\xff\xfe"}', "invalid_json"),
            (b"/api/models", b'{"name":"\xff","profiles":[]}', "invalid_json")]:
        status, answer = _raw_post(cluster, target, bad, cluster.admin_token)
        assert (status, _error(answer)["code"]) == (400, code), answer[:300]

    # Not UTF-8: the sim engine answered it with a plain-text 500, passed on.
    status, answer = _raw_post(cluster, b"/v1/chat/completions", b'{"model":"sim-small",'
                               b'"messages":[{"role":"user","content":"\xff\xfe"}]}', key)
    assert status == 400 and _error(answer)["code"] == "invalid_json", answer

    # The engine's own /sim/stats, reached through /v1.
    for target in (b"/v1/%2e%2e/sim/stats", b"/v1/../sim/stats"):
        status, answer = _raw_post(cluster, target, b'{"model":"sim-small"}', key)
        assert (status, _error(answer)["code"]) == (400, "invalid_path"), answer

    # The server is whole after all of it.
    chat = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {key}"},
                      json={"model": "sim-small", "max_tokens": 3,
                            "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    log = (cluster.root / "server.log").read_text()
    assert "RecursionError" not in log and "unexpected error" not in log
