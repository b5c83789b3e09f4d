"""Run a real ``llmgw`` process (an agent) on hardware that is not here: its NVML is one of
tests/fakes/nvml.py's named machines, and optionally its CPU is read from a cpuinfo-shaped
file. The agent discovers, registers and reports them as it would real ones.

Used as a command prefix (``Cluster.add_agent(..., prefix=fake_node_prefix("fake_h100_x8"))``):
the rest of the command line is ``PYTHON -m llmgw ARGS``, run here in this process after
``discover_gpus`` (and ``cpu_info``) are pointed at the fakes. Every caller reaches them
through their module, and one that passes its own NVML or cpuinfo keeps it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from llmgw.agent.discovery import gpus, host
from tests.fakes import nvml

_NO_CPUINFO = "-"


def fake_node_prefix(machine: str, cpuinfo: Path | None = None) -> tuple[str, ...]:
    """The command prefix that runs what follows with ``machine``'s GPUs (a function name
    of tests/fakes/nvml.py, such as ``fake_h100_x8`` or ``fake_no_library``) and, when
    given, the CPU that ``cpuinfo`` (a /proc/cpuinfo-shaped file) describes."""
    return (sys.executable, "-m", "tests.fakes.nvml_process", machine,
            str(cpuinfo) if cpuinfo else _NO_CPUINFO)


def main(argv: list[str]) -> None:
    machine, cpuinfo, rest = argv[0], argv[1], argv[2:]
    if rest[1:3] != ["-m", "llmgw"]:
        raise SystemExit(f"expected PYTHON -m llmgw ARGS after the fakes, not {rest!r}")
    fake = getattr(nvml, machine)()
    real_gpus = gpus.discover_gpus
    gpus.discover_gpus = lambda given=None: real_gpus(fake if given is None else given)
    if cpuinfo != _NO_CPUINFO:
        real_cpu = host.cpu_info
        host.cpu_info = lambda path=Path(cpuinfo): real_cpu(path)
    sys.argv = ["llmgw", *rest[3:]]
    runpy.run_module("llmgw", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
