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
from llmgw.agent.doctor.facts import DirFact, Facts, Probe, Sources, gather
from llmgw.agent.doctor.verdicts import (
    SEVERITY_ORDER,
    Capability,
    Finding,
    blocks,
    can_run,
    checks,
    exit_code,
    sort_findings,
)

__all__ = [
    "SEVERITY_ORDER",
    "Capability",
    "DirFact",
    "Facts",
    "Finding",
    "Probe",
    "Sources",
    "blocks",
    "can_run",
    "checks",
    "exit_code",
    "gather",
    "gpu_discovery",
    "sort_findings",
]
