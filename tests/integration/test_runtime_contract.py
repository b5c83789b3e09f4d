"""One contract, every runtime: the same tests against plain processes and systemd units.

Each test starts real, short-lived engine processes (a few lines of Python) through the
runtime, as the shard supervisor does, and checks what the supervisor relies on. The
systemd runtime talks to a real systemd user manager (tests/systemd_manager.py); where
none can run the systemd half is skipped, or fails under CI=true.

Where the runtimes differ, the test says so:
- a runtime instance that did not start the shard (a restarted agent) learns the exit
  code from systemd; the process runtime cannot, and reports None.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import psutil
import pytest

from llmgw.agent.runtime import ProcessRuntime, ShardRecord
from llmgw.agent.runtime.base import Runtime, ShardStartError
from llmgw.agent.runtime.systemd import SystemdRuntime

DEADLINE_S = 10.0
GPU_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"}

# A stand-in engine: says what it sees, then serves (sleeps) or exits with a code.
# "serve": runs until stopped; "stubborn": also ignores SIGTERM; "workers": starts a
# helper process first (as vLLM starts its workers) and prints its pid; N: exits with N.
ENGINE = r"""
import os, signal, subprocess, sys, time
print("engine up", flush=True)
for key in ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES"):
    print(f"{key}={os.environ.get(key)}", flush=True)
mode = sys.argv[1]
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "workers":
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(f"worker {worker.pid}", flush=True)
if mode in ("serve", "stubborn", "workers"):
    time.sleep(60)
    sys.exit(0)
for i in range(30):
    print(f"line {i}", flush=True)
