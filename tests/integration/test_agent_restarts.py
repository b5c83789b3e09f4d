"""Engines keep serving while their agent crashes and comes back, on systemd units.

A real agent runs a sim engine as a transient unit of a systemd manager the tests run;
it is killed with SIGKILL ten times and started again each time. The engine's PID never
changes, and a chat request through the gateway is answered after every restart (and
while the agent is down). The same with plain processes, under load, is
tests/chaos/test_agent_kills.py.
"""

from __future__ import annotations

import asyncio

import openai

from llmgw.agent.runtime import SystemdRuntime
from tests.integration.cluster import wait_for


def test_ten_agent_crashes_leave_the_engine_serving(make_cluster, systemd_manager):
    c = make_cluster()
    c.start_server()
    agent = c.add_agent("node-a", runtime="systemd", systemd_bus=systemd_manager.address)
    [replica] = c.wait_ready("sim-small")
    assert "runtime: systemd transient units" in agent.log.read_text()
    client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=c.api_key, max_retries=0,
                           timeout=10)

    def engine_pid() -> int:
        # What a restarted agent would find: the runtime's own listing.
        lister = SystemdRuntime(systemd_manager.address, agent.state_dir)
        [record] = asyncio.run(lister.running())
        assert record.replica == replica["id"]
        return record.pid

    first = engine_pid()
    for round_ in range(10):
        agent.kill()
        # The agent is gone; its engine is not.
        reply = client.chat.completions.create(
            model="sim-small", messages=[{"role": "user", "content": f"round {round_}"}])
        assert reply.choices[0].message.content
        agent.start()
        wait_for(lambda n=round_ + 2: agent.log.read_text().count("registered with") == n, 15,
                 f"the agent to register again (round {round_})")
        wait_for(lambda: c.ready_replicas("sim-small"), 15, "the replica to be ready")
        assert c.ready_replicas("sim-small")[0]["id"] == replica["id"]
        assert engine_pid() == first
    assert "adopting" in agent.log.read_text()
