"""The doctor's verdicts: pure functions of ``Facts`` and the agent's configuration.

``checks`` says what is wrong (or right) and the fix; ``can_run`` says which engine builds
this node can run and why not. A finding is ``blocking`` when the agent could not work at
all as configured; everything that only makes the node slower or narrower is a warning.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from llmgw.agent.discovery.tls import TlsFile, TlsReport
from llmgw.agent.doctor.facts import Facts, ServerFact
from llmgw.config import AgentConfig
from llmgw.core import engine_names
from llmgw.core.builds import (
    CUDA_DRIVER_FLOORS,
    CUDA_LINES,
    MIN_COMPUTE,
    PYTHON_ENGINE_DISK_MIB,
    VLLM_CC_FROM_0_20,
    VLLM_LAST_FOR_VOLTA,
    cuda_lines,
    driver_at_least,
    driver_runs,
    gpu_builds,
    version_tuple,
)

Severity = Literal["blocking", "warning", "info", "ok"]
SEVERITY_ORDER: dict[str, int] = {"blocking": 0, "warning": 1, "info": 2, "ok": 3}

_GIB = 1024  # MiB
VLLM_DISK_MIB = PYTHON_ENGINE_DISK_MIB["vllm"]  # torch, CUDA libraries, kernels
WEIGHTS_LOW_MIB = 10 * _GIB  # below this, the directory fetched weights land in is warned
SKEW_WARN_S = 5.0
SKEW_BLOCK_S = 60.0  # short-lived certificates and heartbeat timeouts break past this
CERT_WARN_S = 7 * 86400.0


# --- CUDA builds and what each engine needs: read from core.builds, the one table ------------


@dataclass(frozen=True)
class CudaBuild:
    name: str
    min_driver: str  # the Linux driver NVIDIA names for it


def cuda_builds(arch: str = "x86_64") -> tuple[CudaBuild, ...]:
    """The CUDA lines llmgw installs builds of on an ``arch`` node, oldest first."""
    lines = {line for engine in engine_names.INSTALLABLE for line in cuda_lines(engine, arch)}
    return tuple(CudaBuild(f"CUDA {line}", CUDA_DRIVER_FLOORS[line])
                 for line in sorted(lines, key=version_tuple))


_SHOWN = {"vulkan": "Vulkan"}


def driver_floor(engine: str, arch: str = "x86_64", version: str = "") -> str:
    """The oldest driver that runs at least one of ``engine``'s CUDA builds."""
    return min((CUDA_DRIVER_FLOORS[line] for line in cuda_lines(engine, arch, version)),
               key=version_tuple)


def _fallback(engine: str, arch: str, driver: str, version: str = "") -> str:
    """The GPU build ``engine`` would use where the driver runs none of its CUDA builds
    (llama.cpp's Vulkan), or ""."""
    runs = [b for b in gpu_builds(engine, arch, version) if driver_runs(b, driver)]
    return "" if any(b in CUDA_LINES for b in runs) or not runs else runs[0]


# --- verdicts (pure) --------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    severity: Severity
    check: str  # a short stable id: "avx2", "nvidia-driver", "clock-skew"
    summary: str  # what is wrong (or right), with the numbers measured
    fix: str = ""  # what the operator does


@dataclass(frozen=True)
class Capability:
    engine: str  # the adapter's name
    build: str  # "cpu", "cuda" or "" where an engine has one kind
    can: bool
    why: str


def _gib(mib: int | None) -> str:
    return "?" if mib is None else f"{mib / _GIB:.1f} GiB"


def _is_x86(arch: str) -> bool:
    return arch in ("x86_64", "amd64", "i386", "i686")


def _is_arm(arch: str) -> bool:
    return arch in ("aarch64", "arm64") or arch.startswith("armv")


def blocks(findings: Sequence[Finding]) -> bool:
    return any(f.severity == "blocking" for f in findings)


def exit_code(findings: Sequence[Finding]) -> int:
    """0: nothing blocks the node; 1: something does."""
    return 1 if blocks(findings) else 0


