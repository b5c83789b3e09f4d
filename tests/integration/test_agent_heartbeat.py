"""What the agent's heartbeat says of the ports in its range."""

from __future__ import annotations

import socket

from llmgw.agent.agent import Agent
from llmgw.agent.discovery import host
from llmgw.agent.runtime import ShardRecord
from llmgw.config import AgentConfig


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _agent(tmp_path, port: int) -> Agent:
    config = AgentConfig(servers=["http://127.0.0.1:9"], state_dir=str(tmp_path),
                         port_range=(port, port), install_os_packages=False)
    return Agent(config, runtime=None)


def test_a_port_held_by_another_program_is_busy_and_a_shard_s_is_not(tmp_path):
    with _listening() as other:
        port = other.getsockname()[1]
        agent = _agent(tmp_path, port)
        assert agent.heartbeat(agent.supervisor.own_ports()).ports_busy == [port]
        agent.supervisor._stopping_records["u"] = ShardRecord(
            unit="u", replica="m-e1", rank=0, world_size=1, epoch=1, model="m",
            profile="default", engine="sim", port=port)
        assert agent.heartbeat(agent.supervisor.own_ports()).ports_busy == []


def test_a_shard_that_stops_while_the_heartbeat_scans_is_not_reported_busy(
        tmp_path, monkeypatch):
    """The heartbeat runs in a thread while the event loop goes on: a stop that completes
    during its scan of listening sockets must not turn the stopped shard's port into
    somebody else's (the control plane then evicted another replica for room it had)."""
    engine = _listening()
    port = engine.getsockname()[1]
    agent = _agent(tmp_path, port)
    agent.supervisor._stopping_records["u"] = ShardRecord(
        unit="u", replica="m-e1", rank=0, world_size=1, epoch=1, model="m",
        profile="default", engine="sim", port=port)
    scan = host.listening_ports

    def scan_while_the_stop_completes(low: int, high: int) -> set[int]:
        seen = scan(low, high)  # the engine still listens
        engine.close()  # ... then exits, and the loop forgets its record
        del agent.supervisor._stopping_records["u"]
        return seen

    monkeypatch.setattr(host, "listening_ports", scan_while_the_stop_completes)
    own = agent.supervisor.own_ports()  # as the send loop reads it, before the thread
    assert port in own
    assert agent.heartbeat(own).ports_busy == []
