"""NVIDIA GPUs, through NVML (``pynvml`` from nvidia-ml-py).

A node without the NVML library or without a loaded driver is a node without NVIDIA GPUs:
the report is empty and ``note`` says why, so the agent still registers and the operator
reads the reason. NVML is reached through an object with pynvml's function names, so the
tests pass an NVML-shaped fake (tests/fakes/nvml.py) instead of a GPU.

GPUs are listed in PCI bus order and indexed 0..n-1 in that order, which is the order
CUDA uses under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (the agent sets that for every engine, so
an index here is an index there). NVML's own enumeration order is not guaranteed to match.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

import pynvml

from llmgw import wire

_MIB = 2**20

_NO_GPU_NOTES = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "no NVML library: no NVIDIA driver on this node",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "NVML found no driver loaded",
}


@dataclass(frozen=True)
class GpuReport:
    """What NVML says about this node. ``compute_capability`` and ``processes`` (the pids
    computing on the GPU) are keyed by GPU uuid, beside ``gpus``, because ``wire.Gpu`` does
    not carry them; a GPU whose value NVML would not give is absent from that mapping."""

    gpus: tuple[wire.Gpu, ...] = ()
    driver: str = ""
    cuda: str = ""  # the CUDA version the driver supports, "13.0"
    note: str = ""  # why there are no GPUs, or which ones could not be read
    compute_capability: dict[str, tuple[int, int]] = field(default_factory=dict)
    processes: dict[str, frozenset[int]] = field(default_factory=dict)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _cuda_version(encoded: int) -> str:
    """NVML encodes CUDA 13.0 as 13000 and 12.8 as 12080."""
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def _optional(call, *args) -> Any:
    try:
        return call(*args)
    except pynvml.NVMLError:
        return None


def preload_nvml(path: str | None) -> bool:
    """Load NVML from ``path`` (agent.yaml ``nvml_library``) before pynvml looks for it by
    name: the dynamic loader then finds it already loaded. On NixOS the driver's libraries
    sit outside the loader's search path, and LD_LIBRARY_PATH would reach the engines too.
    False when there is no such file (a node without the NVIDIA driver)."""
    if not path or not os.path.exists(path):
        return False
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return True


def discover_gpus(nvml: Any = None) -> GpuReport:
    """The NVIDIA GPUs on this node, in PCI bus order. Never raises for a node that has no
    NVIDIA GPUs, driver or library; ``note`` says what was missing."""
    nvml = pynvml if nvml is None else nvml
    try:
        nvml.nvmlInit()
    except pynvml.NVMLError as err:
        return GpuReport(note=_NO_GPU_NOTES.get(err.value, f"NVML did not start: {err}"))
    except OSError as err:  # a library that exists but will not load
        return GpuReport(note=f"no usable NVML library: {err}")
    try:
        return _read(nvml)
    finally:
        _optional(nvml.nvmlShutdown)


def _read(nvml: Any) -> GpuReport:
    driver = _optional(nvml.nvmlSystemGetDriverVersion)
    cuda = _optional(nvml.nvmlSystemGetCudaDriverVersion_v2)
    try:
        count = nvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as err:
        return GpuReport(driver=_text(driver or ""), note=f"NVML could not count GPUs: {err}")

    found: list[tuple[str, str, int, int, str]] = []
    capability: dict[str, tuple[int, int]] = {}
    processes: dict[str, frozenset[int]] = {}
    problems: list[str] = []
    for nvml_index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
            name = _text(nvml.nvmlDeviceGetName(handle))
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError as err:
            problems.append(f"NVML device {nvml_index} unreadable: {err}")
            continue
        found.append((bus_id.lower(), name, memory.total // _MIB, memory.free // _MIB, uuid))
        cc = _optional(nvml.nvmlDeviceGetCudaComputeCapability, handle)
        if cc is not None:
            capability[uuid] = (int(cc[0]), int(cc[1]))
        procs = _optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        if procs is not None:
            processes[uuid] = frozenset(p.pid for p in procs)

    gpus = tuple(
        wire.Gpu(index=index, name=name, memory_total_mib=total, memory_free_mib=free,
                 uuid=uuid, pci_bus_id=bus_id)
        for index, (bus_id, name, total, free, uuid) in enumerate(sorted(found)))
    if not gpus and not problems:
        problems.append("NVML found the driver but no GPUs")
    return GpuReport(gpus=gpus, driver=_text(driver or ""),
                     cuda=_cuda_version(cuda) if cuda else "", note="; ".join(problems),
                     compute_capability=capability, processes=processes)


def gpus_not_held(report: GpuReport, indices: tuple[int, ...], pids: set[int]
                  ) -> list[int] | None:
    """Of the GPUs at ``indices`` (PCI bus order), those on which none of ``pids`` runs.
    ``None`` when NVML cannot tell for one of them (no such GPU, or no process list, as
    inside some containers): then nobody can say, and the caller should not guess."""
    by_index = {g.index: g for g in report.gpus}
    missing = []
    for index in indices:
        gpu = by_index.get(index)
        if gpu is None or gpu.uuid not in report.processes:
            return None
        if not report.processes[gpu.uuid] & pids:
            missing.append(index)
    return missing
