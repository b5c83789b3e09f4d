"""A GPU shard is ready only when it holds memory on every GPU it was given.

Real engine processes (the sim engine) under the real supervisor and process runtime; only
NVML is faked, NVML-shaped, because there is no GPU here. The fake says a GPU is used by
whichever of this test's processes carry a marker in their command line, the way NVML
lists the PIDs of the processes holding a GPU's memory.
"""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import psutil
import pynvml
import pytest

from llmgw import wire
from llmgw.agent import shards
from llmgw.agent.runtime import ProcessRuntime
from llmgw.agent.shards import ShardSupervisor
from tests.fakes.nvml import FakeNvml
from tests.integration.cluster import free_port


def _pids_running(marker: str) -> list[int]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if marker in p.cmdline():
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


class NvmlWatchingEngines(FakeNvml):
    """GPU i is held by the engines whose argv has one of ``holders[i]``'s markers."""

    def __init__(self, count: int, holders: dict[int, str], no_process_lists=False):
        super().__init__([
            {"name": "NVIDIA L4", "uuid": f"GPU-{i:08d}-aaaa-bbbb-cccc-000000000000",
             "bus_id": f"00000000:{i + 1:02X}:00.0", "total_mib": 23034, "free_mib": 22000,
             "cc": (8, 9)} for i in range(count)])
        self.holders = holders
        self.no_process_lists = no_process_lists

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        if self.no_process_lists:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        marker = self.holders.get(handle)
        pids = _pids_running(marker) if marker else []
        return [SimpleNamespace(pid=pid, usedGpuMemory=1024 * 2**20) for pid in pids]


async def _start_and_wait(tmp_path, nvml, model: str, gpus: list[int]) -> list[wire.ShardStatus]:
    reports: list[wire.ShardStatus] = []
    settled = asyncio.Event()

    def report(status: wire.ShardStatus) -> None:
        reports.append(status)
        if status.state in ("ready", "failed"):
            settled.set()

    runtime = ProcessRuntime(tmp_path / "agent")
    supervisor = ShardSupervisor(runtime, "127.0.0.1", {}, report, nvml=nvml)
    async with supervisor:
        supervisor.start(wire.StartShard(
            replica="m-e1", rank=0, world_size=1, epoch=1, model=model,
            profile=wire.ShardProfile(name="gpu", engine="sim", startup_timeout_s=30),
            port=free_port(), gpus=gpus))
        await asyncio.wait_for(settled.wait(), 30)
        if reports[-1].state == "failed":
            # The supervisor stops a failed shard itself; give it up to 15 s.
            for _ in range(300):
                if not _pids_running(model):
                    break
                await asyncio.sleep(0.05)
        await supervisor.stop_all()
    return reports


@pytest.fixture(autouse=True)
def quick_settle(monkeypatch):
    monkeypatch.setattr(shards, "_GPU_SETTLE_S", 0.5)


async def test_an_engine_on_both_of_its_gpus_is_ready(tmp_path):
    model = f"on-gpu-{uuid.uuid4().hex[:8]}"
    nvml = NvmlWatchingEngines(2, {0: model, 1: model})

    reports = await _start_and_wait(tmp_path, nvml, model, [0, 1])

    assert [r.state for r in reports][-1] == "ready", reports
    assert not _pids_running(model)


async def test_an_engine_that_answers_but_left_a_gpu_untouched_fails_and_is_stopped(tmp_path):
    model = f"cpu-fallback-{uuid.uuid4().hex[:8]}"
    # Like llama.cpp whose CUDA backend did not load: healthy, but on the CPU for GPU 1.
    nvml = NvmlWatchingEngines(2, {0: model})

    reports = await _start_and_wait(tmp_path, nvml, model, [0, 1])

    failed = reports[-1]
    assert failed.state == "failed" and "ready" not in [r.state for r in reports]
    assert "holds no memory on GPU 1 (of 0, 1)" in failed.detail
    assert "running on the CPU" in failed.detail
    assert not _pids_running(model)


async def test_where_nvml_cannot_list_processes_nothing_is_guessed(tmp_path):
    model = f"no-lists-{uuid.uuid4().hex[:8]}"
    nvml = NvmlWatchingEngines(1, {}, no_process_lists=True)

    reports = await _start_and_wait(tmp_path, nvml, model, [0])

    assert reports[-1].state == "ready", reports


async def test_a_cpu_shard_is_not_asked_about_gpus(tmp_path):
    model = f"cpu-{uuid.uuid4().hex[:8]}"
    nvml = NvmlWatchingEngines(1, {})  # would say nobody holds GPU 0

    reports = await _start_and_wait(tmp_path, nvml, model, [])

    assert reports[-1].state == "ready", reports
