"""Build lists per engine, best first, from a node's facts (core.builds)."""

from __future__ import annotations

import pytest

from llmgw.core import engine_names
from llmgw.core.builds import (
    BUILD_NAMES,
    CUDA_DRIVER_FLOORS,
    MIN_COMPUTE,
    PYTHON_ENGINE_DISK_MIB,
    Build,
    NodeFacts,
    Refusal,
    candidate_builds,
    cuda_lines,
    driver_runs,
    gpu_builds,
)

# Hardware shapes, as the agent reads them from NVML and platform.
H100_NEW_DRIVER = NodeFacts("x86_64", gpus=8, gpu_driver="580.82.07",
                            compute_capabilities=((9, 0),) * 8, gpu_names=("NVIDIA H100",))
L40_DRIVER_575 = NodeFacts("x86_64", gpus=2, gpu_driver="575.57.08",
                           compute_capabilities=((8, 9),) * 2)
A100_DRIVER_570 = NodeFacts("x86_64", gpus=4, gpu_driver="570.26",
                            compute_capabilities=((8, 0),) * 4)
T4_OLD_DRIVER = NodeFacts("x86_64", gpus=1, gpu_driver="535.183.01",
                          compute_capabilities=((7, 5),))
V100 = NodeFacts("x86_64", gpus=4, gpu_driver="580.65.06",
                 compute_capabilities=((7, 0),) * 4, gpu_names=("Tesla V100-SXM2-32GB",))
CPU_X64 = NodeFacts("x86_64")
CPU_ARM = NodeFacts("aarch64")
GH200 = NodeFacts("aarch64", gpus=1, gpu_driver="580.82.07", compute_capabilities=((9, 0),))


def names(found: list[Build] | Refusal) -> list[str]:
    assert not isinstance(found, Refusal), found
    return [b.name for b in found]


def test_llama_cpp_on_a_new_driver_takes_cuda_13_then_12_8_then_vulkan():
    found = candidate_builds("llama.cpp", "b11434", H100_NEW_DRIVER)
    assert names(found) == ["cuda-13.3", "cuda-12.8", "vulkan"]
    assert found[0].asset == "llama-b11434-bin-ubuntu-cuda-13.3-x64.tar.gz"
    assert found[-1].asset == "llama-b11434-bin-ubuntu-vulkan-x64.tar.gz"
    assert found[-1].needs == ("gomp", "vulkan")
    assert all(b.gpu and b.binary == "llama-server" for b in found)


@pytest.mark.parametrize(("driver", "expected"), [
    ("580.65.06", ["cuda-13.3", "cuda-12.8", "vulkan"]),  # exactly CUDA 13.0's floor
    ("580.65.05", ["cuda-12.8", "vulkan"]),  # one below it
    ("570.26", ["cuda-12.8", "vulkan"]),  # exactly CUDA 12.8's floor
    ("570.25.99", ["vulkan"]),
    ("", ["vulkan"]),  # GPUs but NVML gave no driver version
])
def test_llama_cpp_cuda_builds_follow_the_driver_floors(driver, expected):
    node = NodeFacts("x86_64", gpus=1, gpu_driver=driver, compute_capabilities=((8, 6),))
    assert names(candidate_builds("llama.cpp", "b11434", node)) == expected


def test_the_driver_floors_are_nvidias():
    assert CUDA_DRIVER_FLOORS == {"13.0": "580.65.06", "12.9": "575.51.03", "12.8": "570.26"}


def test_the_cuda_lines_each_engine_needs_a_driver_for():
    assert cuda_lines("llama.cpp") == ("13.0", "12.8")  # then Vulkan, which needs none
    for engine in ("vllm", "sglang", "comfyui"):
        assert cuda_lines(engine) == ("13.0", "12.9")
    assert cuda_lines("vllm", version="0.19.1") == ("12.8",)
    assert cuda_lines("sglang", version="0.5.10") == ("12.9",)
    assert cuda_lines("vllm", "aarch64") == ("13.0",)
    assert cuda_lines("llama.cpp", "aarch64") == ()
    assert cuda_lines("sim") == ()


