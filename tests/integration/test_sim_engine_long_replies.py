"""The sim engine asked for more tokens than it will ever send: it generates them one at a
time as they go out, holds at most ``CONTEXT_TOKENS`` of a reply, and keeps answering its
health check all the while (a health watch would otherwise kill it, and the gateway must
not lose a replica to one request).

The sim as a real process on loopback; its memory read from the kernel (psutil).
"""

from __future__ import annotations

import json
import threading
import urllib.request

import psutil
import pytest

from llmgw.sim.server import CONTEXT_TOKENS
from tests.integration.test_sim_engine import MODEL, Launcher, http, wait_for

HUGE = 10**12
# Far above what the sim holds once started (about 40 MiB), far below what a reply of
# HUGE tokens built in memory reaches within a second.
MAX_RSS = 256 * 2**20
# How long the health check may take while the sim generates.
HEALTH_S = 2.0
CHECKS = 5
MESSAGES = [{"role": "user", "content": "go on"}]


@pytest.fixture
def start_sim(tmp_path_factory):
    launcher = Launcher(tmp_path_factory)
    yield launcher
    launcher.stop_all()


def _healthy_and_small(pid: int, port: int) -> None:
    """The health check answers within HEALTH_S, CHECKS times over, and the process stays
    under MAX_RSS."""
    process = psutil.Process(pid)
    for _ in range(CHECKS):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                    timeout=HEALTH_S) as response:
            assert response.status == 200
        assert process.memory_info().rss < MAX_RSS, process.memory_info()


def _chat(port: int, **extra) -> urllib.request.Request:
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": HUGE, **extra})
    return urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                  data=body.encode(),
                                  headers={"content-type": "application/json"})


def test_a_huge_stream_goes_out_as_it_is_made_and_health_is_answered(start_sim: Launcher):
    sim = start_sim.ready("--tokens-per-second", "0")  # as fast as it can
    stream = urllib.request.urlopen(_chat(sim.port, stream=True), timeout=5)
    try:
        assert stream.status == 200
        for _ in range(3):  # between each look, the engine fills the socket's buffers
            for _ in range(2000):
                line = stream.readline()
                assert line.startswith(b"data: {") or line == b"\n", line
            _healthy_and_small(sim.proc.pid, sim.port)
    finally:
        stream.close()
    wait_for("the stream's end seen by the engine", lambda: http(
        sim.port, "/sim/stats")[1]["in_flight"] == 0)


def test_a_huge_whole_reply_is_paced_and_cut_at_the_context(start_sim: Launcher):
    sim = start_sim.ready("--tokens-per-second", "1000")
    # Paced: generating for CONTEXT_TOKENS / 1000 s, far longer than this client waits.
    gave_up = threading.Event()

    def ask() -> None:
        try:
            urllib.request.urlopen(_chat(sim.port), timeout=1).read()
        except TimeoutError:
            gave_up.set()

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        wait_for("the reply being generated",
                 lambda: http(sim.port, "/sim/stats")[1]["in_flight"] == 1)
        _healthy_and_small(sim.proc.pid, sim.port)
    finally:
        asker.join()
    assert gave_up.is_set()
    wait_for("the engine to stop for the client that left",
             lambda: http(sim.port, "/sim/stats")[1]["in_flight"] == 0)

    # Unpaced: the whole reply, cut at the context like a real engine's.
    fast = start_sim.ready("--tokens-per-second", "0")
    status, reply = http(fast.port, "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": MESSAGES, "max_tokens": HUGE}).encode())
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == CONTEXT_TOKENS
    assert reply["choices"][0]["finish_reason"] == "length"
    assert len(reply["choices"][0]["message"]["content"].split(" ")) == CONTEXT_TOKENS
    _healthy_and_small(fast.proc.pid, fast.port)
