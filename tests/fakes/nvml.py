"""An NVML stand-in for tests: pynvml's function names, return shapes and errors, over GPUs
described as plain dicts, and the named machines the discovery and doctor tests read.

``llmgw.agent.discovery.gpus.discover_gpus`` (and the doctor's and the shard supervisor's
``nvml`` arguments) take it where production passes ``pynvml`` itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import pynvml

_MIB = 2**20


class FakeNvml:
    """NVML-shaped: pynvml's function names, return shapes and ``pynvml.NVMLError``s.

    Each GPU is a dict: ``name``, ``uuid``, ``bus_id``, ``total_mib``, ``free_mib``, ``cc``
    (a (major, minor) pair), ``processes`` (a list of (pid, used MiB or None)) and optional
    ``errors``, a mapping from a function name to the NVML error code it raises for that GPU.
    ``init_error`` is the code ``nvmlInit`` raises (LIBRARY_NOT_FOUND for no library)."""

    def __init__(self, gpus: list[dict], *, driver: str = "580.65.06", cuda: int = 13000,
                 init_error: int | None = None) -> None:
        self.gpus = gpus
        self.driver = driver
        self.cuda = cuda
        self.init_error = init_error
        self.initialised = False

    def _gpu(self, handle: int, function: str) -> dict:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = self.gpus[handle]
        code = gpu.get("errors", {}).get(function)
        if code is not None:
            raise pynvml.NVMLError(code)
        return gpu

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._gpu(index, "nvmlDeviceGetHandleByIndex")
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._gpu(handle, "nvmlDeviceGetName")["name"]

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._gpu(handle, "nvmlDeviceGetUUID")["uuid"]

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        bus_id = self._gpu(handle, "nvmlDeviceGetPciInfo")["bus_id"]
        return SimpleNamespace(busId=bus_id.encode(), busIdLegacy=bus_id[4:].encode())

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        total, free = gpu["total_mib"] * _MIB, gpu["free_mib"] * _MIB
        return SimpleNamespace(total=total, free=free, used=total - free)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return self._gpu(handle, "nvmlDeviceGetCudaComputeCapability")["cc"]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=None if mib is None else mib * _MIB,
                                gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
                for pid, mib in gpu.get("processes", [])]


# PCI buses of a DGX H100's GPUs, listed out of bus order as NVML may enumerate them.
_H100_BUSES = ("9a", "18", "db", "2a", "ba", "3a", "ab", "5d")


def fake_h100_x8() -> FakeNvml:
    """An 8x H100 80GB HBM3 server, idle but for one process on the GPU at bus 18."""
    return FakeNvml([
        {"name": "NVIDIA H100 80GB HBM3",
         "uuid": f"GPU-{bus}0f3c1e-5b7a-4c2d-9e8f-a1b2c3d4e5{bus}",
         "bus_id": f"00000000:{bus.upper()}:00.0", "total_mib": 81559,
         "free_mib": 81004 if bus != "18" else 8912, "cc": (9, 0),
         "processes": [(41233, 72092)] if bus == "18" else []}
        for bus in _H100_BUSES])


def fake_single_4090() -> FakeNvml:
    return FakeNvml([
        {"name": "NVIDIA GeForce RTX 4090", "uuid": "GPU-7d2e9f41-3c8a-b5e6-0f1d-2a4c6e8b0d13",
         "bus_id": "00000000:01:00.0", "total_mib": 24564, "free_mib": 24077, "cc": (8, 9),
         "processes": []}], driver="570.172.08", cuda=12080)


def fake_no_driver() -> FakeNvml:
    """The NVML library is installed (nvidia-ml-py is) but no kernel driver is loaded."""
    return FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


def fake_no_library() -> FakeNvml:
    """No libnvidia-ml.so at all: a CPU-only node."""
    return FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
