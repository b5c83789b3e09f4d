"""The doctor's verdicts, on facts gathered from fakes shaped like the real sources: an
NVML fake with 0, 1 and 8 GPUs, cpuinfo files as QEMU and an ARM server write them, a
sysfs-shaped InfiniBand tree, a fixed clock, and a /healthz probe that answers as told."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from llmgw.agent import doctor
from llmgw.agent.discovery import host
from llmgw.agent.discovery.tls import TlsFile, TlsReport
from llmgw.cli import doctor as doctor_cli
from llmgw.config import AgentConfig, parse
from llmgw.core import engine_names
from tests.fakes.nvml import FakeNvml, fake_h100_x8, fake_no_library, fake_single_4090
from tests.unit.test_tls_files import Issued, issue

SYSFS_IB = Path(__file__).resolve().parents[1] / "data" / "sysfs" / "infiniband"
NOW = 1_760_000_000.0
GIB = 1024

# /proc/cpuinfo of a VM on QEMU's default CPU model (qemu64): no AVX at all.
QEMU64_CPUINFO = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 15
model\t\t: 107
model name\t: QEMU Virtual CPU version 2.5+
stepping\t: 1
microcode\t: 0x1000065
cpu MHz\t\t: 2894.562
cache size\t: 512 KB
physical id\t: 0
siblings\t: 1
core id\t\t: 0
cpu cores\t: 1
apicid\t\t: 0
initial apicid\t: 0
fpu\t\t: yes
fpu_exception\t: yes
cpuid level\t: 13
wp\t\t: yes
flags\t\t: fpu de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush \
mmx fxsr sse sse2 syscall nx lm rep_good nopl cpuid extd_apicid tsc_known_freq pni cx16 \
x2apic hypervisor lahf_lm cmp_legacy 3dnowprefetch vmmcall
bugs\t\t: fxsave_leak sysret_ss_attrs spectre_v1 spectre_v2 spec_store_bypass retbleed
bogomips\t: 5789.12
TLB size\t: 1024 4K pages
clflush size\t: 64
cache_alignment\t: 64
address sizes\t: 40 bits physical, 48 bits virtual
power management:

"""
# A bare-metal Xeon (Skylake-SP): AVX2 and AVX-512, no hypervisor flag.
XEON_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat sse sse2 ssse3 \
fma cx16 sse4_1 sse4_2 popcnt aes xsave avx f16c rdrand avx2 bmi1 bmi2 avx512f avx512bw \
avx512vl

"""
# An Ampere Altra (Neoverse-N1): "Features", not "flags"; no model name.
ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid \
asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1

"""
OS_RELEASE = """\
PRETTY_NAME="Ubuntu 24.04.2 LTS"
NAME="Ubuntu"
VERSION_ID="24.04"
ID=ubuntu
ID_LIKE=debian
"""


def gpu(name: str, cc: tuple[int, int], bus: str, total_mib: int = 24564) -> dict:
    return {"name": name, "uuid": f"GPU-{bus}-0000", "bus_id": f"00000000:{bus}:00.0",
            "total_mib": total_mib, "free_mib": total_mib - 300, "cc": cc, "processes": []}


def route_ok(url: str) -> host.Route:
    return host.Route("10.0.0.1", "10.0.0.5", "eth0", "10.0.0.254")


def no_route(url: str) -> host.Route:
    raise host.NoRoute(f"no route to {url} (10.0.0.1: Network is unreachable)")


def answering(skew_s: float = 0.0, round_trip_s: float = 0.004):
    """A /healthz that answers with a server clock ``skew_s`` ahead of ours."""

    def probe(url, context, timeout_s, clock):
        sent = clock()
        received = sent + round_trip_s
        return doctor.Probe(True, status=200, server_time=sent + round_trip_s / 2 + skew_s,
                            sent_at=sent, received_at=received)

    return probe


def refusing(url, context, timeout_s, clock):
    return doctor.Probe(False, "connection refused: nothing listens on 10.0.0.1:8080",
                        sent_at=clock(), received_at=clock())


def untimed(url, context, timeout_s, clock):
    return doctor.Probe(True, status=200, sent_at=clock(), received_at=clock())


def plenty(path: str) -> tuple[int, int]:
    return 500 * GIB, 300 * GIB


