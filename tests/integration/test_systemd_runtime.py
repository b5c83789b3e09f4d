"""What only the systemd runtime does: the unit it makes, adoption across agent restarts
with the exit status kept, and the manager's address in the operator's words.

Against a real systemd user manager (tests/systemd_manager.py): skipped where none can run,
failed under CI=true. The contract both runtimes keep is in test_runtime_contract.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource as rlimit
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from dbus_fast import Variant

from llmgw import wire
from llmgw.agent.runtime.base import ShardStartError
from llmgw.agent.runtime.systemd import SystemdRuntime
from llmgw.agent.runtime.systemd_bus import available, call, connect, unit_path
from llmgw.agent.shards import ShardSupervisor
from tests.integration.test_runtime_contract import (
    DEADLINE_S,
    ENGINE,
    GPU_ENV,
    Harness,
    alive,
    record,
    until,
)

UNIT = "llmgw-shard-org-model-e7-0"


@pytest.fixture
def manager(systemd_manager):
    return systemd_manager


@pytest.fixture
async def harness(manager, tmp_path) -> AsyncIterator[Harness]:
    made = Harness("systemd", tmp_path / "state", manager.address)
    try:
        yield made
    finally:
        await made.close()


async def unit_properties(address: str, name: str, interface: str) -> dict:
    """Read a unit's properties on a connection of the test's own."""
    bus = await connect(address)
    try:
        (props,) = await call(bus, "GetAll", "s", [interface], path=unit_path(name),
                              interface="org.freedesktop.DBus.Properties")
    finally:
        bus.disconnect()
    return {k: v.value for k, v in props.items()}


def granted(requested: int, resource: int) -> str:
    """The limit a unit asking for ``requested`` gets here, as /proc/PID/limits shows it:
    systemd gives what it asked for where it may raise limits (CAP_SYS_RESOURCE, as PID 1
    has on a real node), else the closest the hard limit allows."""
    status = Path("/proc/self/status").read_text()
    effective = int(next(line.split()[1] for line in status.splitlines()
                         if line.startswith("CapEff:")), 16)
    if not effective & (1 << 24):  # CAP_SYS_RESOURCE
        hard = rlimit.getrlimit(resource)[1]
        requested = requested if hard == rlimit.RLIM_INFINITY else min(requested, hard)
    return "unlimited" if requested >= 2**63 - 1 else str(requested)


def limits(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]
    return {line[:26].strip(): line[26:47].strip() for line in lines}


def cgroup_of(pid: int | str) -> str:
    text = Path(f"/proc/{pid}/cgroup").read_text()
    return next(line[3:] for line in text.splitlines() if line.startswith("0::"))


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status
    except OSError:
        return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_the_unit_is_described_and_limited(harness, manager, tmp_path):
    runtime = harness.new()
    shard = await harness.start(runtime, UNIT, "serve")
    name = f"{UNIT}.service"
    unit = await unit_properties(manager.address, name, "org.freedesktop.systemd1.Unit")
    service = await unit_properties(manager.address, name,
                                    "org.freedesktop.systemd1.Service")
    assert unit["Description"] == "llmgw shard: org/model replica org-model-e7 rank 0 (sim)"
    assert {"CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_VISIBLE_DEVICES=2,3"} <= set(
        service["Environment"])
    assert any(e.startswith("LLMGW_SHARD={") for e in service["Environment"])
    assert service["Type"] == "exec"
    assert service["Restart"] == "no"
    assert service["RemainAfterExit"] is True
    assert service["KillMode"] == "control-group"
    assert service["SendSIGKILL"] is True
    assert service["TimeoutStopUSec"] == 5_000_000
    assert service["LimitMEMLOCK"] == service["LimitMEMLOCKSoft"] == 2**64 - 1
    assert service["LimitNOFILE"] == 1048576
    assert service["TasksMax"] == 2**64 - 1
    assert service["OOMPolicy"] == "stop"
    assert service["StandardOutput"] == service["StandardError"] == "append"
    work_dir = harness.state_dir / "shards" / UNIT
    assert service["WorkingDirectory"] == str(work_dir)
    assert service["MainPID"] == shard.pid
    # What the engine itself gets.
    assert Path(f"/proc/{shard.pid}/cwd").resolve() == work_dir.resolve()
    assert limits(shard.pid)["Max locked memory"] == granted(2**64 - 1, rlimit.RLIMIT_MEMLOCK)
    assert limits(shard.pid)["Max open files"] == granted(1048576, rlimit.RLIMIT_NOFILE)


async def test_the_shard_runs_in_its_units_own_cgroup(harness, manager):
    shard = await harness.start(harness.new(), UNIT, "serve")
    assert cgroup_of(shard.pid).endswith(f"/{UNIT}.service")
    assert cgroup_of(shard.pid).startswith(f"/{manager.name}/")
    assert cgroup_of(shard.pid) != cgroup_of("self")


async def test_ten_agent_restarts_leave_the_engine_serving(harness):
    port = free_port()
    first = harness.new()
    argv = (sys.executable, "-m", "llmgw.sim", "--model", "org/model", "--host", "127.0.0.1",
            "--port", str(port))
    harness.units.add(UNIT)
    shard = await first.start(record(UNIT, port=port), argv, GPU_ENV)
    harness.pids.add(shard.pid)
    await until("the engine's /health", lambda: health(port) == 200)
    await first.close()
    for _ in range(10):
        agent = SystemdRuntime(harness.address, harness.state_dir)
        try:
            (found,) = await agent.running()
        finally:
            await agent.close()
        assert (found.pid, found.started_at, found.port) == (shard.pid, shard.started_at, port)
        assert health(port) == 200
    assert alive(shard.pid)


async def test_a_restarted_agent_learns_how_the_shard_exited(harness):
    # Killed while the new agent watches it:
    shard = await harness.start(harness.new(), UNIT, "serve")
    await harness.made[-1].close()
    adopter = harness.new()
    (found,) = await adopter.running()
    waiting = asyncio.create_task(adopter.wait_exit(UNIT))
    os.kill(found.pid, signal.SIGKILL)
    assert await asyncio.wait_for(waiting, DEADLINE_S) == -signal.SIGKILL
    await adopter.stop(UNIT)
    # Exited while no agent ran: the next one still reads the code, until it stops it.
    shard = await harness.start(harness.new(), UNIT, "3")
    await until("the engine to exit", lambda: not alive(shard.pid))
    assert await asyncio.wait_for(harness.new().wait_exit(UNIT), DEADLINE_S) == 3
    await harness.new().stop(UNIT)
    assert await harness.new().wait_exit(UNIT) is None  # gone: nothing left to say


async def test_an_exited_unit_found_at_adoption_is_cleared(harness, manager, caplog):
    shard = await harness.start(harness.new(), UNIT, "3")
    await until("the engine to exit", lambda: not alive(shard.pid))
    caplog.set_level(logging.WARNING, "llmgw.agent.runtime.systemd")
    assert await harness.new().running() == []
    assert "has exited with code 3" in caplog.text and "last line" in caplog.text
    assert not (harness.state_dir / "shards" / f"{UNIT}.log").exists()
    # The name is free for the replica's next start.
    again = await harness.start(harness.new(), UNIT, "serve")
    assert alive(again.pid)


async def test_a_unit_without_a_record_is_left_alone(harness, manager, caplog):
    bus = await connect(manager.address)
    foreign = "llmgw-shard-by-hand-0"
    try:
        await call(bus, "StartTransientUnit", "ssa(sv)a(sa(sv))", [
            f"{foreign}.service", "fail",
            [("ExecStart", Variant("a(sasb)", [(sys.executable, [sys.executable, "-c",
                                                "import time; time.sleep(60)"], False)]))],
            []])
        harness.units.add(foreign)
        caplog.set_level(logging.WARNING, "llmgw.agent.runtime.systemd")
        runtime = harness.new()
        await until("the unit to run", lambda: _main_pid(manager.address, foreign))
        assert await runtime.running() == []
        assert f"{foreign}.service" in caplog.text and "leaving it alone" in caplog.text
        assert await _main_pid(manager.address, foreign)  # still running
    finally:
        bus.disconnect()


async def _main_pid(address: str, unit: str) -> int:
    props = await unit_properties(address, f"{unit}.service",
                                  "org.freedesktop.systemd1.Service")
    return props.get("MainPID", 0)


async def test_the_whole_lifecycle_over_the_session_bus(manager, tmp_path):
    """A bus rather than the manager's own socket: Hello, and signals asked for."""
    address = f"unix:path={manager.runtime_dir}/bus"
    assert await available(address) is None
    made = Harness("systemd", tmp_path / "state", address)
    try:
        runtime = made.new()
        shard = await made.start(runtime, UNIT, "serve")
        assert [r.pid for r in await made.new().running()] == [shard.pid]
        waiting = asyncio.create_task(runtime.wait_exit(UNIT))
        os.kill(shard.pid, signal.SIGKILL)
        assert await asyncio.wait_for(waiting, DEADLINE_S) == -signal.SIGKILL
        await runtime.stop(UNIT)
        assert await runtime.running() == []
    finally:
        await made.close()


