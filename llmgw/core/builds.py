"""Which build of an engine a node should install: the builds each project publishes, best
first, and the ones this node's hardware rules out.

Pure: the node's facts come in, a list of builds (or one refusal in words) goes out. The
agent tries the builds in order and keeps the first that installs and runs; the driver
floors here are the one table of them (the doctor reads it too).

Sources: NVIDIA's CUDA release notes, "CUDA Toolkit and Corresponding Driver Versions"
(CUDA 13.0 GA: >= 580.65.06; 12.9 GA: >= 575.51.03; 12.8 GA: >= 570.26). vLLM's release
pipeline: every build from 0.20.0 has kernels for compute capability 7.5 and up, 0.19.1
is the last built for 7.0 (V100), and PyPI's wheel is CUDA 13 from 0.20 (CUDA 12.8
before). SGLang publishes CUDA 13 builds since 0.5.20 and needs sm75.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw.core import engine_names
from llmgw.core.names import NameRuleError, check_element

# The CPython the nodes build Python engines' environments with (vLLM, SGLang), and the
# one `llmgw bundle create` resolves their wheel sets for.
ENVIRONMENT_PYTHON = "3.12"

# CUDA line -> the oldest Linux driver NVIDIA names for it.
CUDA_DRIVER_FLOORS: dict[str, str] = {
    "13.0": "580.65.06",
    "12.9": "575.51.03",
    "12.8": "570.26",
}
# The CUDA builds llama.cpp publishes for Linux x64, best first: (CUDA version, its line).
LLAMA_CPP_CUDA = (("13.3", "13.0"), ("12.8", "12.8"))
# Oldest compute capability each engine's builds carry kernels for.
VLLM_CC_FROM_0_20 = (7, 5)
VLLM_CU130_FROM = (0, 20)
VLLM_LAST_FOR_VOLTA = "0.19.1"
MIN_COMPUTE: dict[str, tuple[int, int]] = {
    "vllm": (7, 0), "sglang": (7, 5), "llama.cpp": (5, 0), "comfyui": (5, 0)}
SGLANG_CU130_FROM = (0, 5, 20)
PYTORCH_CU129_INDEX = "https://download.pytorch.org/whl/cu129"
# A Python engine's environment while it installs: torch, CUDA libraries, kernels.
PYTHON_ENGINE_DISK_MIB = {"vllm": 25 * 1024, "sglang": 25 * 1024, "comfyui": 10 * 1024}
ARCHIVE_ENGINE_DISK_MIB = 1024
# The CUDA line each CUDA build is built with; a GPU build not named here (llama.cpp's
# Vulkan) needs no CUDA driver.
CUDA_LINES: dict[str, str] = {
    **{f"cuda-{v}": line for v, line in LLAMA_CPP_CUDA},
    "cu130": "13.0", "cu129": "12.9", "cu128": "12.8"}
_TORCH_INDEX = {"cu129": PYTORCH_CU129_INDEX}  # where torch comes from other than PyPI

# Builds an operator may choose per node (besides auto and none), for each installable
# engine (tests/unit/test_builds.py holds the keys to core.engine_names).
BUILD_NAMES: dict[str, tuple[str, ...]] = {
    "llama.cpp": (*(f"cuda-{v}" for v, _ in LLAMA_CPP_CUDA), "vulkan", "cpu"),
    "vllm": ("cu130", "cu129", "cu128"),
    "sglang": ("cu130", "cu129"),
    "comfyui": ("cu130", "cu129"),
}
_ARCH = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What a node says about itself that decides its builds."""

    arch: str  # platform.machine(): "x86_64", "aarch64"
    gpus: int = 0  # NVIDIA GPUs
    gpu_driver: str = ""  # "580.82.07"
    compute_capabilities: tuple[tuple[int, int], ...] = ()  # one per GPU NVML could read
    gpu_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Build:
    engine: str
    version: str
    name: str  # "cuda-13.3", "vulkan", "cpu"; "cu130", "cu129", "cu128"
    # "archive" (unpacked, a binary in it), "python" (a uv environment) or "source" (a
    # source archive unpacked beside the uv environment its requirements.txt asks for)
    kind: str
    asset: str = ""  # the archive's file name in the release
    binary: str = ""  # the program in the archive (or environment) that serves
    needs: tuple[str, ...] = ()  # OS packages by need: "gomp", "vulkan", "gcc"
    gpu: bool = False  # counts only once it computes on the GPU
    torch_index: str = ""  # PyTorch's own index, where torch must come from there
    min_free_mib: int = ARCHIVE_ENGINE_DISK_MIB

    @property
    def directory(self) -> str:
        """The element it is installed under, beside the engine's other builds."""
        return f"{self.version}-{self.name}"


