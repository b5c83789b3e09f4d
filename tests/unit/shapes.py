"""Hardware shapes, named after the machines they stand for, so that placement and planning
tests read as scenarios ("an 8xH100 node", "two fabrics of four").

Figures are what NVML and /proc/cpuinfo report on such machines: an H100 80GB HBM3 reports
81559 MiB, an RTX 4090 24564 MiB.
"""

from __future__ import annotations

from dataclasses import replace

from llmgw.core.inventory import EngineStatus, Gpu, Node, NodeState

H100_NAME = "NVIDIA H100 80GB HBM3"
H100_MIB = 81559
RTX4090_NAME = "NVIDIA GeForce RTX 4090"
RTX4090_MIB = 24564

LLAMA_DOWNLOADING = "installing: downloading llama-b10991-bin-ubuntu-x64.tar.gz (16 MB)"

VLLM = EngineStatus("vllm", "0.11.0", "installed")
LLAMA_INSTALLING = EngineStatus("llama.cpp", "b10991", "installing", LLAMA_DOWNLOADING)
LLAMA = EngineStatus("llama.cpp", "b10991", "installed")

_X86_BASE = frozenset(
    {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "aes", "pclmulqdq", "avx"}
)
_X86_AVX2 = _X86_BASE | {"avx2", "fma", "f16c", "bmi1", "bmi2"}
_X86_AVX512 = _X86_AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def address_of(node_id: str) -> str:
    """A stable loopback-free address per node, so shard addresses can be checked."""
    digits = "".join(c for c in node_id if c.isdigit()) or "0"
    return f"10.0.0.{int(digits) % 250 + 1}"


def gpus(count: int, name: str, total_mib: int, free_mib: int | None = None) -> tuple[Gpu, ...]:
    free = total_mib - 512 if free_mib is None else free_mib
    return tuple(Gpu(i, name, total_mib, free) for i in range(count))


def h100_8x80g(
    id: str,
    fabric: str | None = None,
    *,
    state: NodeState = NodeState.READY,
    engines: tuple[EngineStatus, ...] = (VLLM, LLAMA_INSTALLING),
    port_range: tuple[int, int] = (20000, 20999),
    free_mib: int | None = None,
) -> Node:
    """A DGX-class node: 8x H100 80GB, AVX-512, 2 TiB of RAM, usually on an IB fabric."""
    return Node(
        id=id,
        address=address_of(id),
        state=state,
        gpus=gpus(8, H100_NAME, H100_MIB, free_mib),
        engines=engines,
        cpu_flags=_X86_AVX512,
        ram_total_mib=2_063_731,
        fabric=fabric,
        port_range=port_range,
    )


def rtx4090_2x24g(
    id: str,
    *,
    state: NodeState = NodeState.READY,
    engines: tuple[EngineStatus, ...] = (VLLM, LLAMA),
    port_range: tuple[int, int] = (20000, 20999),
) -> Node:
    """A workstation: 2x RTX 4090, no fabric."""
    return Node(
        id=id,
        address=address_of(id),
        state=state,
        gpus=gpus(2, RTX4090_NAME, RTX4090_MIB),
        engines=engines,
        cpu_flags=_X86_AVX2,
        ram_total_mib=128_642,
        port_range=port_range,
    )


def cpu_only_no_avx2(id: str, *, state: NodeState = NodeState.READY) -> Node:
    """An old Xeon without AVX2 and without GPUs; llama.cpp is installed."""
    return Node(
        id=id,
        address=address_of(id),
        state=state,
        engines=(LLAMA,),
        cpu_flags=_X86_BASE,
        ram_total_mib=32_010,
    )


def cpu_avx2(id: str, *, state: NodeState = NodeState.READY) -> Node:
    """A current CPU-only server with AVX2; llama.cpp is installed."""
    return Node(
        id=id,
        address=address_of(id),
        state=state,
        engines=(LLAMA,),
        cpu_flags=_X86_AVX2,
        ram_total_mib=257_644,
    )


def two_fabrics_of_four() -> list[Node]:
    """node01-04 on ib-a, node05-08 on ib-b, each 8x H100."""
    return [
        h100_8x80g(f"node{i:02d}", "ib-a" if i <= 4 else "ib-b") for i in range(1, 9)
    ]


# --- Arm CPUs: /proc/cpuinfo lists asimd (aarch64) or neon (32-bit), never avx2 -------------

_ARM_V8 = frozenset(
    {"fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "atomics", "fphp",
     "asimdhp", "cpuid", "asimdrdm", "jscvt", "fcma", "lrcpc", "dcpop", "sha3", "asimddp",
     "sha512", "sve", "asimdfhm", "i8mm", "bf16"}
)
_ARM_V7 = frozenset(
    {"half", "thumb", "fastmult", "vfp", "edsp", "neon", "vfpv3", "tls", "vfpv4", "idiva",
     "idivt", "vfpd32", "lpae", "evtstrm", "crc32"}
)


def graviton3(id: str, *, state: NodeState = NodeState.READY) -> Node:
    """An AWS Graviton3 (Neoverse V1) CPU-only server; llama.cpp is installed."""
    return Node(
        id=id,
        address=address_of(id),
        state=state,
        engines=(LLAMA,),
        cpu_flags=_ARM_V8,
        ram_total_mib=128_270,
    )


def raspberry_pi_32bit(id: str, *, state: NodeState = NodeState.READY) -> Node:
    """A Raspberry Pi 4 on a 32-bit OS: reports neon rather than asimd; llama.cpp is
    installed."""
    return Node(
        id=id,
        address=address_of(id),
        state=state,
        engines=(LLAMA,),
        cpu_flags=_ARM_V7,
        ram_total_mib=7_812,
    )


# --- what an operator or the node adds to a shape --------------------------------------------


def labelled(node: Node, **labels: str) -> Node:
    """The node with these labels added (an agent's `labels:` setting)."""
    merged = {**dict(node.labels), **labels}
    return replace(node, labels=tuple(sorted(merged.items())))


def holding(node: Node, *models: str) -> Node:
    """The node reporting that it already holds these models' weights."""
    return replace(node, weights=node.weights | frozenset(models))


def disabling(node: Node, *engines: str) -> Node:
    """The node with these engines turned off (an agent's `disable_engines:` setting)."""
    return replace(node, disabled_engines=node.disabled_engines | frozenset(engines))