async def test_available_says_why_not(tmp_path):
    assert await available(f"unix:path={tmp_path}/nothing") == (
        f"cannot reach the systemd manager at unix:path={tmp_path}/nothing: "
        "No such file or directory")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "deaf"))  # a socket nobody listens on
        assert await available(f"unix:path={tmp_path}/deaf") == (
            f"cannot reach the systemd manager at unix:path={tmp_path}/deaf: "
            "Connection refused")
    assert (await available("nonsense")).startswith("cannot reach the systemd manager at "
                                                    "nonsense")


async def test_an_unreachable_manager_is_a_start_error_with_the_way_out(tmp_path):
    address = f"unix:path={tmp_path}/systemd/private"
    runtime = SystemdRuntime(address, tmp_path / "state")
    with pytest.raises(ShardStartError, match=(
            f"cannot reach the systemd manager at {address}: No such file or directory; "
            "set systemd_bus in agent.yaml, or runtime: process")):
        await runtime.start(record(UNIT), (sys.executable, "-c", ENGINE, "serve"), GPU_ENV)


async def test_a_dropped_connection_is_made_again(harness):
    runtime = harness.new()
    shard = await harness.start(runtime, UNIT, "serve")
    waiting = asyncio.create_task(runtime.wait_exit(UNIT))
    await asyncio.sleep(0.05)
    runtime._bus.disconnect()  # as a manager's daemon-reexec drops its private connections
    os.kill(shard.pid, signal.SIGKILL)
    assert await asyncio.wait_for(waiting, DEADLINE_S) == -signal.SIGKILL
    await runtime.stop(UNIT)
    assert await runtime.running() == []