def make_sources(tmp_path: Path, *, cpuinfo: str = XEON_CPUINFO, arch: str = "x86_64",
                 **overrides) -> doctor.Sources:
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    (tmp_path / "os-release").write_text(OS_RELEASE)
    base = dict(nvml=fake_no_library(), cpuinfo=tmp_path / "cpuinfo",
                os_release=tmp_path / "os-release", infiniband_root=tmp_path / "no-ib",
                arch=arch, clock=lambda: NOW, probe=answering(), route=route_ok, disk=plenty,
                memory=lambda: (64 * GIB, 60 * GIB))
    return doctor.Sources(**{**base, **overrides})


def agent_config(tmp_path: Path, **fields) -> AgentConfig:
    data = {"servers": ["http://10.0.0.1:8080"], "state_dir": str(tmp_path / "agent"),
            "weights": {"directories": [{"path": str(tmp_path / "weights")}]}, **fields}
    return parse(data, AgentConfig)


def run_doctor(tmp_path, config=None, servers=None, **overrides):
    facts = doctor.gather(config, servers, make_sources(tmp_path, **overrides))
    return facts, doctor.checks(facts, config), doctor.can_run(facts, config)


def finding(findings, check: str) -> doctor.Finding:
    (found,) = [f for f in findings if f.check == check]
    return found


def can(capabilities, engine: str, build: str = "") -> doctor.Capability:
    (found,) = [c for c in capabilities if c.engine == engine and c.build == build]
    return found


# --- GPUs and the driver --------------------------------------------------------------------


def test_no_gpus_is_a_cpu_only_node_with_nvmls_reason(tmp_path):
    facts, findings, capabilities = run_doctor(tmp_path, nvml=fake_no_library())
    assert facts.gpus.gpus == ()
    driver = finding(findings, "nvidia-driver")
    assert driver.severity == "info"
    assert "no NVML library" in driver.summary and "CPU-only" in driver.summary
    assert can(capabilities, "sim").can
    assert can(capabilities, "llama.cpp", "cpu").can
    for engine, build in (("llama.cpp", "cuda"), ("vllm", ""), ("sglang", ""), ("comfyui", "")):
        assert can(capabilities, engine, build) == doctor.Capability(
            engine, build, False, "no NVIDIA GPU")
    assert doctor.exit_code(findings) == 0


def test_a_driver_with_no_gpus_is_still_a_cpu_only_node(tmp_path):
    _, findings, _ = run_doctor(tmp_path, nvml=FakeNvml([]))
    assert finding(findings, "nvidia-driver").severity == "info"
    assert "no GPUs" in finding(findings, "nvidia-driver").summary


def test_one_4090_on_a_570_driver_keeps_only_llama_cpps_cuda_12_8_build(tmp_path):
    facts, findings, capabilities = run_doctor(tmp_path, nvml=fake_single_4090())
    assert [g.name for g in facts.gpus.gpus] == ["NVIDIA GeForce RTX 4090"]
    driver = finding(findings, "nvidia-driver")
    assert driver.severity == "warning"
    # vLLM, SGLang and ComfyUI publish cu130 and cu129 builds; llama.cpp also one for 12.8.
    assert driver.summary == ("driver 570.172.08 rules out CUDA 12.9 (needs ≥ 575.51.03), "
                              "CUDA 13.0 (needs ≥ 580.65.06): comfyui, sglang, vllm cannot "
                              "run here")
    assert "580.65.06" in driver.fix and "the 580 branch" in driver.fix
    assert can(capabilities, "llama.cpp", "cuda").can
    for engine in ("vllm", "sglang", "comfyui"):
        assert can(capabilities, engine) == doctor.Capability(
            engine, "", False, "driver 570.172.08 is older than 575.51.03")
    assert doctor.exit_code(findings) == 0


def test_a_575_driver_rules_out_cuda_13_and_keeps_every_engine(tmp_path):
    l40 = FakeNvml([gpu("NVIDIA L40S", (8, 9), "41", 46068)], driver="575.57.08", cuda=12090)
    _, findings, capabilities = run_doctor(tmp_path, nvml=l40)
    driver = finding(findings, "nvidia-driver")
    assert driver.severity == "warning"
    assert driver.summary == "driver 575.57.08 rules out CUDA 13.0 (needs ≥ 580.65.06)"
    assert all(c.can for c in capabilities)


