"""`llmgw ctl logs` and ``GET /api/replicas/{replica}/logs``: a shard's engine output, asked
of the server, fetched from the node's agent over its stream, with a real server, agent
and sim engine on loopback. One cluster for the module: starting one costs seconds.

The sim engine prints one line when it starts serving and nothing after; where a test
needs output written later, it appends to the engine's log file on the node, as the
engine would write to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest

from llmgw import wire
from llmgw.cli.main import main
from llmgw.server.agents.shard_logs import ShardLogs
from tests.integration.cluster import Cluster, wait_for
from tests.integration.conftest import SIM_SMALL, one_node_cluster
from tests.upgrade import wire_v1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    with one_node_cluster(tmp_path_factory.mktemp("logs"), request, [SIM_SMALL]) as made:
        yield made


# ctl with its own session file and no credentials from the shell (conftest.py).
pytestmark = pytest.mark.usefixtures("ctl_environment")


@dataclass
class Ran:
    code: int
    out: str
    err: str


def ctl(cluster: Cluster, *args: str) -> Ran:
    """``llmgw ctl ARGS`` through its real entry point, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["ctl", *args, "--server", cluster.base_url,
                     "--token", cluster.admin_token])
    return Ran(code, out.getvalue(), err.getvalue())


def ctl_process(cluster: Cluster, *args: str) -> subprocess.Popen:
    """``llmgw ctl ARGS`` as its own process (in its own process group), its stdout and
    stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw", "ctl", *args, "--server", cluster.base_url,
         "--token", cluster.admin_token],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)


class Collected:
    """What a pipe has carried so far, read by a thread as it comes."""

    def __init__(self, pipe) -> None:
        self.data = b""
        self._pipe = pipe
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while piece := os.read(self._pipe.fileno(), 65536):
            self.data += piece

    def wait_for(self, text: str, timeout_s: float = 20) -> None:
        wait_for(lambda: text.encode() in self.data, timeout_s, f"{text!r} on ctl's stdout")


@contextlib.contextmanager
def stopped_at_end(proc: subprocess.Popen):
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def the_replica(cluster: Cluster) -> dict:
    [replica] = cluster.ready_replicas("sim-small")
    return replica


def engine_log(cluster: Cluster, replica: str, rank: int = 0) -> Path:
    return cluster.agents["node-a"].state_dir / "shards" / f"llmgw-shard-{replica}-{rank}.log"


def write_as_the_engine(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def agent_log_count(cluster: Cluster, text: str) -> int:
    return (cluster.root / "agent-node-a.log").read_text(errors="replace").count(text)


def logs_api(cluster: Cluster, replica: str, **params) -> httpx.Response:
    return cluster.admin("GET", f"/api/replicas/{replica}/logs", params=params)


def test_the_tail_is_what_the_engine_printed(cluster):
    replica = the_replica(cluster)
    port = replica["shards"][0]["port"]
    shown = ctl(cluster, "logs", replica["id"])
    assert shown.code == 0, shown.err
    assert f"sim: serving sim-small on 127.0.0.1:{port}\n" in shown.out
    # The whole log, as the node holds it: it is smaller than the default tail.
    assert shown.out == engine_log(cluster, replica["id"]).read_text()

    over_http = logs_api(cluster, replica["id"])
    assert over_http.status_code == 200
    assert over_http.headers["content-type"].startswith("text/plain")
    assert over_http.text == shown.out


def test_a_tail_is_bounded_and_starts_on_a_whole_line(cluster):
    replica = the_replica(cluster)["id"]
    path = engine_log(cluster, replica)
    write_as_the_engine(path, "".join(f"filler line {n:02d}\n" for n in range(40)))

    tail = logs_api(cluster, replica, tail=100)
    assert tail.status_code == 200, tail.text
    assert 0 < len(tail.content) <= 100
    # The last 100 bytes, from the first whole line in them.
    last = path.read_bytes()[-100:]
    assert tail.content == last[last.index(b"\n") + 1:]
    assert tail.text.startswith("filler line ") and tail.text.endswith("filler line 39\n")

    shown = ctl(cluster, "logs", replica, "--tail", "40")
    assert shown.code == 0 and shown.out == "filler line 38\nfiller line 39\n"
    assert ctl(cluster, "logs", replica, "--tail", "0").out == ""

    too_much = ctl(cluster, "logs", replica, "--tail", str(2 * 2**20))
    assert too_much.code == 1
    assert "tail must be 0 to 1048576 bytes (1 MiB), not 2097152" in too_much.err


def test_follow_prints_what_is_written_later_and_ends_on_ctrl_c(cluster):
    replica = the_replica(cluster)["id"]
    ended = f"done with the output of replica {replica} rank 0"
    ended_before = agent_log_count(cluster, ended)
    with stopped_at_end(ctl_process(cluster, "logs", replica, "--follow")) as proc:
        out = Collected(proc.stdout)
        out.wait_for("sim: serving sim-small")
        write_as_the_engine(engine_log(cluster, replica), "written after the request\n")
        out.wait_for("written after the request\n")
        assert agent_log_count(cluster, ended) == ended_before  # still following

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal
        assert proc.wait(20) == 130
        assert proc.stderr.read() == b""  # no traceback
    # The server told the node: it stopped reading the file for this request.
    wait_for(lambda: agent_log_count(cluster, ended) == ended_before + 1, 15,
             "the agent to end the follow once the client left")


def test_a_closed_stdout_ends_follow_quietly(cluster):
    replica = the_replica(cluster)["id"]
    with stopped_at_end(ctl_process(cluster, "logs", replica, "--follow")) as proc:
        first = os.read(proc.stdout.fileno(), 10)  # as `| head -c 10` would
        assert first
        proc.stdout.close()
        write_as_the_engine(engine_log(cluster, replica), "nobody reads this\n")
        assert proc.wait(20) == 141  # as every ctl command a closed pipe ends
        assert proc.stderr.read() == b""


def test_refusals_say_what_to_do(cluster):
    replica = the_replica(cluster)["id"]
    unknown = ctl(cluster, "logs", "no-such-replica")
    assert unknown.code == 1
    assert "no replica 'no-such-replica'; the replicas are: " in unknown.err
    assert replica in unknown.err

    rank = ctl(cluster, "logs", replica, "--rank", "3")
    assert rank.code == 1
    assert f"replica {replica} has no rank 3: its ranks are 0 to 0" in rank.err

    assert ctl(cluster, "logs", replica, "--json").code == 2
    refused = logs_api(cluster, replica, rank=-1)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "rank must be 0 or more, not -1"


def test_an_agent_that_cannot_send_logs_is_not_asked(make_cluster):
    """A protocol-1 agent (an earlier release) skips a message type it does not know, so
    the server would wait on it in vain: it is not asked, and the operator is told why.
    Once it has gone, the operator is told that instead."""
    cluster = make_cluster()
    cluster.start_server()
    inventory = wire_v1.Inventory(hostname="node-v1", cpu_count=4, ram_total_mib=8192,
                                  ram_available_mib=6144,
                                  engines=[wire_v1.Engine(name="sim", version="0.1.0")])

    async def talk() -> tuple[str, list[str], list]:
        received = []
        async with aiohttp.ClientSession() as http, http.ws_connect(
                f"ws://127.0.0.1:{cluster.port}/agent/v1/stream") as ws:
            await ws.send_bytes(wire_v1.encode(wire_v1.Register(
                node_id="node-v1", address="127.0.0.1", inventory=inventory,
                port_range=(29100, 29109), agent_version="0.1.0", installable_engines=[])))
            start = None
            deadline = time.monotonic() + 20
            while start is None:
                frame = await ws.receive(timeout=max(0.1, deadline - time.monotonic()))
                message = wire_v1.decode_down(frame.data)
                received.append(message)
                if isinstance(message, wire_v1.StartShard):
                    start = message
            await ws.send_bytes(wire_v1.encode(wire_v1.ShardStatus(
                replica=start.replica, rank=0, epoch=start.epoch, state="starting")))
            refusals = [await asyncio.to_thread(ctl, cluster, "logs", start.replica)
                        for _ in range(2)]
            # Whatever came meanwhile is protocol 1 (a ShardLogRequest would read as None).
            with contextlib.suppress(TimeoutError):
                while True:
                    frame = await ws.receive(timeout=0.5)
                    received.append(wire_v1.decode_down(frame.data))
            assert not ws.closed
        return start.replica, [r.err for r in refusals if r.code == 1], received

    replica, refusals, received = asyncio.run(talk())
    assert len(refusals) == 2
    for err in refusals:
        assert ("node node-v1's agent (version 0.1.0) is too old to send logs: upgrade it, "
                f"or read shards/llmgw-shard-{replica}-0.log in its state directory") in err
    assert None not in received

    gone = wait_for(lambda: (r := ctl(cluster, "logs", replica)).code == 1
                    and "not connected" in r.err and r.err, 15,
                    "a refusal naming the disconnected node")
    assert f"rank 0 of replica {replica} runs on node node-v1, which is not connected" in gone


async def test_a_slow_reader_is_held_at_most_max_buffered_pieces():
    sent: list[tuple[str, wire.Down]] = []
    logs = ShardLogs(lambda node, message: sent.append((node, message)) or True,
                     max_buffered=3)
    pending = logs.open("node-a", connection=1)
    for n in range(5):  # nobody reads: the fourth piece is one too many
        logs.deliver("node-a", wire.ShardLog(request=pending.request, data=f"piece {n}\n"))
    assert pending.buffered == 3
    assert "read the log more slowly than the node sent it" in pending.ended
    # The node was told to stop, and again for what it had sent before hearing it.
    assert sent == [("node-a", wire.ShardLogCancel(request=pending.request))] * 2
    assert len(logs) == 0
    # The reader gets what was held, then the end.
    assert [await pending.next(1) for _ in range(4)] == ["piece 0\n", "piece 1\n",
                                                         "piece 2\n", None]

    # Another node's answer to it is not taken; a request on a closed stream ends.
    other = logs.open("node-a", connection=2)
    logs.deliver("node-b", wire.ShardLog(request=other.request, data="not yours"))
    assert other.buffered == 0
    logs.node_gone("node-a", connection=1)
    assert other.ended is None
    logs.node_gone("node-a", connection=2)
    assert "node node-a's agent stream closed" in other.ended
    assert await other.next(1) is None

    # A reader that leaves first stops the node; one whose answer ended does not.
    sent.clear()
    left, answered = logs.open("node-a", 3), logs.open("node-a", 3)
    logs.deliver("node-a", wire.ShardLog(request=answered.request, data="all\n", done=True))
    logs.close(left)
    logs.close(answered)
    assert sent == [("node-a", wire.ShardLogCancel(request=left.request))]
    assert await answered.next(1) == "all\n" and answered.ended == ""
    with pytest.raises(TimeoutError):
        await logs.open("node-a", 3).next(0.05)


def test_follow_ends_with_why_when_the_shard_stops(cluster):
    """Last: it stops the module's replica."""
    replica = the_replica(cluster)["id"]
    with httpx.stream("GET", f"{cluster.base_url}/api/replicas/{replica}/logs",
                      params={"follow": "true"}, timeout=20,
                      headers={"authorization": f"Bearer {cluster.admin_token}"}) as resp:
        assert resp.status_code == 200
        pieces = resp.iter_text()
        text = next(pieces)
        assert "sim: serving sim-small" in text
        scaled = cluster.admin("PATCH", "/api/models/sim-small", json={"replicas": 0})
        assert scaled.status_code == 200, scaled.text
        text += "".join(pieces)
    assert text.endswith(f"\n-- llmgw: replica {replica} rank 0 stopped: its output ends "
                         "here --\n")