@dataclass(frozen=True, slots=True)
class Refusal:
    """Nothing of this engine can be installed here; ``fault`` is False where that is
    expected (vLLM on a node without a GPU) rather than something to fix."""

    reason: str
    fault: bool = True


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:4])


def driver_at_least(driver: str, floor: str) -> bool:
    return bool(driver) and version_tuple(driver) >= version_tuple(floor)


def driver_floor(cuda_line: str) -> str:
    return CUDA_DRIVER_FLOORS[cuda_line]


def driver_runs(build_name: str, driver: str) -> bool:
    """Whether an NVIDIA driver (``""``: unreadable) runs this build."""
    line = CUDA_LINES.get(build_name)
    return line is None or driver_at_least(driver, driver_floor(line))


def gpu_builds(engine: str, arch: str, version: str = "") -> tuple[str, ...]:
    """The builds ``engine`` publishes for an NVIDIA node with processor ``arch``, best
    first, before the driver is asked: for ``version``, or current releases where it is
    empty. Empty where there is none for that processor."""
    x64 = _ARCH.get(arch) == "x64"

    def since(first: tuple[int, ...]) -> bool:
        return not version or version_tuple(version) >= first

    if engine == "llama.cpp":
        return (*(f"cuda-{v}" for v, _ in LLAMA_CPP_CUDA), "vulkan") if x64 else ()
    if engine == "vllm":
        if arch not in _ARCH:
            return ()
        if not since(VLLM_CU130_FROM):
            return ("cu128",)
        return ("cu130", "cu129") if x64 else ("cu130",)
    if engine == "sglang":
        return ("cu130", "cu129") if since(SGLANG_CU130_FROM) else ("cu129",)
    if engine == "comfyui":
        return ("cu130", "cu129")
    return ()


def cuda_lines(engine: str, arch: str = "x86_64", version: str = "") -> tuple[str, ...]:
    """The CUDA lines of ``engine``'s GPU builds (``gpu_builds``), best first."""
    return tuple(CUDA_LINES[b] for b in gpu_builds(engine, arch, version) if b in CUDA_LINES)


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def candidate_builds(engine: str, version: str, node: NodeFacts,
                     choice: str = "auto") -> list[Build] | Refusal:
    """The builds of ``engine`` ``version`` this node may run, best first; ``choice`` (a
    build name, or auto) narrows the list to that one build. A Refusal says why none."""
    try:
        check_element(engine, "engine name")
        check_element(version, f"{engine} version")
    except NameRuleError as err:
        return Refusal(str(err))
    if engine not in BUILD_NAMES:
        return Refusal(f"this agent cannot install {engine}; it installs "
                       + ", ".join(engine_names.INSTALLABLE))
    if choice not in ("auto", *BUILD_NAMES[engine]):
        return Refusal(f"{engine} has no build {choice!r}; choose auto, none or one of "
                       + ", ".join(BUILD_NAMES[engine]))
    found = {"llama.cpp": _llama_cpp, "vllm": _vllm, "sglang": _sglang,
             "comfyui": _comfyui}[engine](version, node)
    if isinstance(found, Refusal) or choice == "auto":
        return found
    chosen = [b for b in found if b.name == choice]
    if not chosen:
        offered = ", ".join(b.name for b in found)
        return Refusal(f"the {choice} build of {engine} {version} does not fit this node "
                       f"(it can take {offered}); set its build to auto")
    return chosen