def test_every_installable_engine_has_builds_and_only_those_do():
    assert sorted(BUILD_NAMES) == sorted(engine_names.INSTALLABLE)
    assert set(MIN_COMPUTE) == set(engine_names.INSTALLABLE)
    assert set(PYTHON_ENGINE_DISK_MIB) < set(engine_names.INSTALLABLE)


@pytest.mark.parametrize("engine", engine_names.INSTALLABLE)
def test_gpu_builds_are_what_candidate_builds_offers_a_new_driver(engine):
    version = {"llama.cpp": "b11434", "vllm": "0.30.0", "sglang": "0.5.23",
               "comfyui": "0.3.60"}[engine]
    for node in (H100_NEW_DRIVER, GH200):
        found = candidate_builds(engine, version, node)
        offered = [] if isinstance(found, Refusal) else names(found)
        assert offered == list(gpu_builds(engine, node.arch))


def test_driver_runs_a_build_from_its_cuda_lines_floor():
    assert driver_runs("cu130", "580.65.06") and not driver_runs("cu130", "580.65.05")
    assert driver_runs("cuda-12.8", "570.26") and not driver_runs("cu129", "570.195.03")
    assert driver_runs("vulkan", "515.65.01") and driver_runs("vulkan", "")
    assert not driver_runs("cu128", "")  # an unreadable driver runs no CUDA build


@pytest.mark.parametrize("node", [H100_NEW_DRIVER, A100_DRIVER_570, T4_OLD_DRIVER, V100])
def test_an_nvidia_node_is_never_given_the_cpu_build(node):
    found = candidate_builds("llama.cpp", "b11434", node)
    assert "cpu" not in names(found)


def test_an_nvidia_node_cannot_choose_the_cpu_build_either():
    found = candidate_builds("llama.cpp", "b11434", H100_NEW_DRIVER, choice="cpu")
    assert isinstance(found, Refusal)
    assert "does not fit this node" in found.reason and "auto" in found.reason


def test_cpu_nodes_get_the_cpu_build_for_their_processor():
    x64 = candidate_builds("llama.cpp", "b11434", CPU_X64)
    arm = candidate_builds("llama.cpp", "b11434", CPU_ARM)
    assert [b.asset for b in x64] == ["llama-b11434-bin-ubuntu-x64.tar.gz"]
    assert [b.asset for b in arm] == ["llama-b11434-bin-ubuntu-arm64.tar.gz"]
    assert x64[0].needs == ("gomp",) and not x64[0].gpu
    assert x64[0].directory == "b11434-cpu"


def test_llama_cpp_on_an_arm_gpu_node_is_refused_rather_than_run_on_its_cpu():
    found = candidate_builds("llama.cpp", "b11434", GH200)
    assert isinstance(found, Refusal) and found.fault
    assert "no CUDA or Vulkan build for aarch64" in found.reason


def test_a_processor_nobody_builds_for_is_refused():
    found = candidate_builds("llama.cpp", "b11434", NodeFacts("riscv64"))
    assert isinstance(found, Refusal) and "riscv64" in found.reason


def test_vllm_takes_cuda_13_then_cuda_12_9_by_driver():
    assert names(candidate_builds("vllm", "0.30.0", H100_NEW_DRIVER)) == ["cu130", "cu129"]
    assert names(candidate_builds("vllm", "0.30.0", L40_DRIVER_575)) == ["cu129"]
    cu129 = candidate_builds("vllm", "0.30.0", L40_DRIVER_575)[0]
    assert cu129.torch_index == "https://download.pytorch.org/whl/cu129"
    assert cu129.needs == ("gcc",) and cu129.min_free_mib == 25 * 1024


def test_vllm_on_a_driver_older_than_every_build_says_which_driver():
    found = candidate_builds("vllm", "0.30.0", A100_DRIVER_570)
    assert isinstance(found, Refusal) and found.fault
    assert found.reason == ("vllm 0.30.0 needs NVIDIA driver 575.51.03 or newer; this node "
                            "has 570.26")