def test_eight_h100s_on_a_580_driver_run_everything(tmp_path):
    facts, findings, capabilities = run_doctor(tmp_path, nvml=fake_h100_x8())
    assert len(facts.gpus.gpus) == 8
    assert finding(findings, "nvidia-driver").severity == "ok"
    assert all(c.can for c in capabilities)
    assert can(capabilities, "vllm").why == "8 GPU(s) fit, driver 580.65.06"
    assert doctor.exit_code(findings) == 0


def old_driver_t4() -> FakeNvml:
    return FakeNvml([gpu("Tesla T4", (7, 5), "3B", 15360)], driver="535.247.01", cuda=12020)


def test_a_driver_older_than_every_cuda_build_leaves_llama_cpp_on_vulkan(tmp_path):
    _, findings, capabilities = run_doctor(tmp_path, nvml=old_driver_t4())
    driver = finding(findings, "nvidia-driver")
    assert driver.severity == "warning"  # narrower, not stopped: llama.cpp still serves
    assert driver.summary == ("driver 535.247.01 is older than every CUDA build llmgw installs "
                              "(needs ≥ 570.26): comfyui, sglang, vllm cannot run here; "
                              "llama.cpp would use its Vulkan build")
    assert can(capabilities, "llama.cpp", "cuda") == doctor.Capability(
        "llama.cpp", "cuda", False,
        "driver 535.247.01 is older than 570.26: llama.cpp would use its Vulkan build")
    assert not any(c.can for c in capabilities if c.engine in ("vllm", "sglang", "comfyui"))
    assert doctor.exit_code(findings) == 0


def test_a_driver_older_than_every_cuda_build_blocks_without_llama_cpp(tmp_path):
    config = agent_config(tmp_path, disable_engines=["llama.cpp"])
    _, findings, _ = run_doctor(tmp_path, config, nvml=old_driver_t4())
    driver = finding(findings, "nvidia-driver")
    assert driver.severity == "blocking"
    assert driver.summary == ("driver 535.247.01 is older than every CUDA build llmgw installs "
                              "(needs ≥ 570.26), and no enabled engine has a build for these "
                              "GPUs on x86_64 that needs no CUDA: upgrade the NVIDIA driver")
    assert doctor.exit_code(findings) == 1


def test_an_arm_gpu_node_has_no_vulkan_fallback_so_an_old_driver_blocks(tmp_path):
    gh200 = FakeNvml([gpu("NVIDIA GH200 480GB", (9, 0), "09", 97871)], driver="570.195.03",
                     cuda=12080)
    _, findings, capabilities = run_doctor(tmp_path, nvml=gh200, cpuinfo=ARM_CPUINFO,
                                           arch="aarch64")
    driver = finding(findings, "nvidia-driver")
    # On ARM llama.cpp publishes no GPU build and vLLM only cu130: 12.9 is the oldest line.
    assert driver.severity == "blocking"
    assert driver.summary.startswith("driver 570.195.03 is older than every CUDA build llmgw "
                                     "installs (needs ≥ 575.51.03), and no enabled engine")
    assert can(capabilities, "vllm").why == "driver 570.195.03 is older than 580.65.06"
    assert can(capabilities, "llama.cpp", "cuda").why == (
        "llama.cpp publishes no GPU build for aarch64")
    assert doctor.exit_code(findings) == 1


def test_compute_capability_decides_vllm_and_sglang(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "v").mkdir()
    pascal = FakeNvml([gpu("NVIDIA GeForce GTX 1080 Ti", (6, 1), "01", 11264)])
    _, _, capabilities = run_doctor(tmp_path / "p", nvml=pascal)
    assert can(capabilities, "vllm").why == ("needs compute capability ≥ 7.0; the best GPU "
                                             "here is 6.1")
    assert can(capabilities, "llama.cpp", "cuda").can

    # Volta: vLLM 0.19.1 is the last built for 7.0, on CUDA 12.8, so a 570 driver is enough.
    volta = FakeNvml([gpu("Tesla V100-SXM2-32GB", (7, 0), "02", 32768)], driver="570.195.03")
    _, _, capabilities = run_doctor(tmp_path / "v", nvml=volta)
    assert can(capabilities, "vllm").can
    assert can(capabilities, "vllm").why == (
        "1 GPU(s) fit, driver 570.195.03; only vLLM 0.19.1 is built for compute capability "
        "7.0: give this node that version in engine_overrides")
    assert not can(capabilities, "sglang").can
    assert "7.5" in can(capabilities, "sglang").why


# --- CPU ------------------------------------------------------------------------------------


