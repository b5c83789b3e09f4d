"""The gateway's edges, through real processes: endpoints it has never heard of, engines
that stop answering, and clients that leave. Traffic goes through the official `openai`
client where it has a call for it. The contract's tests (``@on_every_server``) run on each
HTTP server llmgw runs (``listen.server``): on granian the gateway has no BodyWriter and
no callback path, and learns of a client leaving through ASGI alone."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import time

import httpx
import openai
import psutil
import pytest

from llmgw.config import HTTP_SERVERS
from tests.integration.cluster import Cluster, wait_for
from tests.integration.conftest import one_node_cluster

SLOW = {"name": "sim-slow", "replicas": 1, "profiles": [
    {"engine": "sim", "args": ["--tokens-per-second", "20"]}]}
# An engine whose first token comes 10 s after the request. (The sim has no prefill to
# slow down: its pace is its only delay.) Its stream's head and role chunk come at once.
HESITANT = {"name": "sim-hesitant", "replicas": 1, "profiles": [
    {"engine": "sim", "args": ["--tokens-per-second", "0.1"]}]}


@pytest.fixture
def http_server() -> str:
    """listen.server of the tests' clusters; the gateway's contract tests run under each
    (``@on_every_server``)."""
    return "uvicorn"


on_every_server = pytest.mark.parametrize("http_server", HTTP_SERVERS)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory, request):
    """The module's clusters serving sim-slow, one per HTTP server, each started when a test
    first asks for it and shared by the tests after: each test leaves the engine idle and
    the gateway counting nothing in flight, as it found them."""
    made: dict[str, Cluster] = {}
    with contextlib.ExitStack() as stack:
        def on(server: str) -> Cluster:
            if server not in made:
                made[server] = stack.enter_context(one_node_cluster(
                    tmp_path_factory.mktemp(f"gateway-{server}"), request, [SLOW],
                    {"gateway": {"connect_timeout_s": 2, "first_byte_timeout_s": 2,
                                 "idle_timeout_s": 1}}, http_server=server))
            return made[server]

        yield on


@pytest.fixture
def cluster(clusters, http_server) -> Cluster:
    return clusters(http_server)


@pytest.fixture
def hesitant_cluster(make_cluster, http_server):
    # The gateway's default limits: none of them ends a stream the client still holds,
    # which would free the engine whether or not llmgw saw the client leave.
    c = make_cluster(models=[HESITANT], http_server=http_server)
    c.start_server()
    c.add_agent("node-a")
    c.wait_ready("sim-hesitant")
    return c


def _client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=c.api_key, max_retries=0,
                         timeout=20)


def _engine(c) -> tuple[int, int]:
    """The engine's (pid, port)."""
    [record] = c.agents["node-a"].shard_records()
    return record["pid"], record["port"]