def test_a_v100_asked_for_a_newer_vllm_is_refused_naming_0_19_1():
    found = candidate_builds("vllm", "0.30.0", V100)
    assert isinstance(found, Refusal) and found.fault
    assert "compute capability 7.5 and up; the best GPU here is 7.0" in found.reason
    assert "vLLM 0.19.1 is the newest built for it" in found.reason
    assert "engine_overrides" in found.reason


def test_a_v100_given_0_19_1_installs_its_cuda_12_8_build():
    assert names(candidate_builds("vllm", "0.19.1", V100)) == ["cu128"]


def test_vllm_on_a_node_without_a_gpu_is_skipped_not_a_fault():
    found = candidate_builds("vllm", "0.30.0", CPU_X64)
    assert isinstance(found, Refusal) and not found.fault
    assert found.reason.startswith("skipped: vllm runs on NVIDIA GPUs")


def test_vllm_on_an_arm_gpu_node_has_no_cuda_12_9_build():
    assert names(candidate_builds("vllm", "0.30.0", GH200)) == ["cu130"]


def test_sglang_needs_turing_and_has_cuda_13_from_0_5_20():
    assert names(candidate_builds("sglang", "0.5.23", H100_NEW_DRIVER)) == ["cu130", "cu129"]
    assert names(candidate_builds("sglang", "0.5.10", H100_NEW_DRIVER)) == ["cu129"]
    found = candidate_builds("sglang", "0.5.23", V100)
    assert isinstance(found, Refusal) and "7.5 and up" in found.reason
    assert "0.19.1" not in found.reason  # that advice is vLLM's


def test_comfyui_is_for_nvidia_nodes_with_torch_by_driver():
    assert names(candidate_builds("comfyui", "0.3.60", H100_NEW_DRIVER)) == ["cu130", "cu129"]
    assert names(candidate_builds("comfyui", "0.3.60", L40_DRIVER_575)) == ["cu129"]
    skipped = candidate_builds("comfyui", "0.3.60", CPU_X64)
    assert isinstance(skipped, Refusal) and not skipped.fault


def test_comfyui_is_its_tag_archive_beside_an_environment_with_torch_by_driver():
    cu130, cu129 = candidate_builds("comfyui", "0.3.60", H100_NEW_DRIVER)
    for build in (cu130, cu129):
        assert (build.kind, build.asset, build.binary, build.gpu) == (
            "source", "v0.3.60.tar.gz", "main.py", True)
        assert build.min_free_mib == 10 * 1024
    # PyPI's torch is its CUDA 13 build; PyTorch's own index has the CUDA 12.9 one.
    assert (cu130.torch_index, cu129.torch_index) == (
        "", "https://download.pytorch.org/whl/cu129")
    assert cu129.directory == "0.3.60-cu129"


def test_a_build_choice_narrows_the_list_to_that_build():
    assert names(candidate_builds("vllm", "0.30.0", H100_NEW_DRIVER, "cu129")) == ["cu129"]
    assert names(candidate_builds("llama.cpp", "b11434", H100_NEW_DRIVER, "vulkan")) == [
        "vulkan"]
    unknown = candidate_builds("vllm", "0.30.0", H100_NEW_DRIVER, "cu118")
    assert isinstance(unknown, Refusal)
    assert "has no build 'cu118'" in unknown.reason and "cu130, cu129" in unknown.reason


@pytest.mark.parametrize("version", ["../x", "..", ".hidden", "b1/../../etc", "", "a b"])
def test_versions_that_are_not_one_safe_path_element_are_refused(version):
    found = candidate_builds("llama.cpp", version, CPU_X64)
    assert isinstance(found, Refusal) and found.fault
    assert "llama.cpp version" in found.reason and "is not allowed" in found.reason


def test_an_engine_this_agent_cannot_install_is_refused_by_name():
    found = candidate_builds("tgi", "3.0", CPU_X64)
    assert isinstance(found, Refusal)
    assert found.reason.startswith("this agent cannot install tgi")