def sort_findings(findings: Sequence[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


def checks(facts: Facts, config: AgentConfig | None = None) -> list[Finding]:
    """Every check's verdict, blocking first."""
    found = [_avx2(facts), _driver(facts, config), _engine_disk(facts), *_weights(facts),
             *_fabric(facts, config), *_control_plane(facts), *_tls(facts, config)]
    return sort_findings(found)


def _avx2(f: Facts) -> Finding:
    if _is_arm(f.arch):
        simd = [x for x in f.cpu_flags if x in ("neon", "asimd", "sve")]
        return Finding("ok", "avx2", f"ARM CPU ({f.arch}) with {', '.join(simd) or 'NEON'}: "
                       "CPU engines use its vector unit")
    if not _is_x86(f.arch):
        return Finding("info", "avx2", f"{f.arch} CPU: llmgw's CPU engines are built for "
                       "x86_64 and ARM")
    if "avx2" in f.cpu_flags:
        return Finding("ok", "avx2", f"{f.cpu_model or 'the CPU'} has AVX2")
    where = "this VM's virtual CPU" if f.virtual else "this CPU"
    return Finding(
        "warning", "avx2",
        f"{where} ({f.cpu_model or 'unknown model'}) has no AVX2: CPU engines (llama.cpp) "
        "run several times slower, and profiles with require_avx2 will not be placed here",
        "in a VM, give it the host's CPU model: libvirt <cpu mode='host-passthrough'/>, "
        "Proxmox `cpu: host`, or a model with AVX2 such as x86-64-v3 (QEMU -cpu host or "
        "Haswell and newer); then power the VM off and on. On bare metal the CPU predates "
        "AVX2 (before Intel Haswell / AMD Excavator): use GPU engines or another node")


def _driver(f: Facts, config: AgentConfig | None) -> Finding:
    report = f.gpus
    if not report.gpus:
        note = f" ({report.note})" if report.note else ""
        return Finding("info", "nvidia-driver",
                       f"no NVIDIA GPUs{note}: a CPU-only node (sim, llama.cpp on the CPU)")
    if not report.driver:
        return Finding("warning", "nvidia-driver",
                       f"{len(report.gpus)} NVIDIA GPU(s) but NVML gave no driver version: "
                       "cannot tell which CUDA builds run here",
                       "check `nvidia-smi`; reinstall the NVIDIA driver if it fails")
    builds = cuda_builds(f.arch)
    ruled_out = [b for b in builds if not driver_at_least(report.driver, b.min_driver)]
    if not ruled_out:
        return Finding("ok", "nvidia-driver", f"driver {report.driver} (CUDA "
                       f"{report.cuda or '?'}) runs every CUDA build llmgw installs")
    newest = max((b.min_driver for b in builds), key=version_tuple)
    fix = (f"install NVIDIA driver {newest} or newer (the {newest.split('.')[0]} branch runs "
           "every CUDA build llmgw installs) from your distribution or NVIDIA, then reboot")
    disabled = set(config.disable_engines) if config else set()
    lost, fallbacks = [], []
    for engine in sorted(engine_names.INSTALLABLE):
        if not cuda_lines(engine, f.arch) or driver_at_least(report.driver,
                                                            driver_floor(engine, f.arch)):
            continue
        fallback = _fallback(engine, f.arch, report.driver)
        if fallback and engine not in disabled:
            fallbacks.append(f"{engine} would use its {_SHOWN.get(fallback, fallback)} build")
        else:
            lost.append(engine)
    effects = "; ".join(([f"{', '.join(lost)} cannot run here"] if lost else []) + fallbacks)
    if len(ruled_out) < len(builds):
        ruled = ", ".join(f"{b.name} (needs ≥ {b.min_driver})" for b in ruled_out)
        return Finding("warning", "nvidia-driver", f"driver {report.driver} rules out "
                       f"{ruled}{': ' + effects if effects else ''}", fix)
    every = (f"driver {report.driver} is older than every CUDA build llmgw installs (needs ≥ "
             f"{min((b.min_driver for b in builds), key=version_tuple)})")
    if fallbacks:  # the node still serves, on a build that needs no CUDA driver
        return Finding("warning", "nvidia-driver", f"{every}: {effects}", fix)
    return Finding("blocking", "nvidia-driver", f"{every}, and no enabled engine has a build "
                   f"for these GPUs on {f.arch} that needs no CUDA: upgrade the NVIDIA driver",
                   fix)


def _engine_disk(f: Facts) -> Finding:
    d = f.engine_dir
    if d.free_mib is None:
        return Finding("warning", "disk-vllm", d.error or f"cannot measure {d.measured}",
                       "check the filesystem of the agent's state_dir")
    if d.free_mib < VLLM_DISK_MIB:
        return Finding("warning", "disk-vllm",
                       f"vLLM needs about {VLLM_DISK_MIB // _GIB} GiB; {_gib(d.free_mib)} free "
                       f"on {d.measured} (the agent's state_dir is {d.path})",
                       "free space there, or point state_dir in agent.yaml at a larger "
                       "filesystem; llama.cpp and sim need far less")
    return Finding("ok", "disk-vllm", f"{_gib(d.free_mib)} free on {d.measured}: room for vLLM")


def _weights(f: Facts) -> list[Finding]:
    target = next((d for d in f.weights if not d.shared), None)
    found = []
    for d in f.weights:
        kind = "shared " if d.shared else ""
        if d.exists and not d.is_dir:
            found.append(Finding("warning", "weights-dirs", f"{d.path} is not a directory",
                                 "fix weights.directories in agent.yaml"))
        elif not d.writable and d is target:
            where = d.path if d.exists else f"{d.measured} (to create {d.path})"
            found.append(Finding(
                "warning", "weights-dirs",
                f"fetched weights land in {d.path}, but {where} is not writable by "
                f"{f.user or 'this user'}", "give the agent's user write access, or list a "
                "writable directory first in weights.directories"))
        elif not d.exists and not d.writable:
            found.append(Finding("warning", "weights-dirs",
                                 f"{kind}weights directory {d.path} does not exist and cannot "
                                 f"be created ({d.measured} is not writable)",
                                 f"create {d.path}, or remove it from weights.directories"))
        elif d is target and d.free_mib is not None and d.free_mib < WEIGHTS_LOW_MIB:
            found.append(Finding("warning", "weights-dirs",
                                 f"fetched weights land in {d.path}; only {_gib(d.free_mib)} "
                                 f"free on {d.measured}",
                                 "free space, or list a larger directory first"))
        elif d.error:
            found.append(Finding("warning", "weights-dirs", d.error))
    if found:
        return found
    listed = "; ".join(
        f"{d.path}{' (shared)' if d.shared else ''}: {_gib(d.free_mib)} free"
        + ("" if d.exists else ", created at start") for d in f.weights)
    return [Finding("ok", "weights-dirs", listed or "no weights directories")]


def _fabric(f: Facts, config: AgentConfig | None) -> list[Finding]:
    fabric = config.fabric if config else None
    active = [p for p in f.infiniband if p.state == "ACTIVE"]
    if fabric and not f.infiniband:
        return [Finding("warning", "fabric", f"fabric {fabric} is configured but this node "
                        "has no RDMA adapter (no ports under /sys/class/infiniband)",
                        "load the adapter's driver (mlx5_ib), or remove fabric from "
                        "agent.yaml")]
    if fabric and not active:
        ports = ", ".join(f"{p.adapter}/{p.port} {p.state or '?'}" for p in f.infiniband)
        return [Finding("warning", "fabric", f"fabric {fabric} is configured but no RDMA port "
                        f"is ACTIVE ({ports})", "check the cable and the subnet manager "
                        "(`ibstat`; OpenSM must run somewhere on an InfiniBand fabric)")]
    if not fabric and active:
        return [Finding("info", "fabric", f"{len(active)} RDMA port(s) ACTIVE but no fabric "
                        "is configured: multi-node replicas will not be placed across it",
                        "set fabric: NAME in agent.yaml, the same on every node of the fabric")]
    if fabric:
        ports = ", ".join(f"{p.adapter}/{p.port} {p.rate_gbps:g} Gb/s {p.link_layer}"
                          for p in active)
        return [Finding("ok", "fabric", f"fabric {fabric}: {len(active)} RDMA port(s) ACTIVE "
                        f"({ports})")]
    return []


def _control_plane(f: Facts) -> list[Finding]:
    if not f.servers:
        return [Finding("info", "control-plane-route", "no control-plane address to check",
                        "pass --server URL, or --config agent.yaml")]
    routed = [s for s in f.servers if s.route]
    found = []
    if not routed:
        found.append(Finding(
            "blocking", "control-plane-route",
            "no route to any control plane: " + "; ".join(s.route_error for s in f.servers),
            "give this node a route to the control plane's network (`ip route`: a default "
            "route or one to its subnet), or correct servers in agent.yaml"))
        return found
    for s in f.servers:
        if s.route is None:
            found.append(Finding("warning", "control-plane-route",
                                 f"no route to {s.url}: {s.route_error}",
                                 "fix this node's routes to it, or remove it from servers"))
    first = routed[0].route
    via = f" through {first.gateway}" if first.gateway else ""
    found.append(Finding("ok", "control-plane-route",
                         f"this node is reached at {first.source} via {first.interface}"
                         f"{via} (route to {first.destination})"))
    tried = [s for s in routed if s.probe is not None]
    failed = [s for s in tried if not s.probe.ok]
    if failed:
        severity: Severity = "blocking" if len(failed) == len(tried) else "warning"
        which = "; ".join(f"{s.url}: {s.probe.error}" for s in failed)
        found.append(Finding(
            severity, "control-plane-reach",
            ("no control plane answers: " if severity == "blocking" else "not answering: ")
            + which, _reach_fix(failed)))
    answered = [s for s in tried if s.probe.ok]
    if answered:
        found.append(Finding("ok", "control-plane-reach", "; ".join(
            f"{s.url} answers in {s.probe.round_trip_s * 1000:.0f} ms" for s in answered)))
        found.append(_skew(answered))
    return found


def _reach_fix(failed: Sequence[ServerFact]) -> str:
    errors = " ".join(s.probe.error for s in failed if s.probe)
    if "TLS" in errors:
        return ("check that tls.ca_file is the cluster's CA and that the address matches "
                "the server certificate's name")
    if "refused" in errors:
        return ("start llmgw server there (or check its listen.host/port); a firewall that "
                "rejects would look the same")
    return ("check that llmgw server runs at that address and that no firewall drops the "
            "traffic (`curl URL/healthz` from this node)")


def _skew(answered: Sequence[ServerFact]) -> Finding:
    timed = [s for s in answered if s.probe.skew_s is not None]
    if not timed:
        return Finding("info", "clock-skew", "the control plane did not send its time (an "
                       "older llmgw server): clock skew not measured")
    worst = max(timed, key=lambda s: abs(s.probe.skew_s))
    skew = worst.probe.skew_s
    ahead = "behind" if skew > 0 else "ahead of"
    told = (f"this node's clock is {abs(skew):.1f} s {ahead} the control plane's at "
            f"{worst.url} (± {worst.probe.round_trip_s / 2:.2f} s)")
    fix = ("enable NTP on both machines (chrony or systemd-timesyncd: "
           "`timedatectl set-ntp true`) and check `chronyc tracking`")
    if abs(skew) > SKEW_BLOCK_S:
        return Finding("blocking", "clock-skew", f"{told}: over {SKEW_BLOCK_S:g} s, "
                       "certificates and heartbeat timeouts break", fix)
    if abs(skew) > SKEW_WARN_S:
        return Finding("warning", "clock-skew", f"{told}: over {SKEW_WARN_S:g} s", fix)
    return Finding("ok", "clock-skew", told)


def _tls(f: Facts, config: AgentConfig | None) -> list[Finding]:
    if config is None:
        return []
    if config.tls is None:
        if any(s.url.startswith("https://") for s in f.servers):
            return [Finding("warning", "tls-files", "an https control plane but no tls in "
                            "agent.yaml: the agent has no certificate to present",
                            "set tls.ca_file, tls.cert_file and tls.key_file")]
        return []
    tls = f.tls or TlsReport(())
    found = []
    for t in tls.files:
        if t.error:
            found.append(Finding("blocking", "tls-files",
                                 f"tls.{t.role} {t.path} cannot be read: {t.error}",
                                 _tls_fix(t, f.user)))
        elif t.problem:
            fix = (f"store it unencrypted (`openssl pkey -in {t.path} -out NEW.key`), readable "
                   "by the agent only" if "encrypted" in t.problem
                   else f"put the node's PEM file there, or fix tls.{t.role}")
            found.append(Finding("blocking", "tls-files", f"tls.{t.role} {t.path} {t.problem}",
                                 fix))
    if tls.key_matches is False:
        found.append(Finding("blocking", "tls-files", "tls.cert_file and tls.key_file do not "
                             f"belong together: {tls.file('key_file').path} is not the key "
                             f"{tls.file('cert_file').path} certifies",
                             "use the key the certificate was issued for"))
    if tls.issued_by_ca is False:
        found.append(Finding("blocking", "tls-files", f"certificate {tls.file('cert_file').path} "
                             f"is not issued by the CA in tls.ca_file "
                             f"{tls.file('ca_file').path}: {tls.issuer_problem}",
                             "issue the node a certificate from the cluster's CA, or point "
                             "tls.ca_file at the CA that issued it"))
    if tls.not_after is not None:
        found.extend(_cert_dates(tls, f.now))
    if not found and tls.files:
        root = (" (read as root, who reads any file: run the doctor as the agent's user to "
                "check its access)" if f.user.endswith("(uid 0)") else "")
        found.append(Finding("ok", "tls-files", "CA, certificate and key readable; the "
                             f"certificate names {tls.identity or 'no CN or URI'}, issued by "
                             f"the CA, valid until {_day(tls.not_after)}{root}"))
    return found


def _tls_fix(t: TlsFile, user: str) -> str:
    if t.errno == errno.ENOENT:
        return f"copy the node's file to {t.path}, or correct tls.{t.role} in agent.yaml"
    if t.errno == errno.EACCES:
        mode = f"mode {t.mode:04o}" if t.mode is not None else "its mode"
        return (f"it is owned by {t.owner or '?'} with {mode}, and the agent runs as "
                f"{user or 'another user'}: `chown` it to the agent's user, or `chmod 0640` "
                "it and add that user to its group (keep the key unreadable to others)")
    if t.errno == errno.EISDIR:
        return f"{t.path} is a directory: name the file inside it"
    return f"check {t.path} and tls.{t.role} in agent.yaml"


def _day(ts: float | None) -> str:
    return "?" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _cert_dates(tls: TlsReport, now: float) -> list[Finding]:
    path = tls.file("cert_file").path
    renew = "issue the node a new certificate and restart the agent"
    if tls.not_before is not None and tls.not_before > now:
        return [Finding("blocking", "tls-files", f"certificate {path} is not valid until "
                        f"{_day(tls.not_before)}", "check this node's clock (NTP), or " + renew)]
    left = tls.not_after - now
    if left <= 0:
        return [Finding("blocking", "tls-files",
                        f"certificate {path} expired {_day(tls.not_after)}", renew)]
    if left < CERT_WARN_S:
        return [Finding("warning", "tls-files", f"certificate {path} expires "
                        f"{_day(tls.not_after)}, in {left / 86400:.1f} days", renew)]
    return []


def can_run(facts: Facts, config: AgentConfig | None = None) -> list[Capability]:
    """What this node can run, and why not where it cannot: the one table of it."""
    disabled = set(config.disable_engines) if config else set()
    configured = set(config.engines) if config else set()
    report = facts.gpus
    capabilities = [report.compute_capability.get(g.uuid) for g in report.gpus]
    disk = facts.engine_dir.free_mib

    def gpu_engine(engine: str) -> tuple[bool, str]:
        if not report.gpus:
            return False, "no NVIDIA GPU"
        need = MIN_COMPUTE[engine]
        fit = [cc for cc in capabilities if cc is None or cc >= need]
        if not fit:
            best = max(c for c in capabilities if c)
            return False, (f"needs compute capability ≥ {need[0]}.{need[1]}; the best GPU "
                           f"here is {best[0]}.{best[1]}")
        known = [cc for cc in fit if cc]
        # Volta: only an older vLLM carries its kernels, with its own CUDA line.
        volta = engine == "vllm" and bool(known) and max(known) < VLLM_CC_FROM_0_20
        version = VLLM_LAST_FOR_VOLTA if volta else ""
        if not cuda_lines(engine, facts.arch, version):
            return False, f"{engine} publishes no GPU build for {facts.arch}"
        floor = driver_floor(engine, facts.arch, version)
        if not driver_at_least(report.driver, floor):
            fallback = _fallback(engine, facts.arch, report.driver, version)
            instead = (f": {engine} would use its {_SHOWN.get(fallback, fallback)} build"
                       if fallback else "")
            return False, f"driver {report.driver or '?'} is older than {floor}{instead}"
        need_mib = PYTHON_ENGINE_DISK_MIB.get(engine, 0)
        if engine not in configured and (disk or 0) < need_mib:
            return False, (f"installing it needs about {need_mib // _GIB} GiB; "
                           f"{_gib(disk)} free on {facts.engine_dir.measured}")
        why = f"{len(fit)} GPU(s) fit, driver {report.driver}"
        if volta:
            why += (f"; only vLLM {VLLM_LAST_FOR_VOLTA} is built for compute capability "
                    f"{max(known)[0]}.{max(known)[1]}: give this node that version in "
                    "engine_overrides")
        return True, why

    if _is_arm(facts.arch) or "avx2" in facts.cpu_flags:
        cpu = (True, "vector extensions: " + (" ".join(facts.cpu_flags) or "none"))
    elif _is_x86(facts.arch):
        cpu = (True, "no AVX2: several times slower")
    else:
        cpu = (False, f"no build for {facts.arch}")
    # llama.cpp alone also has a CPU build; every installable engine has a GPU row.
    rows = [*((name, "", (True, "built into llmgw")) for name in engine_names.BUILTIN),
            ("llama.cpp", "cpu", cpu),
            *((name, "cuda" if name == "llama.cpp" else "", gpu_engine(name))
              for name in engine_names.INSTALLABLE)]
    return [Capability(engine, build, False, "disabled in agent.yaml (disable_engines)")
            if engine in disabled else Capability(engine, build, ok, why)
            for engine, build, (ok, why) in rows]