print("last line", flush=True)
sys.exit(int(mode))
"""


def record(unit: str, **fields) -> ShardRecord:
    return ShardRecord(**{
        "unit": unit, "replica": "org-model-e7", "rank": 0, "world_size": 1, "epoch": 7,
        "model": "org/model", "profile": "default", "engine": "sim", "port": 8123,
        "health_path": "/health", **fields})


async def until(what: str, check: Callable[[], bool | Awaitable[bool]],
                deadline_s: float = DEADLINE_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {deadline_s:g} s waiting for {what}")
        await asyncio.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


class Harness:
    """Makes runtime instances over one state directory (a new instance is a restarted
    agent) and stops everything started, by unit and then by PID, whatever happened."""

    def __init__(self, kind: str, state_dir: Path, address: str | None):
        self.kind = kind
        self.state_dir = state_dir
        self.address = address
        self.made: list[Runtime] = []
        self.units: set[str] = set()
        self.pids: set[int] = set()

    def new(self) -> Runtime:
        runtime = (ProcessRuntime(self.state_dir) if self.kind == "process"
                   else SystemdRuntime(self.address, self.state_dir, stop_timeout_s=5))
        self.made.append(runtime)
        return runtime

    async def start(self, runtime: Runtime, unit: str, mode: str,
                    env: dict[str, str] | None = None) -> ShardRecord:
        self.units.add(unit)
        started = await runtime.start(record(unit), (sys.executable, "-c", ENGINE, mode),
                                      GPU_ENV if env is None else env)
        self.pids.add(started.pid)
        return started

    async def close(self) -> None:
        runtime = self.new()
        for unit in sorted(self.units):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runtime.stop(unit, 2.0), 15)
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        for made in self.made:
            if isinstance(made, SystemdRuntime):
                await made.close()


@pytest.fixture(params=["process", "systemd"])
def backend(request) -> tuple[str, str | None]:
    if request.param == "process":
        return "process", None
    return "systemd", request.getfixturevalue("systemd_manager").address


@pytest.fixture
async def harness(backend, tmp_path) -> AsyncIterator[Harness]:
    kind, address = backend
    made = Harness(kind, tmp_path / "state", address)
    try:
        yield made
    finally:
        await made.close()


async def test_start_gives_a_live_pid_with_the_placement_environment(harness):
    runtime = harness.new()
    shard = await harness.start(runtime, "llmgw-shard-org-model-e7-0", "serve")
    assert shard.pid > 0 and alive(shard.pid)
    assert abs(shard.started_at - psutil.Process(shard.pid).create_time()) < 1.0
    env = environ(shard.pid)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    # Its own session: a signal to the agent's process group never reaches it.
    assert os.getsid(shard.pid) == shard.pid
    assert os.getpgid(shard.pid) != os.getpgid(0)
    (listed,) = await runtime.running()
    assert (listed.unit, listed.pid, listed.started_at) == (shard.unit, shard.pid,
                                                            shard.started_at)


async def test_a_restarted_agent_finds_the_shard_as_it_was(harness):
    shard = await harness.start(harness.new(), "llmgw-shard-org-model-e7-0", "serve")
    (found,) = await harness.new().running()
    assert found == shard  # every field: pid, start time, model, epoch, port, ...


async def test_stop_ends_the_shard_and_its_workers(harness):
    runtime = harness.new()
    shard = await harness.start(runtime, "llmgw-shard-org-model-e7-0", "workers")
    await until("the worker's pid", lambda: any(
        line.startswith("worker ") for line in runtime.output_tail(shard.unit)))
    worker = int(next(line.split()[1] for line in runtime.output_tail(shard.unit)
                      if line.startswith("worker ")))
    harness.pids.add(worker)
    assert alive(worker)
    await runtime.stop(shard.unit)
    assert not alive(shard.pid)
    await until("the worker to die with its engine", lambda: not alive(worker), 5.0)
    assert await runtime.running() == []
    assert await harness.new().running() == []


async def test_stop_kills_an_engine_that_ignores_sigterm(harness):
    runtime = harness.new()
    shard = await harness.start(runtime, "llmgw-shard-org-model-e7-0", "stubborn")
    await until("the engine to ignore SIGTERM",
                lambda: "engine up" in runtime.output_tail(shard.unit))
    await asyncio.wait_for(runtime.stop(shard.unit, timeout_s=0.5), DEADLINE_S)
    assert not alive(shard.pid)
    assert await runtime.running() == []


@pytest.mark.parametrize(("mode", "code"), [("0", 0), ("3", 3), ("serve", -signal.SIGKILL)])
async def test_wait_exit_gives_the_exit_code(harness, mode, code):
    runtime = harness.new()
    shard = await harness.start(runtime, "llmgw-shard-org-model-e7-0", mode)
    if mode == "serve":
        os.kill(shard.pid, signal.SIGKILL)
    assert await asyncio.wait_for(runtime.wait_exit(shard.unit), DEADLINE_S) == code
    assert await runtime.running() == []


async def test_output_tail_has_the_engines_last_lines(harness):
    runtime = harness.new()
    shard = await harness.start(runtime, "llmgw-shard-org-model-e7-0", "3")
    await asyncio.wait_for(runtime.wait_exit(shard.unit), DEADLINE_S)
    assert runtime.output_tail(shard.unit, 3) == ["line 28", "line 29", "last line"]
    assert runtime.output_tail(shard.unit)[-1] == "last line"
    assert len(runtime.output_tail(shard.unit)) == 20
    assert runtime.output_tail("llmgw-shard-never-started-0") == []


async def test_a_missing_binary_is_refused_with_words(harness, tmp_path):
    runtime = harness.new()
    missing = str(tmp_path / "no-such-engine")
    with pytest.raises(ShardStartError, match=f"cannot run {missing}: No such file"):
        await runtime.start(record("llmgw-shard-org-model-e7-0"), (missing, "--serve"),
                            GPU_ENV)
    assert await runtime.running() == []


async def test_a_file_that_cannot_be_executed_is_refused_with_words(harness, tmp_path):
    runtime = harness.new()
    garbage = tmp_path / "engine"
    garbage.write_bytes(b"\x00\x01not a program\n")
    garbage.chmod(0o755)
    with pytest.raises(ShardStartError, match=f"cannot run {garbage}"):
        await runtime.start(record("llmgw-shard-org-model-e7-0"), (str(garbage),), GPU_ENV)
    assert await runtime.running() == []
    # The name is free again: a fixed engine starts under it.
    shard = await harness.start(runtime, "llmgw-shard-org-model-e7-0", "serve")
    assert alive(shard.pid)


async def test_starting_a_running_unit_again_is_refused(harness):
    runtime = harness.new()
    first = await harness.start(runtime, "llmgw-shard-org-model-e7-0", "serve")
    with pytest.raises(ShardStartError, match="already"):
        await harness.start(runtime, "llmgw-shard-org-model-e7-0", "serve")
    assert alive(first.pid)
    (listed,) = await runtime.running()
    assert listed.pid == first.pid