async def test_an_environment_systemd_cannot_hold_is_refused_with_words(harness):
    with pytest.raises(ShardStartError, match="'BAD' cannot be passed to a systemd unit"):
        await harness.start(harness.new(), UNIT, "serve", {**GPU_ENV, "BAD": "two\nlines"})
    assert await harness.new().running() == []


def test_the_manager_leaves_nothing_behind_when_its_user_fails_or_dies(systemd_manager):
    # Imported here: loaded first as a plugin, so that pytest rewrites its asserts.
    from tests.systemd_manager import user_manager

    # Its user dies by SIGKILL, which runs no cleanup at all: the manager still goes.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom tests.systemd_manager import user_manager\n"
         "with user_manager() as m:\n    print(m.pid, m.name, flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        orphan_pid, orphan_name = child.stdout.readline().split()
        # Its user fails: everything is gone when the with-block is left.
        with pytest.raises(RuntimeError, match="a failing test"), user_manager() as failed:
            assert alive(failed.pid)
            raise RuntimeError("a failing test")
        assert not alive(failed.pid)
        assert not failed.cgroup.exists() and not failed.runtime_dir.exists()
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    deadline = time.monotonic() + DEADLINE_S
    while alive(int(orphan_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(int(orphan_pid))
    with user_manager() as manager:  # sweeps what the dead user left
        assert not (manager.cgroup.parent / orphan_name).exists()


async def test_the_supervisor_runs_adopts_and_stops_a_sim_shard_as_a_unit(manager, tmp_path):
    """The shard supervisor, unchanged, over this runtime: it connects on first use."""
    reports: list[wire.ShardStatus] = []
    port = free_port()
    start = wire.StartShard(replica="sim-e1", rank=0, world_size=1, epoch=1, model="sim",
                            profile=wire.ShardProfile(name="cpu", engine="sim",
                                                      startup_timeout_s=20), port=port)
    made = Harness("systemd", tmp_path / "state", manager.address)
    made.units.add("llmgw-shard-sim-e1-0")
    try:
        async with ShardSupervisor(made.new(), "127.0.0.1", {}, reports.append) as first:
            first.start(start)
            await until("ready", lambda: any(r.state in ("ready", "failed") for r in reports),
                        20)
            assert reports[-1].state == "ready", reports
        # The first agent is gone; its shard is not. The next agent adopts it.
        async with ShardSupervisor(made.new(), "127.0.0.1", {}, reports.append) as second:
            assert await second.adopt_running() == 1
            await until("ready again", lambda: second.running()[0].state == "ready")
            assert health(port) == 200
            second.stop(wire.StopShard(replica="sim-e1", rank=0, epoch=1, reason="test"))
            await until("stopped", lambda: reports[-1].state == "stopped")
        assert await made.new().running() == []
        assert health(port) == 0
    finally:
        await made.close()
