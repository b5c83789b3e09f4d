"""`llmgw up`'s first hour: a port already taken is said at once, with what holds it and
what to pass instead, and nothing is left running; the engines' ports can be moved."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from llmgw import config as cfg
from llmgw.cli.up import SIM_MODEL, Demo, UpError, engine_port_range, write_configs
from tests.integration.cluster import free_port_block


def run_up(*args: str, state: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "up", "--engine", "sim", "--state-dir", str(state),
         *args],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def started_from(state: Path) -> list[psutil.Process]:
    """Processes whose command line names the state directory: a server or an agent."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(state) in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def test_a_taken_port_is_said_with_its_holder_and_what_to_pass(tmp_path):
    state = tmp_path / "state"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        began = time.monotonic()
        done = run_up("--port", str(port), state=state)
        took = time.monotonic() - began
        out = " ".join(done.stderr.split())  # rich may wrap on a narrow terminal
        print(out, f"\nFIGURE refused in {took:.1f} s")
        assert done.returncode == 1
        # This test's own process holds it: the OS says so, and `up` names it.
        assert f"port {port} is taken by pid {os.getpid()} (" in out
        assert "exited with code" not in out
        # What to pass instead: a port that is free indeed.
        suggested = int(out.split("give the API another port: --port ")[1].split()[0])
        assert suggested != port
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", suggested))
    # Nothing was started: no server, no agent, not even their logs.
    assert not (state / "logs").exists()
    assert started_from(state) == []


def test_a_port_range_it_cannot_read_is_refused_in_words(tmp_path):
    for bad in ("30999-30000", "30000", "0-10", "30000-70000", "a-b"):
        with pytest.raises(UpError) as caught:
            engine_port_range(bad)
        assert str(caught.value) == (
            f"--port-range {bad}: write LOW-HIGH, two ports from 1 to 65535, the lower "
            "first (for example --port-range 30000-30999)")
    assert engine_port_range(" 30000 - 30009 ") == (30000, 30009)
    # From the command line: refused before anything is written or started.
    done = run_up("--port-range", "30999-30000", state=tmp_path / "state")
    assert done.returncode == 2
    assert "--port-range 30999-30000: write LOW-HIGH" in " ".join(done.stderr.split())
    assert not (tmp_path / "state").exists()


def test_the_port_range_given_is_the_agents(tmp_path):
    low, high = free_port_block(10)
    demo = Demo(cfg.Model(name=SIM_MODEL, profiles=[cfg.Profile(engine="sim")]), {})
    _, agent_path = write_configs(tmp_path, 8080, demo, (low, high))
    assert cfg.load(agent_path, cfg.AgentConfig).port_range == (low, high)
    # Not given: the agent's own default.
    _, agent_path = write_configs(tmp_path, 8080, demo)
    assert cfg.load(agent_path, cfg.AgentConfig).port_range == cfg.AgentConfig(
        servers=["-"]).port_range