def _engine_in_flight(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/sim/stats", timeout=5).json()["in_flight"]


def _gateway_in_flight(c) -> int:
    """llmgw's own count of requests in flight, over the cluster's replicas (one model)."""
    return sum(r["in_flight"] for r in c.status()["replicas"])


def _gateway_connections_to(c, port: int) -> list:
    """The server process's open TCP connections to ``port`` on loopback."""
    return [conn for conn in psutil.Process(c.server.pid).net_connections(kind="tcp")
            if conn.raddr and conn.raddr.port == port
            and conn.status == psutil.CONN_ESTABLISHED]


@on_every_server
def test_an_endpoint_llmgw_does_not_know_is_forwarded_by_its_model(cluster):
    client = _client(cluster)
    ranked = client.post("/rerank", cast_to=object, body={
        "model": "sim-slow", "query": "red fox",
        "documents": ["a blue whale", "the red fox jumps", "red paint"]})
    assert [r["index"] for r in ranked["results"]] == [1, 2, 0]
    assert ranked["model"] == "sim-slow"

    with pytest.raises(openai.NotFoundError) as missing:
        client.post("/rerank", cast_to=object, body={"model": "sim-slo", "query": "q",
                                                     "documents": ["d"]})
    assert "did you mean sim-slow" in missing.value.message
    # A name the size of a body is refused without a search for close names (which
    # would hold the event loop for seconds) and without being echoed whole.
    with pytest.raises(openai.NotFoundError) as huge:
        client.post("/rerank", cast_to=object, body={"model": "x" * 4_000_000, "query": "q",
                                                     "documents": ["d"]})
    assert "does not exist" in huge.value.message and len(huge.value.message) < 1000
    with pytest.raises(openai.BadRequestError) as no_model:
        client.post("/rerank", cast_to=object, body={"query": "q", "documents": ["d"]})
    assert no_model.value.body["param"] == "model"


def test_an_audio_upload_goes_to_the_model_its_form_names(cluster):
    client = _client(cluster)
    audio = b"RIFF" + bytes(range(256)) * 400
    heard = client.audio.transcriptions.create(model="sim-slow",
                                               file=("hello.wav", audio, "audio/wav"))
    # The engine got the file whole: its size and hash came back.
    assert heard.text == (f"{len(audio)} bytes of hello.wav, sha256 "
                          f"{hashlib.sha256(audio).hexdigest()[:12]}")

    with pytest.raises(openai.NotFoundError) as missing:
        client.audio.transcriptions.create(model="sim-slo", file=("a.wav", b"x", "audio/wav"))
    assert "did you mean sim-slow" in missing.value.message
    url = f"{cluster.base_url}/v1/audio/transcriptions"
    auth = {"authorization": f"Bearer {cluster.api_key}"}
    no_model = httpx.post(url, headers=auth, files={"file": ("a.wav", b"x")})
    assert no_model.status_code == 400, no_model.text
    assert no_model.json()["error"]["param"] == "model"
    broken = httpx.post(url, content=b"--xyz\r\nno end", headers={
        **auth, "content-type": "multipart/form-data; boundary=xyz"})
    assert broken.status_code == 400, broken.text
    assert broken.json()["error"]["code"] == "invalid_body"
    assert "not valid" in broken.json()["error"]["message"]


@on_every_server
def test_a_client_leaving_mid_stream_frees_the_engine_within_a_second(cluster):
    _, port = _engine(cluster)
    with httpx.stream("POST", f"{cluster.base_url}/v1/chat/completions", timeout=10,
                      headers={"authorization": f"Bearer {cluster.api_key}"},
                      json={"model": "sim-slow", "stream": True, "max_tokens": 200,
                            "messages": [{"role": "user", "content": "talk"}]}) as reply:
        chunks = reply.iter_bytes()
        assert next(chunks)
        assert _engine_in_flight(port) == 1
    left = time.monotonic()
    wait_for(lambda: _engine_in_flight(port) == 0, 1.0, "the engine's request to end")
    assert time.monotonic() - left <= 1.0
    wait_for(lambda: _gateway_in_flight(cluster) == 0, 1.0, "the gateway's count to drop")


@on_every_server
def test_a_client_leaving_before_the_first_token_frees_the_engine(cluster):
    _, port = _engine(cluster)
    body = json.dumps({"model": "sim-slow", "max_tokens": 200,
                       "messages": [{"role": "user", "content": "talk"}]}).encode()
    # 200 tokens at 20/s: the answer would take 10 s. A raw socket, so that the client
    # leaves exactly when the test says: once the engine has the request, not before.
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                     b"authorization: Bearer " + cluster.api_key.encode() + b"\r\n"
                     b"content-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: _engine_in_flight(port) == 1, 5, "the engine to take the request")
    wait_for(lambda: _engine_in_flight(port) == 0, 1.0, "the engine's request to end")
    wait_for(lambda: _gateway_in_flight(cluster) == 0, 1.0, "the gateway's count to drop")


def _leave_a_stream_before_its_first_token(c, port: int) -> None:
    """Ask the hesitant engine for a stream, hold it until the engine and llmgw both
    count it, then close it having read nothing of its body."""
    asked = time.monotonic()
    stream = _client(c).chat.completions.create(
        model="sim-hesitant", stream=True, max_tokens=200,
        messages=[{"role": "user", "content": "talk"}])
    try:
        wait_for(lambda: _engine_in_flight(port) == 1, 5, "the engine to take the request")
        wait_for(lambda: _gateway_in_flight(c) == 1, 5, "llmgw to count the request")
    finally:
        stream.close()
    # Its first token was still to come: the client left before it.
    assert time.monotonic() - asked < 10


@on_every_server
def test_a_client_leaving_a_stream_before_its_first_token_frees_the_engine_within_a_second(
        hesitant_cluster):
    c = hesitant_cluster
    _, port = _engine(c)
    # First with a key the server has not read yet (the request's task path) ...
    _leave_a_stream_before_its_first_token(c, port)
    wait_for(lambda: _engine_in_flight(port) == 0, 1.0, "the engine's request to end")
    wait_for(lambda: _gateway_in_flight(c) == 0, 1.0, "the gateway's count to drop")

    # ... then with the key read lately and an idle connection to the engine (an
    # embedding leaves one): the request is one for the server's callback path.
    assert _client(c).embeddings.create(model="sim-hesitant", input="warm").data
    _leave_a_stream_before_its_first_token(c, port)
    wait_for(lambda: _engine_in_flight(port) == 0, 1.0, "the engine's request to end")
    wait_for(lambda: _gateway_in_flight(c) == 0, 1.0, "the gateway's count to drop")


@on_every_server
def test_a_half_open_engine_ends_the_stream_with_an_error_event(cluster):
    pid, port = _engine(cluster)
    client = _client(cluster)
    stream = client.chat.completions.create(
        model="sim-slow", stream=True, max_tokens=200,
        messages=[{"role": "user", "content": "talk"}])
    first = next(iter(stream))
    assert first.choices[0].delta is not None
    assert _gateway_connections_to(cluster, port)  # the stream's, seen where it is
    os.kill(pid, signal.SIGSTOP)  # the engine holds its socket open and says nothing
    try:
        began = time.monotonic()
        with pytest.raises(openai.APIError) as broke:
            for _ in stream:
                pass
        waited = time.monotonic() - began
        assert "sent nothing for 1 s" in str(broke.value)
        assert waited < 5, waited
        wait_for(lambda: _gateway_in_flight(cluster) == 0, 2, "the gateway's count to drop")
        # And its socket to the frozen engine is closed, not kept or put back in the pool.
        wait_for(lambda: not _gateway_connections_to(cluster, port), 2,
                 "the gateway to close its connection to the frozen engine")

        # A non-streamed request to the frozen engine: 504 after the first-byte limit.
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as timed_out:
            client.chat.completions.create(model="sim-slow", max_tokens=5,
                                           messages=[{"role": "user", "content": "hi"}])
        assert timed_out.value.status_code == 504
        assert "sent nothing for 2 s" in timed_out.value.message
        assert 1.5 < time.monotonic() - began < 7
        wait_for(lambda: _gateway_in_flight(cluster) == 0, 2, "the gateway's count to drop")
        wait_for(lambda: not _gateway_connections_to(cluster, port), 2,
                 "the gateway to close its connection to the frozen engine")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: _engine_in_flight(port) == 0, 5, "the thawed engine to be idle")
    # Frozen past the agent's unhealthy_after_s, it may have been reported unhealthy: the
    # module's cluster is left ready, as the next test expects it.
    wait_for(lambda: all(s["state"] == "ready" for r in cluster.replicas("sim-slow")
                         for s in r["shards"]), 10, "the thawed engine's shard to be ready")
