"""``llmgw doctor``: what this node is, what it can run, and what stops it, with the fix.

Two halves, kept apart so that every verdict is testable without the hardware: ``gather``
(in ``facts``) reads the node (NVML, cpuinfo, sysfs, statvfs, netlink, one GET of each
control plane's ``/healthz``) into a plain ``Facts``, through sources a test replaces;
``checks`` and ``can_run`` (in ``verdicts``) are pure functions of those facts and the
agent's configuration. A finding is ``blocking`` when the agent could not work at all as
configured (no route or no answer from any control plane, unreadable TLS files, a clock a
minute off, a driver too old for every CUDA build); everything that only makes the node
slower or narrower is a warning.

The verdicts module is not named ``checks`` so that the package's ``checks`` stays the
function.
"""

from llmgw.agent.discovery import gpus as gpu_discovery
from llmgw.agent.doctor.facts import (
    PROBE_TIMEOUT_S,
    DirFact,
    Facts,
    Probe,
    ServerFact,
    Sources,
    gather,
    http_probe,
)
from llmgw.agent.doctor.verdicts import (
    CERT_WARN_S,
    CUDA_BUILDS,
    MIN_COMPUTE_CAPABILITY,
    SEVERITY_ORDER,
    SKEW_BLOCK_S,
    SKEW_WARN_S,
    VLLM_DISK_MIB,
    WEIGHTS_LOW_MIB,
    Capability,
    CudaBuild,
    Finding,
    Severity,
    blocks,
    can_run,
    checks,
    driver_floor,
    exit_code,
    sort_findings,
)

__all__ = [
    "CERT_WARN_S",
    "CUDA_BUILDS",
    "MIN_COMPUTE_CAPABILITY",
    "PROBE_TIMEOUT_S",
    "SEVERITY_ORDER",
    "SKEW_BLOCK_S",
    "SKEW_WARN_S",
    "VLLM_DISK_MIB",
    "WEIGHTS_LOW_MIB",
    "Capability",
    "CudaBuild",
    "DirFact",
    "Facts",
    "Finding",
    "Probe",
    "ServerFact",
    "Severity",
    "Sources",
    "blocks",
    "can_run",
    "checks",
    "driver_floor",
    "exit_code",
    "gather",
    "gpu_discovery",
    "http_probe",
    "sort_findings",
]
