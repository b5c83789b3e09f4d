"""The sim engine as a real process on loopback, spoken to by the official openai client.

Every process is started in its own session and stopped by PID in a finalizer; waits are
polls against a deadline, never sleeps that hope.
"""

from __future__ import annotations

import json
import math
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from llmgw.sim.rendezvous import Hello, parse_address, refusal
from llmgw.sim.server import VOCABULARY

MODEL = "sim-small"
START_DEADLINE_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(port: int, path: str, body: bytes | None = None) -> tuple[int, Any]:
    """GET (or POST when body is given) and decode JSON; (0, None) when nothing listens."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)
    except (ConnectionError, urllib.error.URLError):
        return 0, None


def wait_for(what: str, check: Callable[[], bool], deadline_s: float = START_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Sim:
    proc: subprocess.Popen[bytes]
    port: int | None
    logs: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="sim",
                             max_retries=0, timeout=10)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="sim",
                                  max_retries=0, timeout=10)

    def output(self) -> str:
        return (self.logs / "stdout").read_text() + (self.logs / "stderr").read_text()

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after a deadline; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Launcher:
    """Starts `python -m llmgw.sim` with extra args and remembers what it started."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self.tmp = tmp
        self.started: list[Sim] = []

    def __call__(self, *args: str, port: int | None = None) -> Sim:
        logs = self.tmp.mktemp("sim")
        argv = [sys.executable, "-m", "llmgw.sim", "--model", MODEL, *args]
        if port is not None:
            argv += ["--port", str(port)]
        with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True)
        self.started.append(Sim(proc, port, logs))
        return self.started[-1]

    def ready(self, *args: str) -> Sim:
        sim = self(*args, port=free_port())
        wait_for("/health 200", lambda: http(sim.port, "/health")[0] == 200)
        return sim

    def stop_all(self) -> None:
        for sim in self.started:
            sim.stop()


@pytest.fixture
def start_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path_factory)
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """One ready single-node engine shared by the tests that only talk to it."""
    launcher = Launcher(tmp_path_factory)
    yield launcher.ready("--tokens-per-second", "0")
    launcher.stop_all()


def test_prints_serving_line(sim: Sim) -> None:
    assert f"sim: serving {MODEL} on 127.0.0.1:{sim.port}" in sim.output()
    status, models = http(sim.port, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]


def test_chat_is_deterministic_and_streams_the_same_text(sim: Sim) -> None:
    client = sim.client()
    messages = [{"role": "user", "content": "tell me about the cluster"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    text = reply.choices[0].message.content
    assert len(text.split()) == 8 and set(text.split()) <= set(VOCABULARY)
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (5, 8)
    assert reply.usage.total_tokens == 13

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"

    other = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "something else"}], max_tokens=8)
    assert other.choices[0].message.content != text


def test_chat_without_max_tokens_stops_after_16(sim: Sim) -> None:
    reply = sim.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.completion_tokens == 16
    assert len(reply.choices[0].message.content.split()) == 16
    assert reply.choices[0].finish_reason == "stop"


async def test_completions_and_streamed_completions_with_usage(sim: Sim) -> None:
    client = sim.async_client()
    reply = await client.completions.create(model=MODEL, prompt="one two three", max_tokens=5)
    assert len(reply.choices[0].text.split()) == 5
    assert reply.usage.prompt_tokens == 3 and reply.usage.completion_tokens == 5

    stream = await client.completions.create(
        model=MODEL, prompt="one two three", max_tokens=5, stream=True,
        stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 8
    await client.close()


def test_embeddings_are_deterministic_unit_vectors(sim: Sim) -> None:
    client = sim.client()
    as_base64 = client.embeddings.create(model=MODEL, input=["alpha beta", "gamma"])
    as_float = client.embeddings.create(model=MODEL, input="alpha beta", encoding_format="float")
    first, second = (d.embedding for d in as_base64.data)
    assert len(first) == 16 and math.isclose(math.fsum(x * x for x in first), 1, rel_tol=1e-5)
    assert first != second
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in
               zip(first, as_float.data[0].embedding, strict=True))
    assert as_base64.usage.prompt_tokens == 3


def test_unknown_model_is_a_404_envelope(sim: Sim) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        sim.client().chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}])
    error = caught.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "model"
    assert error["code"] == "model_not_found" and "nope" in error["message"]


def test_malformed_requests_are_400_envelopes(sim: Sim) -> None:
    status, body = http(sim.port, "/v1/chat/completions", b"{not json")
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"

    status, body = http(sim.port, "/v1/chat/completions", b'{"model": "sim-small"}')
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = http(sim.port, "/v1/completions", b'{"max_tokens": 3}')
    assert status == 400 and body["error"]["param"] == "prompt"