def _llama_cpp(version: str, node: NodeFacts) -> list[Build] | Refusal:
    arch = _ARCH.get(node.arch)
    asset = f"llama-{version}-bin-ubuntu-{{}}{arch}.tar.gz"

    def build(name: str, flavour: str, needs: tuple[str, ...], gpu: bool) -> Build:
        return Build("llama.cpp", version, name, "archive", asset.format(flavour),
                     "llama-server", needs, gpu)

    if node.gpus:
        # A CPU build on an NVIDIA node would run, slowly, and look healthy: never offered.
        names = gpu_builds("llama.cpp", node.arch)
        if not names:
            return Refusal(f"llama.cpp publishes no CUDA or Vulkan build for {node.arch}; "
                           "name a llama-server built for this node in agent.yaml")
        return [build(name, f"{name}-", ("gomp", "vulkan") if name == "vulkan" else ("gomp",),
                      True) for name in names if driver_runs(name, node.gpu_driver)]
    if arch is None:
        return Refusal(f"llama.cpp publishes no build for {node.arch or 'this processor'}")
    return [build("cpu", "", ("gomp",), False)]


def _gpu_refusal(engine: str, version: str, node: NodeFacts,
                 need: tuple[int, int]) -> Refusal | None:
    if not node.gpus:
        return Refusal(f"skipped: {engine} runs on NVIDIA GPUs and this node has none",
                       fault=False)
    known = [cc for cc in node.compute_capabilities if cc]
    if known and max(known) < need:
        best = max(known)
        text = (f"{engine} {version} is built for compute capability {_cc(need)} and up; "
                f"the best GPU here is {_cc(best)}")
        if engine == "vllm" and best >= MIN_COMPUTE["vllm"]:
            text += (f": vLLM {VLLM_LAST_FOR_VOLTA} is the newest built for it; give these "
                     f"nodes version {VLLM_LAST_FOR_VOLTA} in engine_overrides")
        return Refusal(text)
    return None


def _cuda_builds(engine: str, version: str, node: NodeFacts, binary: str,
                 needs: tuple[str, ...]) -> list[Build] | Refusal:
    """The engine's GPU builds for this node's processor that its driver runs."""
    names = gpu_builds(engine, node.arch, version)
    builds = [Build(engine, version, name, "python", binary=binary, needs=needs, gpu=True,
                    torch_index=_TORCH_INDEX.get(name, ""),
                    min_free_mib=PYTHON_ENGINE_DISK_MIB[engine])
              for name in names if driver_runs(name, node.gpu_driver)]
    if builds:
        return builds
    oldest = min((driver_floor(CUDA_LINES[n]) for n in names), key=version_tuple)
    return Refusal(f"{engine} {version} needs NVIDIA driver {oldest} or newer; this node has "
                   f"{node.gpu_driver or 'none readable'}")


def _vllm(version: str, node: NodeFacts) -> list[Build] | Refusal:
    modern = version_tuple(version) >= VLLM_CU130_FROM
    refusal = _gpu_refusal("vllm", version, node,
                           VLLM_CC_FROM_0_20 if modern else MIN_COMPUTE["vllm"])
    if refusal:
        return refusal
    if not gpu_builds("vllm", node.arch, version):
        return Refusal(f"vLLM publishes no build for {node.arch}")
    # gcc: Triton compiles its launcher at the first model load.
    return _cuda_builds("vllm", version, node, "vllm", ("gcc",))


def _sglang(version: str, node: NodeFacts) -> list[Build] | Refusal:
    refusal = _gpu_refusal("sglang", version, node, MIN_COMPUTE["sglang"])
    if refusal:
        return refusal
    return _cuda_builds("sglang", version, node, "python", ("gcc",))


def _comfyui(version: str, node: NodeFacts) -> list[Build] | Refusal:
    refusal = _gpu_refusal("comfyui", version, node, MIN_COMPUTE["comfyui"])
    if refusal:
        return refusal
    found = _cuda_builds("comfyui", version, node, "python", ())
    if isinstance(found, Refusal):
        return found
    return [Build(b.engine, b.version, b.name, "source", comfyui_archive(version), "main.py",
                  b.needs, True, b.torch_index, b.min_free_mib) for b in found]


def comfyui_archive(version: str) -> str:
    """ComfyUI's source archive for ``version``: GitHub's archive of the tag ``v<version>``,
    for which GitHub publishes no digest (server.yaml pins it)."""
    return f"v{version}.tar.gz"