def test_a_vm_cpu_without_avx2_warns_with_the_cpu_model_fix(tmp_path):
    facts, findings, capabilities = run_doctor(tmp_path, cpuinfo=QEMU64_CPUINFO)
    assert facts.cpu_model == "QEMU Virtual CPU version 2.5+"
    assert "avx2" not in facts.cpu_flags
    assert facts.virtual
    avx2 = finding(findings, "avx2")
    assert avx2.severity == "warning"
    assert "this VM's virtual CPU (QEMU Virtual CPU version 2.5+) has no AVX2" in avx2.summary
    assert "several times slower" in avx2.summary
    for words in ("<cpu mode='host-passthrough'/>", "cpu: host", "x86-64-v3"):
        assert words in avx2.fix
    assert can(capabilities, "llama.cpp", "cpu") == doctor.Capability(
        "llama.cpp", "cpu", True, "no AVX2: several times slower")
    assert doctor.exit_code(findings) == 0  # slower is not blocked


def test_a_cpu_with_avx2_is_fine(tmp_path):
    facts, findings, _ = run_doctor(tmp_path, cpuinfo=XEON_CPUINFO)
    assert not facts.virtual
    assert {"avx2", "avx512f", "fma"} <= set(facts.cpu_flags)
    assert finding(findings, "avx2").severity == "ok"


def test_arm_with_asimd_needs_no_avx2(tmp_path):
    facts, findings, capabilities = run_doctor(tmp_path, cpuinfo=ARM_CPUINFO, arch="aarch64")
    assert "asimd" in facts.cpu_flags
    avx2 = finding(findings, "avx2")
    assert avx2.severity == "ok"
    assert "asimd" in avx2.summary
    assert can(capabilities, "llama.cpp", "cpu").can


def test_os_release_and_memory_come_from_their_sources(tmp_path):
    facts, _, _ = run_doctor(tmp_path)
    assert facts.os_release["ID"] == "ubuntu"
    payload = doctor_cli.describe(facts)
    assert (payload["os"], payload["os_family"]) == ("ubuntu 24.04", "debian")
    assert (payload["ram_total_mib"], payload["ram_available_mib"]) == (64 * GIB, 60 * GIB)


# --- disks ----------------------------------------------------------------------------------