async def test_in_flight_drops_when_a_client_leaves_mid_stream(start_sim: Launcher) -> None:
    slow = start_sim.ready("--tokens-per-second", "5")
    client = slow.async_client()
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "slowly"}], max_tokens=50,
        stream=True)
    received = [await anext(stream), await anext(stream)]  # role chunk, then one token
    assert received[1].choices[0].delta.content
    assert http(slow.port, "/sim/stats")[1]["in_flight"] == 1
    await stream.close()
    wait_for("in_flight back to 0", lambda: http(slow.port, "/sim/stats")[1]["in_flight"] == 0,
             deadline_s=1.0)
    assert http(slow.port, "/sim/stats")[1]["requests_total"] == 1
    await client.close()


def test_sigterm_exits_zero_quickly_even_mid_stream(start_sim: Launcher) -> None:
    sim = start_sim.ready("--tokens-per-second", "5")
    stream = sim.client().completions.create(model=MODEL, prompt="x", max_tokens=50,
                                             stream=True)
    next(iter(stream))
    began = time.monotonic()
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.proc.wait(timeout=3) == 0
    assert time.monotonic() - began < 1.5


@pytest.mark.parametrize("args", [
    ["--port", "1", "--world-size", "2"],  # no rendezvous address
    ["--port", "1", "--rank", "2", "--world-size", "2", "--rendezvous", "127.0.0.1:1"],
    ["--tokens-per-second", "5"],  # rank 0 without a port
    ["--port", "1", "--world-size", "2", "--rendezvous", "nohostport"],
])
def test_bad_arguments_exit_2(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "llmgw.sim", "--model", MODEL, *args],
                          capture_output=True, timeout=10)
    assert done.returncode == 2 and b"error" in done.stderr


def test_refusal_reasons() -> None:
    def why(rank: int, world_size: int = 3, model: str = MODEL) -> str | None:
        return refusal(Hello(rank, world_size, model), world_size=3, model=MODEL, joined={1})

    assert why(2) is None
    assert "already joined" in why(1)
    assert "out of range" in why(0) and "out of range" in why(3)
    assert "world size 4" in why(2, world_size=4)
    assert "other" in why(2, model="other")
    assert parse_address("[::1]:7000") == ("::1", 7000)
    with pytest.raises(ValueError):
        parse_address("host:port")


def listening_ports(proc: subprocess.Popen[bytes]) -> list[int]:
    connections = psutil.Process(proc.pid).net_connections(kind="inet")
    return [c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN]


def test_two_rank_group_serves_only_when_complete(start_sim: Launcher) -> None:
    rendezvous = f"127.0.0.1:{free_port()}"
    group = ["--world-size", "2", "--rendezvous", rendezvous]
    leader = start_sim(*group, port=free_port())
    wait_for("leader to answer", lambda: http(leader.port, "/health")[0] == 503)
    health = http(leader.port, "/health")[1]
    assert (health["joined"], health["world_size"], health["missing_ranks"]) == (1, 2, [1])
    with pytest.raises(openai.APIStatusError) as caught:
        leader.client().completions.create(model=MODEL, prompt="early")
    assert caught.value.status_code == 503

    worker_port = free_port()
    worker = start_sim("--rank", "1", *group, port=worker_port)
    wait_for("group complete", lambda: http(leader.port, "/health")[0] == 200)
    reply = leader.client().completions.create(model=MODEL, prompt="now", max_tokens=3)
    assert len(reply.choices[0].text.split()) == 3
    assert listening_ports(worker.proc) == []
    assert http(worker_port, "/health") == (0, None)

    worker.proc.kill()
    wait_for("leader not ready", lambda: http(leader.port, "/health")[0] == 503)
    assert http(leader.port, "/health")[1]["missing_ranks"] == [1]


def test_worker_waits_for_leader_is_refused_when_duplicate_and_dies_with_leader(
        start_sim: Launcher) -> None:
    rendezvous = f"127.0.0.1:{free_port()}"
    group = ["--world-size", "2", "--rendezvous", rendezvous]
    worker = start_sim("--rank", "1", *group)  # before its leader: it must keep retrying
    leader = start_sim(*group, port=free_port())
    wait_for("group complete", lambda: http(leader.port, "/health")[0] == 200)
    assert "joined the leader" in worker.output()

    duplicate = start_sim("--rank", "1", *group)
    assert duplicate.proc.wait(timeout=5) == 1
    assert "rank 1 has already joined" in duplicate.output()

    assert leader.stop() == 0
    assert worker.proc.wait(timeout=5) == 1
    assert "lost the leader" in worker.output()
