"""A half-upgraded cluster, with real processes: an agent of the previous release under this
server, this agent under a server of the previous release (release.py says which commit,
and why), a whole cluster upgraded in place, servers first, and a peer speaking the frozen
protocol 1 (wire_v1.py) message by message.

In both mixed clusters a sim replica is placed, answers the official openai client, and
stops when the model is scaled to zero: Register, Welcome, InstallEngines, StartShard,
ShardStatus and StopShard all cross the version boundary. Upgraded in place, the engine
the previous release started serves on, adopted first by the new server, then by the new
agent.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import msgspec
import openai

from tests.integration.cluster import AgentProc, Cluster, process_alive, wait_for
from tests.upgrade import release, wire_v1

SIM_SMALL = {"name": "sim-small", "profiles": [{"engine": "sim"}], "replicas": 1}


def chat(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                           max_retries=0, timeout=20)
    reply = client.chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "across versions"}],
        max_tokens=8)
    assert len(reply.choices[0].message.content.split()) == 8
    assert reply.usage.completion_tokens == 8


def serve_then_stop(cluster: Cluster, agent: AgentProc) -> None:
    """The replica is placed and answers; scaled to zero, its engine stops."""
    cluster.wait_ready("sim-small")
    chat(cluster)
    [(pid, started_at)] = agent.engine_pids().values()

    scaled = cluster.admin("PATCH", "/api/models/sim-small", json={"replicas": 0})
    assert scaled.status_code == 200, scaled.text
    wait_for(lambda: not process_alive(pid, started_at), 15,
             "the engine to stop on the server's StopShard")
    wait_for(lambda: not cluster.replicas("sim-small"), 15, "the replica to be gone")


def test_an_agent_of_the_previous_release_serves_under_this_server(make_cluster,
                                                                     previous_release):
    cluster = make_cluster()
    cluster.start_server()
    agent = cluster.add_agent("node-a", prefix=release.prefix(previous_release))
    serve_then_stop(cluster, agent)


def test_this_agent_serves_under_a_server_of_the_previous_release(tmp_path, request,
                                                                    previous_release):
    cluster = release.ReleaseCluster(tmp_path / "old-server", [SIM_SMALL],
                                     tree=previous_release)
    cluster.root.mkdir()
    try:
        cluster.start_server()
        agent = cluster.add_agent("node-a")
        serve_then_stop(cluster, agent)
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()


def test_a_cluster_upgraded_in_place_serves_from_the_same_engine(tmp_path, previous_release):
    cluster = release.ReleaseCluster(tmp_path / "cluster", [SIM_SMALL], tree=previous_release)
    cluster.root.mkdir()
    try:
        cluster.start_server()
        agent = cluster.add_agent("node-a", prefix=release.prefix(previous_release))
        [replica] = cluster.wait_ready("sim-small")
        chat(cluster)
        engine = agent.engine_pids()

        # The server first: same state directory and store, which it migrates.
        cluster.tree = None
        cluster.restart_server()
        wait_for(lambda: agent.log.read_text().count("registered with") == 2, 20,
                 "the agent to register with the new server")
        assert [r["id"] for r in cluster.wait_ready("sim-small")] == [replica["id"]]
        chat(cluster)

        # Then the agent, as its unit would be restarted: SIGTERM leaves its shards running.
        os.kill(agent.proc.pid, signal.SIGTERM)
        assert agent.proc.wait(15) == 0
        agent.prefix = ()
        agent.start()
        wait_for(lambda: "found 1 shard(s) still running" in agent.log.read_text(), 20,
                 "the new agent to find the engine the old one started")
        wait_for(lambda: agent.log.read_text().count("registered with") == 3, 20,
                 "the new agent to register")
        assert [r["id"] for r in cluster.wait_ready("sim-small")] == [replica["id"]]
        chat(cluster)
        assert agent.engine_pids() == engine
        assert all(process_alive(pid, started) for pid, started in engine.values())
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()


class V1Peer:
    """An agent that is nothing but protocol 1's messages, on the plain stream."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.received: list = []

    async def send(self, message) -> None:
        await self.ws.send_bytes(wire_v1.encode(message))

    async def expect(self, kind: type, timeout_s: float = 15):
        """The next message of ``kind`` (every frame on the way must read as protocol 1)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            frame = await self.ws.receive(timeout=left)
            assert frame.type == aiohttp.WSMsgType.BINARY, f"the server closed: {frame}"
            message = wire_v1.decode_down(frame.data)  # WireError fails the test
            self.received.append(message)
            if isinstance(message, kind):
                return message
        raise AssertionError(f"no {kind.__name__} within {timeout_s:g} s; got {self.received}")


def test_every_protocol_1_message_is_handled_by_this_server(make_cluster):
    cluster = make_cluster()
    cluster.start_server()
    inventory = wire_v1.Inventory(
        hostname="node-v1", os="debian 12", cpu_count=4, ram_total_mib=8192,
        ram_available_mib=6144, engines=[wire_v1.Engine(name="sim", version="0.1.0")],
        labels={"release": "1"})

    async def talk() -> tuple[wire_v1.StartShard, wire_v1.CertificateRefused]:
        async with aiohttp.ClientSession() as http, http.ws_connect(
                f"ws://127.0.0.1:{cluster.port}/agent/v1/stream") as ws:
            peer = V1Peer(ws)
            await peer.send(wire_v1.Register(
                node_id="node-v1", address="127.0.0.1", inventory=inventory,
                port_range=(29000, 29009), agent_version="protocol-1 peer",
                installable_engines=[]))
            welcome = await peer.expect(wire_v1.Welcome)
            assert welcome.node_id == "node-v1"
            assert welcome.protocol >= wire_v1.PROTOCOL_VERSION
            await peer.send(wire_v1.Heartbeat(ram_available_mib=5000, sent_at=time.time()))
            await peer.send(wire_v1.InventoryUpdate(inventory=msgspec.structs.replace(
                inventory, labels={"release": "1", "updated": "yes"})))
            start = await peer.expect(wire_v1.StartShard)
            await peer.send(wire_v1.ShardStatus(
                replica=start.replica, rank=start.rank, epoch=start.epoch, state="failed",
                detail="a protocol-1 peer runs no engine", exit_code=3,
                output_tail=["no engine here"]))
            await peer.send(wire_v1.RenewCertificate(csr="not a CSR"))
            refused = await peer.expect(wire_v1.CertificateRefused)
            # Still connected: nothing it sent was taken for a broken peer.
            await peer.send(wire_v1.Heartbeat(ram_available_mib=5000, sent_at=time.time()))
            assert not ws.closed
            return start, refused

    start, refused = asyncio.run(talk())
    assert start.model == "sim-small" and start.profile.engine == "sim"
    assert 29000 <= start.port <= 29009
    assert "mTLS" in refused.reason
    [node] = [n for n in cluster.status()["nodes"] if n["id"] == "node-v1"]
    assert node["labels"] == {"release": "1", "updated": "yes"}
    assert [e["name"] for e in node["engines"]] == ["sim"]
    cluster.server_log_line(start.replica, "a protocol-1 peer runs no engine")
    assert "\nno engine here\n" in (cluster.root / "server.log").read_text()