def test_too_little_disk_for_vllm_warns_and_rules_it_out(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    config = agent_config(tmp_path, state_dir=str(tmp_path / "a" / "b" / "state"))
    _, findings, capabilities = run_doctor(
        tmp_path, config, nvml=fake_h100_x8(), disk=lambda path: (100 * GIB, 12 * GIB))
    disk = finding(findings, "disk-vllm")
    assert disk.severity == "warning"
    # The state_dir does not exist yet: its nearest existing parent is measured.
    assert disk.summary.startswith(
        f"vLLM needs about 25 GiB; 12.0 GiB free on {tmp_path / 'a' / 'b'}")
    assert not can(capabilities, "vllm").can
    assert "12.0 GiB free" in can(capabilities, "vllm").why
    assert can(capabilities, "comfyui").can  # its environment takes about 10 GiB
    assert can(capabilities, "llama.cpp", "cuda").can


def test_an_installed_vllm_needs_no_room_to_install(tmp_path):
    config = agent_config(tmp_path, engines={"vllm": {"binary": "/opt/vllm/bin/vllm"}})
    _, _, capabilities = run_doctor(tmp_path, config, nvml=fake_h100_x8(),
                                    disk=lambda path: (100 * GIB, 12 * GIB))
    assert can(capabilities, "vllm").can


def test_disabled_engines_cannot_run(tmp_path):
    config = agent_config(tmp_path, disable_engines=["vllm"])
    _, _, capabilities = run_doctor(tmp_path, config, nvml=fake_h100_x8())
    assert can(capabilities, "vllm") == doctor.Capability(
        "vllm", "", False, "disabled in agent.yaml (disable_engines)")


def test_weights_directories(tmp_path):
    (tmp_path / "weights-file").write_text("not a directory")
    (tmp_path / "shared").mkdir()
    config = agent_config(tmp_path, weights={"directories": [
        {"path": str(tmp_path / "shared"), "shared": True},
        {"path": str(tmp_path / "local" / "weights")},
    ]})
    _, findings, _ = run_doctor(tmp_path, config)
    ok = finding(findings, "weights-dirs")
    assert ok.severity == "ok"
    assert f"{tmp_path / 'shared'} (shared): 300.0 GiB free" in ok.summary
    assert f"{tmp_path / 'local' / 'weights'}: 300.0 GiB free, created at start" in ok.summary

    config = agent_config(tmp_path, weights={"directories": [
        {"path": str(tmp_path / "weights-file")}]})
    _, findings, _ = run_doctor(tmp_path, config)
    assert finding(findings, "weights-dirs").summary.endswith("is not a directory")

    _, findings, _ = run_doctor(tmp_path, agent_config(tmp_path),
                                disk=lambda path: (100 * GIB, 4 * GIB))
    low = finding(findings, "weights-dirs")
    assert low.severity == "warning"
    assert low.summary == (f"fetched weights land in {tmp_path / 'weights'}; only 4.0 GiB free "
                           f"on {tmp_path}")


def test_a_fetch_directory_that_is_not_writable_warns():
    # Root may write anywhere, so the unwritable case is built as facts, not as a chmod.
    facts = _facts(weights=(
        doctor.DirFact("/srv/filer", "/srv/filer", True, True, False, 1, 1, shared=True),
        doctor.DirFact("/var/lib/llmgw-weights", "/var/lib", False, False, False, 9, 9),
    ), user="llmgw (uid 998)")
    warning = finding(doctor.checks(facts), "weights-dirs")
    assert warning.severity == "warning"
    assert warning.summary == ("fetched weights land in /var/lib/llmgw-weights, but /var/lib "
                               "(to create /var/lib/llmgw-weights) is not writable by llmgw "
                               "(uid 998)")


# --- fabric ---------------------------------------------------------------------------------


def test_fabric_against_the_rdma_ports(tmp_path):
    config = agent_config(tmp_path, fabric="ib-a")
    facts, findings, _ = run_doctor(tmp_path, config, infiniband_root=SYSFS_IB)
    assert [p.state for p in facts.infiniband] == ["ACTIVE", "DOWN"]
    assert finding(findings, "fabric") == doctor.Finding(
        "ok", "fabric", "fabric ib-a: 1 RDMA port(s) ACTIVE (mlx5_0/1 400 Gb/s InfiniBand)")

    _, findings, _ = run_doctor(tmp_path, agent_config(tmp_path), infiniband_root=SYSFS_IB)
    assert finding(findings, "fabric").severity == "info"

    _, findings, _ = run_doctor(tmp_path, config)  # no /sys/class/infiniband at all
    assert finding(findings, "fabric").severity == "warning"
    assert "no RDMA adapter" in finding(findings, "fabric").summary


# --- the control plane ----------------------------------------------------------------------


def test_no_server_given_is_said_not_blocked(tmp_path):
    _, findings, _ = run_doctor(tmp_path)
    route = finding(findings, "control-plane-route")
    assert route.severity == "info"
    assert "--server" in route.fix


def test_the_route_names_our_address(tmp_path):
    facts, findings, _ = run_doctor(tmp_path, servers=["http://10.0.0.1:8080"])
    assert finding(findings, "control-plane-route").summary == (
        "this node is reached at 10.0.0.5 via eth0 through 10.0.0.254 (route to 10.0.0.1)")
    assert finding(findings, "control-plane-reach").severity == "ok"
    assert facts.servers[0].route == route_ok("")


def test_no_route_to_any_server_blocks(tmp_path):
    facts, findings, _ = run_doctor(tmp_path, agent_config(tmp_path), route=no_route)
    route = finding(findings, "control-plane-route")
    assert route.severity == "blocking"
    assert "Network is unreachable" in route.summary
    assert facts.servers[0].probe is None  # nothing is sent where there is no route
    assert not [f for f in findings if f.check == "control-plane-reach"]
    assert doctor.exit_code(findings) == 1


def test_a_route_to_one_server_of_two_warns(tmp_path):
    def one(url):
        return route_ok(url) if "first" in url else no_route(url)

    _, findings, _ = run_doctor(tmp_path, servers=["http://first:8080", "http://second:8080"],
                                route=one)
    severities = sorted(f.severity for f in findings if f.check == "control-plane-route")
    assert severities == ["ok", "warning"]
    assert doctor.exit_code(findings) == 0


def test_no_control_plane_answering_blocks(tmp_path):
    _, findings, _ = run_doctor(tmp_path, agent_config(tmp_path), probe=refusing)
    reach = finding(findings, "control-plane-reach")
    assert reach.severity == "blocking"
    assert "connection refused" in reach.summary
    assert "start llmgw server" in reach.fix
    assert doctor.exit_code(findings) == 1


def test_one_control_plane_of_two_answering_warns(tmp_path):
    def one(url, context, timeout_s, clock):
        return (answering() if "first" in url else refusing)(url, context, timeout_s, clock)

    _, findings, _ = run_doctor(tmp_path, servers=["http://first:8080", "http://second:8080"],
                                probe=one)
    reach = sorted((f.severity, f.summary) for f in findings if f.check == "control-plane-reach")
    assert [s for s, _ in reach] == ["ok", "warning"]
    assert doctor.exit_code(findings) == 0


# --- clock skew -----------------------------------------------------------------------------


def test_skew_is_the_server_time_against_the_middle_of_the_round_trip():
    probe = doctor.Probe(True, server_time=1007.2, sent_at=1000.0, received_at=1000.4)
    assert probe.skew_s == pytest.approx(7.0)
    assert probe.round_trip_s == pytest.approx(0.4)
    assert doctor.Probe(True, sent_at=1.0, received_at=2.0).skew_s is None


@pytest.mark.parametrize(("skew", "severity"), [
    (0.3, "ok"), (-4.9, "ok"), (7.0, "warning"), (-30.0, "warning"), (61.0, "blocking"),
    (-3600.0, "blocking"),
])
def test_clock_skew_thresholds(tmp_path, skew, severity):
    _, findings, _ = run_doctor(tmp_path, servers=["http://10.0.0.1:8080"],
                                probe=answering(skew))
    found = finding(findings, "clock-skew")
    assert found.severity == severity
    assert f"{abs(skew):.1f} s" in found.summary
    assert ("behind" if skew > 0 else "ahead of") in found.summary
    if severity != "ok":
        assert "NTP" in found.fix and "chrony" in found.fix


def test_a_server_that_sends_no_time_is_not_judged(tmp_path):
    _, findings, _ = run_doctor(tmp_path, servers=["http://10.0.0.1:8080"], probe=untimed)
    assert finding(findings, "clock-skew").severity == "info"


# --- TLS files ------------------------------------------------------------------------------


def tls_config(tmp_path, ca, cert, key) -> AgentConfig:
    return agent_config(tmp_path, tls={"ca_file": str(ca), "cert_file": str(cert),
                                       "key_file": str(key)})


def test_a_missing_tls_file_blocks_and_names_it(tmp_path):
    pem = tmp_path / "ca.pem"
    pem.write_text("not used")
    config = tls_config(tmp_path, tmp_path / "missing-ca.pem", pem, pem)
    facts, findings, _ = run_doctor(tmp_path, config)
    ca = facts.tls.file("ca_file")
    assert (ca.role, ca.errno) == ("ca_file", errno.ENOENT)
    problem = next(f for f in findings if str(tmp_path / "missing-ca.pem") in f.summary)
    assert problem.severity == "blocking"
    assert problem.summary == (f"tls.ca_file {tmp_path / 'missing-ca.pem'} cannot be read: "
                               "No such file or directory")
    assert "copy the node's file" in problem.fix
    assert doctor.exit_code(findings) == 1


def test_a_directory_where_a_tls_file_should_be_blocks(tmp_path):
    (tmp_path / "certs").mkdir()
    config = tls_config(tmp_path, tmp_path / "certs", tmp_path / "certs", tmp_path / "certs")
    facts, findings, _ = run_doctor(tmp_path, config)
    assert {t.errno for t in facts.tls.files} == {errno.EISDIR}
    tls = [f for f in findings if f.check == "tls-files"]
    assert len(tls) == 3 and {f.severity for f in tls} == {"blocking"}
    assert all("Is a directory" in f.summary and "is a directory" in f.fix for f in tls)


def test_files_that_are_not_pem_block(tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("this is not a certificate\n")
    _, findings, _ = run_doctor(tmp_path, tls_config(tmp_path, junk, junk, junk))
    summaries = sorted(f.summary for f in findings if f.check == "tls-files")
    assert summaries == [f"tls.ca_file {junk} holds no PEM certificate",
                         f"tls.cert_file {junk} holds no PEM certificate",
                         f"tls.key_file {junk} holds no PEM private key"]


def test_permission_denied_says_who_owns_the_file():
    # Root reads any file whatever its mode, so this case is built as facts.
    facts = _facts(tls=TlsReport((
        TlsFile("key_file", "/etc/llmgw/node.key", "Permission denied", errno.EACCES, "root",
                0o600),)), user="llmgw (uid 998)")
    config = parse({"servers": ["https://cp:8443"], "tls": {
        "ca_file": "/etc/llmgw/ca.pem", "cert_file": "/etc/llmgw/node.pem",
        "key_file": "/etc/llmgw/node.key"}}, AgentConfig)
    found = finding(doctor.checks(facts, config), "tls-files")
    assert found.severity == "blocking"
    assert found.summary == "tls.key_file /etc/llmgw/node.key cannot be read: Permission denied"
    assert "owned by root with mode 0600" in found.fix
    assert "llmgw (uid 998)" in found.fix and "chmod 0640" in found.fix


def test_https_without_tls_files_warns(tmp_path):
    config = agent_config(tmp_path, servers=["https://cp.example:8443"])
    _, findings, _ = run_doctor(tmp_path, config)
    assert finding(findings, "tls-files").severity == "warning"


def pki(tmp_path: Path, **node) -> tuple[Issued, Issued]:
    """The cluster's CA and a node certificate it issued, valid as of NOW unless told."""
    ca = issue(tmp_path, "llmgw CA", now=NOW, ca=True, days_left=3650)
    return ca, issue(tmp_path, "node01", ca, now=NOW, **node)


def tls_run(tmp_path: Path, ca: Issued, cert: Path, key: Path):
    return run_doctor(tmp_path, tls_config(tmp_path, ca.cert_path, cert, key))


def test_a_good_certificate_passes_and_says_whom_it_names(tmp_path):
    ca, node = pki(tmp_path, uri="spiffe://llmgw/node/node01")
    facts, findings, _ = tls_run(tmp_path, ca, node.cert_path, node.key_path)
    assert facts.tls.not_after == node.cert.not_valid_after_utc.timestamp()
    ok = finding(findings, "tls-files")
    assert ok.severity == "ok"
    assert ok.summary.startswith("CA, certificate and key readable; the certificate names "
                                 "CN=node01, spiffe://llmgw/node/node01, issued by the CA, "
                                 "valid until 2026-10-09 ")
    assert doctor.exit_code(findings) == 0


@pytest.mark.parametrize(("dates", "severity", "words"), [
    ({"days_left": 3}, "warning", "expires 2025-10-12 08:53 UTC, in 3.0 days"),
    ({"days_left": -2, "days_since": 365}, "blocking", "expired 2025-10-07 08:53 UTC"),
    ({"days_since": -1}, "blocking", "is not valid until 2025-10-10 08:53 UTC"),
])
def test_certificate_dates_against_the_clock(tmp_path, dates, severity, words):
    ca, node = pki(tmp_path, **dates)
    _, findings, _ = tls_run(tmp_path, ca, node.cert_path, node.key_path)
    found = finding(findings, "tls-files")
    assert (found.severity, found.summary) == (severity, f"certificate {node.cert_path} {words}")
    assert "new certificate" in found.fix


def test_a_key_that_is_not_the_certificates_blocks(tmp_path):
    ca, node = pki(tmp_path)
    other = issue(tmp_path, "node02", ca, now=NOW)
    _, findings, _ = tls_run(tmp_path, ca, node.cert_path, other.key_path)
    found = finding(findings, "tls-files")
    assert found.severity == "blocking"
    assert found.summary == ("tls.cert_file and tls.key_file do not belong together: "
                             f"{other.key_path} is not the key {node.cert_path} certifies")


def test_a_certificate_from_another_ca_blocks(tmp_path):
    ca, _ = pki(tmp_path)
    other = issue(tmp_path, "other CA", now=NOW, ca=True)
    node = issue(tmp_path, "node02", other, now=NOW)
    _, findings, _ = tls_run(tmp_path, ca, node.cert_path, node.key_path)
    found = finding(findings, "tls-files")
    assert found.severity == "blocking"
    assert found.summary == (f"certificate {node.cert_path} is not issued by the CA in "
                             f"tls.ca_file {ca.cert_path}: it was issued by CN=other CA, and "
                             "ca_file holds CN=llmgw CA")
    assert "cluster's CA" in found.fix


def test_an_encrypted_key_blocks_without_prompting(tmp_path):
    ca, node = pki(tmp_path, passphrase=b"secret")
    _, findings, _ = tls_run(tmp_path, ca, node.cert_path, node.key_path)
    found = finding(findings, "tls-files")
    assert found.summary == (f"tls.key_file {node.key_path} is encrypted; the agent cannot "
                             "type its passphrase")
    assert "openssl pkey" in found.fix


# --- exit code and JSON ---------------------------------------------------------------------


def test_exit_code_is_one_only_when_something_blocks():
    warn = doctor.Finding("warning", "avx2", "slow")
    block = doctor.Finding("blocking", "clock-skew", "off")
    assert doctor.exit_code([]) == 0
    assert doctor.exit_code([warn, doctor.Finding("ok", "x", "")]) == 0
    assert doctor.exit_code([warn, block]) == 1
    assert doctor.sort_findings([warn, doctor.Finding("ok", "x", ""), block])[0] is block


def test_json_report_shape(tmp_path):
    config = agent_config(tmp_path, fabric="ib-a")
    facts, findings, capabilities = run_doctor(
        tmp_path, config, nvml=fake_single_4090(), probe=answering(90.0),
        infiniband_root=SYSFS_IB)
    payload = json.loads(json.dumps(doctor_cli.report(facts, findings, capabilities, config)))
    assert set(payload) == {"node", "can_run", "findings", "blocking"}
    assert payload["blocking"] is True
    assert payload["findings"][0] == {
        "severity": "blocking", "check": "clock-skew",
        "summary": payload["findings"][0]["summary"], "fix": payload["findings"][0]["fix"]}
    order = [doctor.SEVERITY_ORDER[f["severity"]] for f in payload["findings"]]
    assert order == sorted(order)
    node = payload["node"]
    assert node["gpus"] == [{
        "index": 0, "name": "NVIDIA GeForce RTX 4090", "memory_total_mib": 24564,
        "memory_free_mib": 24077, "uuid": "GPU-7d2e9f41-3c8a-b5e6-0f1d-2a4c6e8b0d13",
        "pci_bus_id": "00000000:01:00.0", "compute_capability": "8.9"}]
    assert (node["driver"], node["cuda"], node["fabric"]) == ("570.172.08", "12.8", "ib-a")
    assert node["infiniband"][0] == {"adapter": "mlx5_0", "port": 1, "state": "ACTIVE",
                                     "rate_gbps": 400.0, "link_layer": "InfiniBand"}
    (server,) = node["servers"]
    assert server["route"] == {"destination": "10.0.0.1", "source": "10.0.0.5",
                               "interface": "eth0", "gateway": "10.0.0.254"}
    assert server["reachable"] is True and server["skew_s"] == pytest.approx(90.0)
    assert {c["engine"] for c in payload["can_run"]} == set(engine_names.ALL)
    assert set(payload["can_run"][0]) == {"engine", "build", "can", "why"}


def test_the_human_output_has_the_three_tables(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    sources = make_sources(tmp_path, cpuinfo=QEMU64_CPUINFO, probe=refusing)
    code = doctor_cli.check(agent_config(tmp_path), None, False, sources)
    out = capsys.readouterr().out
    assert code == 1
    for words in ("what this node is", "what it can run", "findings", "QEMU Virtual CPU",
                  "control-plane-reach", "1 problem(s) block this node"):
        assert words in out
    assert out.index("blocking") < out.index("warning")


def test_the_human_output_prints_brackets_as_text_not_markup(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    facts = _facts()
    problem = doctor.Finding("blocking", "tls-files", "[X509: KEY_VALUES_MISMATCH] in "
                             "[/etc/llmgw] and [bold]", "see [/etc/llmgw]")
    doctor_cli.show(facts, [problem], doctor.can_run(facts), None)
    out = capsys.readouterr().out
    assert "[X509: KEY_VALUES_MISMATCH] in [/etc/llmgw] and [bold]" in out
    assert "see [/etc/llmgw]" in out


def _facts(**changes) -> doctor.Facts:
    base = dict(
        hostname="node01", node_id="node01", os_release={}, kernel="6.8.0", arch="x86_64",
        cpu_model="x", cpu_count=8, cpu_flags=("avx2",), virtual=False, ram_total_mib=1,
        ram_available_mib=1, gpus=doctor.gpu_discovery.GpuReport(note="none"), infiniband=(),
        engine_dir=doctor.DirFact("/var/lib/llmgw-agent", "/var/lib", False, False, True,
                                  100 * GIB, 90 * GIB),
        weights=(), servers=(), now=NOW, user="root (uid 0)")
    return doctor.Facts(**{**base, **changes})
