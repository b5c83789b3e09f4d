"""Node discovery: GPUs through a fake NVML, RDMA ports from a sysfs-shaped tree."""

import _ctypes
import shutil
from pathlib import Path

import pynvml
import pytest

from llmgw.agent.discovery.gpus import GpuReport, discover_gpus, preload_nvml
from llmgw.agent.discovery.infiniband import IbPort, discover_infiniband
from tests.fakes.nvml import (
    FakeNvml,
    fake_h100_x8,
    fake_no_driver,
    fake_no_library,
    fake_single_4090,
)

SYSFS_IB = Path(__file__).resolve().parents[1] / "data" / "sysfs" / "infiniband"


def test_eight_h100s_come_in_pci_bus_order_with_indexes_reassigned():
    report = discover_gpus(fake_h100_x8())
    assert [g.pci_bus_id for g in report.gpus] == [
        f"00000000:{bus}:00.0" for bus in ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")]
    assert [g.index for g in report.gpus] == list(range(8))
    assert {g.name for g in report.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert len({g.uuid for g in report.gpus}) == 8
    assert report.note == ""


def test_memory_is_in_mib_and_processes_sit_beside_the_gpu_by_uuid():
    report = discover_gpus(fake_h100_x8())
    busy = report.gpus[0]
    assert (busy.memory_total_mib, busy.memory_free_mib) == (81559, 8912)
    assert report.gpus[1].memory_free_mib == 81004
    assert report.processes[busy.uuid] == {41233}
    assert report.processes[report.gpus[1].uuid] == frozenset()
    assert set(report.compute_capability.values()) == {(9, 0)}


def test_driver_and_cuda_versions_are_strings():
    h100 = discover_gpus(fake_h100_x8())
    assert (h100.driver, h100.cuda) == ("580.65.06", "13.0")
    rtx = discover_gpus(fake_single_4090())
    assert (rtx.driver, rtx.cuda) == ("570.172.08", "12.8")


def test_a_single_4090():
    report = discover_gpus(fake_single_4090())
    (gpu,) = report.gpus
    assert (gpu.index, gpu.name, gpu.memory_total_mib) == (0, "NVIDIA GeForce RTX 4090", 24564)
    assert gpu.pci_bus_id == "00000000:01:00.0"
    assert report.compute_capability[gpu.uuid] == (8, 9)


def test_names_given_as_bytes_are_decoded():
    fake = fake_single_4090()
    fake.gpus[0]["name"] = b"NVIDIA GeForce RTX 4090"
    assert discover_gpus(fake).gpus[0].name == "NVIDIA GeForce RTX 4090"


def test_a_driver_with_no_gpus_is_an_empty_report_that_says_so():
    report = discover_gpus(FakeNvml([]))
    assert report.gpus == ()
    assert report.driver == "580.65.06"
    assert "no GPUs" in report.note


def test_no_library_and_no_driver_are_empty_reports_not_errors():
    no_library = discover_gpus(fake_no_library())
    assert no_library == GpuReport(note="no NVML library: no NVIDIA driver on this node")
    no_driver = discover_gpus(fake_no_driver())
    assert no_driver == GpuReport(note="NVML found no driver loaded")


def test_a_library_that_will_not_load_is_an_empty_report():
    class Broken(FakeNvml):
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: wrong ELF class")

    report = discover_gpus(Broken([]))
    assert report.gpus == ()
    assert "wrong ELF class" in report.note


def test_an_error_on_one_gpus_process_list_keeps_the_gpu():
    fake = fake_h100_x8()
    fake.gpus[1]["errors"] = {  # bus 18, which comes first in PCI order
        "nvmlDeviceGetComputeRunningProcesses": pynvml.NVML_ERROR_NO_PERMISSION}
    report = discover_gpus(fake)
    assert len(report.gpus) == 8
    assert report.gpus[0].pci_bus_id == "00000000:18:00.0"
    assert report.gpus[0].uuid not in report.processes
    assert len(report.processes) == 7


def test_a_lost_gpu_is_left_out_and_named_in_the_note():
    fake = fake_h100_x8()
    fake.gpus[2]["errors"] = {"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_GPU_IS_LOST}
    report = discover_gpus(fake)
    assert len(report.gpus) == 7
    assert [g.index for g in report.gpus] == list(range(7))
    assert "NVML device 2" in report.note


def test_nvml_is_shut_down_after_reading():
    fake = fake_single_4090()
    discover_gpus(fake)
    assert not fake.initialised


@pytest.mark.skipif(Path("/proc/driver/nvidia").exists(), reason="an NVIDIA driver is loaded")
def test_this_machine_without_an_nvidia_driver_gives_an_empty_report():
    report = discover_gpus()
    assert report.gpus == ()
    assert report.note


def test_nvml_is_loaded_by_path_where_the_loader_would_not_look(tmp_path):
    """NixOS keeps the driver's libraries in /run/opengl-driver/lib: loaded by path, a
    library is found by its soname afterwards (pynvml's CDLL("libnvidia-ml.so.1")), with
    no LD_LIBRARY_PATH for the engines to inherit. A node without the file has no GPUs."""
    assert preload_nvml(None) is False
    assert preload_nvml(str(tmp_path / "libnvidia-ml.so.1")) is False
    # Any real shared object stands in for NVML: a copy of one of Python's own modules.
    library = tmp_path / "libnvidia-ml.so.1"
    shutil.copy(_ctypes.__file__, library)
    assert str(library) not in _mapped_files()
    assert preload_nvml(str(library)) is True
    assert str(library) in _mapped_files()


def _mapped_files() -> set[str]:
    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if line.split()[-1].startswith("/")}


def test_infiniband_fixture_tree():
    assert discover_infiniband(SYSFS_IB) == (
        IbPort(adapter="mlx5_0", port=1, state="ACTIVE", rate_gbps=400.0,
               link_layer="InfiniBand", guid="b83f:d203:00a1:2b3c"),
        IbPort(adapter="mlx5_1", port=1, state="DOWN", rate_gbps=40.0,
               link_layer="Ethernet", guid="1c34:da03:0072:9e40"),
    )


def test_infiniband_missing_root_is_no_adapters(tmp_path):
    assert discover_infiniband(tmp_path / "infiniband") == ()


def test_infiniband_unreadable_file_still_reports_the_port(tmp_path):
    root = tmp_path / "infiniband"
    shutil.copytree(SYSFS_IB, root)
    rate = root / "mlx5_0" / "ports" / "1" / "rate"
    rate.unlink()
    rate.mkdir()  # reading it now fails, as a file a driver refuses would
    port = discover_infiniband(root)[0]
    assert (port.adapter, port.state, port.rate_gbps) == ("mlx5_0", "ACTIVE", 0.0)
