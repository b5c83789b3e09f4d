"""``llmgw doctor`` as an operator runs it: a real process reading this machine's own
/proc, /sys, statvfs and routes, against a real llmgw server on loopback, a /healthz with a
skewed clock, a closed port, and a network namespace with no routes at all."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from llmgw.agent.discovery import host
from tests.integration.cluster import free_port
from tests.unit.test_tls_files import issue

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "import sys; from llmgw.cli.doctor import main; sys.exit(main(sys.argv[1:]))"


def doctor(*args: str | os.PathLike, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    env["COLUMNS"] = "200"
    return subprocess.run([*prefix, sys.executable, "-c", ENTRY, *map(str, args)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL)


def as_json(result: subprocess.CompletedProcess) -> dict:
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"not JSON (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")


def findings(report: dict, check: str) -> list[dict]:
    return [f for f in report["findings"] if f["check"] == check]


def write_config(tmp_path: Path, servers: list[str], **fields) -> Path:
    config = {"servers": servers, "state_dir": str(tmp_path / "agent"),
              "weights": {"directories": [{"path": str(tmp_path / "weights")}]}, **fields}
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def healthz(skew_s: float) -> Iterator[str]:
    """A /healthz shaped like llmgw server's, whose clock runs ``skew_s`` ahead."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok", "time": time.time() + skew_s}).encode()
            self.send_response(200 if self.path == "/healthz" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_this_machine_against_a_real_server(make_cluster, tmp_path):
    cluster = make_cluster()
    cluster.start_server()
    config = write_config(tmp_path, [cluster.base_url])

    result = doctor("--config", config)
    assert result.returncode == 0, result.stdout + result.stderr
    for words in ("what this node is", "what it can run", "findings", socket.gethostname(),
                  "nothing blocks this node"):
        assert words in result.stdout

    result = doctor("--config", config, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = as_json(result)
    assert report["blocking"] is False
    node = report["node"]
    # This machine's own facts, read the same way the agent reads them.
    assert node["hostname"] == socket.gethostname()
    model, flags = host.cpu_info()
    assert (node["cpu_model"], node["cpu_flags"]) == (model, flags)
    assert node["cpu_count"] == os.cpu_count()
    total, _ = host.memory_mib()
    assert abs(node["ram_total_mib"] - total) <= 64
    assert node["kernel"] == os.uname().release
    assert node["engine_dir"]["measured"] == str(tmp_path)
    (server,) = node["servers"]
    assert server["route"]["interface"] == "lo" and server["route"]["source"] == "127.0.0.1"
    assert server["reachable"] is True
    assert abs(server["skew_s"]) < 2  # the same clock on both ends
    assert [f["severity"] for f in findings(report, "control-plane-reach")] == ["ok"]
    assert [f["severity"] for f in findings(report, "clock-skew")] == ["ok"]
    assert "this node is reached at 127.0.0.1 via lo" in \
        findings(report, "control-plane-route")[0]["summary"]
    assert {c["engine"] for c in report["can_run"] if c["can"]} >= {"sim", "llama.cpp"}
    if not Path("/proc/driver/nvidia").exists():
        assert node["gpus"] == [] and node["gpu_note"]
        assert findings(report, "nvidia-driver")[0]["severity"] == "info"


@pytest.mark.parametrize(("skew_s", "severity", "code"), [
    (120.0, "blocking", 1), (-20.0, "warning", 0),
])
def test_a_skewed_control_plane_clock(tmp_path, skew_s, severity, code):
    with healthz(skew_s) as url:
        result = doctor("--server", url, "--json")
    assert result.returncode == code, result.stdout + result.stderr
    report = as_json(result)
    (skew,) = findings(report, "clock-skew")
    assert skew["severity"] == severity
    assert f"{abs(skew_s):.0f}." in skew["summary"]
    assert ("behind" if skew_s > 0 else "ahead of") in skew["summary"]
    assert "NTP" in skew["fix"]
    assert report["node"]["servers"][0]["skew_s"] == pytest.approx(skew_s, abs=2)


def test_an_unreachable_control_plane_blocks(tmp_path):
    port = free_port()  # bound and closed again: nothing listens there now
    config = write_config(tmp_path, [f"http://127.0.0.1:{port}"])
    result = doctor("--config", config)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "control-plane-reach" in result.stdout
    assert "block this node" in result.stdout

    report = as_json(doctor("--config", config, "--json"))
    (reach,) = findings(report, "control-plane-reach")
    assert reach["severity"] == "blocking"
    assert f"connection refused: nothing listens on 127.0.0.1:{port}" in reach["summary"]
    assert report["blocking"] is True


def test_unreadable_tls_files_block(tmp_path):
    (tmp_path / "certs").mkdir()
    with healthz(0.0) as url:
        config = write_config(tmp_path, [url], tls={
            "ca_file": str(tmp_path / "certs"), "cert_file": str(tmp_path / "missing.pem"),
            "key_file": str(tmp_path / "missing.key")})
        result = doctor("--config", config, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    summaries = [f["summary"] for f in findings(as_json(result), "tls-files")]
    assert summaries == [
        f"tls.ca_file {tmp_path / 'certs'} cannot be read: Is a directory",
        f"tls.cert_file {tmp_path / 'missing.pem'} cannot be read: No such file or directory",
        f"tls.key_file {tmp_path / 'missing.key'} cannot be read: No such file or directory"]


def test_tls_files_from_the_configured_ca_or_not(tmp_path):
    ca = issue(tmp_path, "llmgw CA", ca=True)
    node = issue(tmp_path, "node01", ca, uri="spiffe://llmgw/node/node01")
    stranger = issue(tmp_path, "node02", issue(tmp_path, "other CA", ca=True))
    with healthz(0.0) as url:
        config = write_config(tmp_path, [url], tls={
            "ca_file": str(ca.cert_path), "cert_file": str(node.cert_path),
            "key_file": str(node.key_path)})
        good = doctor("--config", config, "--json")
        config = write_config(tmp_path, [url], tls={
            "ca_file": str(ca.cert_path), "cert_file": str(stranger.cert_path),
            "key_file": str(stranger.key_path)})
        bad = doctor("--config", config, "--json")
    assert good.returncode == 0, good.stdout + good.stderr
    (ok,) = findings(as_json(good), "tls-files")
    assert ok["severity"] == "ok"
    assert "names CN=node01, spiffe://llmgw/node/node01, issued by the CA" in ok["summary"]
    assert bad.returncode == 1, bad.stdout + bad.stderr
    (blocking,) = findings(as_json(bad), "tls-files")
    assert blocking["summary"] == (
        f"certificate {stranger.cert_path} is not issued by the CA in tls.ca_file "
        f"{ca.cert_path}: it was issued by CN=other CA, and ca_file holds CN=llmgw CA")


def test_run_check_is_the_same_doctor_in_process(tmp_path, capsys):
    """What `llmgw agent --check` calls, with an agent.yaml already loaded."""
    from llmgw.cli.doctor import run_check
    from llmgw.config import AgentConfig, load

    with healthz(0.0) as url:
        config = load(write_config(tmp_path, [url]), AgentConfig)
        assert run_check(config, json_output=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert [f["severity"] for f in findings(report, "control-plane-reach")] == ["ok"]

    config = load(write_config(tmp_path, [f"http://127.0.0.1:{free_port()}"]), AgentConfig)
    assert run_check(config, json_output=False) == 1
    assert "control-plane-reach" in capsys.readouterr().out


def test_bad_configuration_is_exit_2(tmp_path):
    bad = tmp_path / "agent.yaml"
    bad.write_text("servers: [http://127.0.0.1:1]\nsurvers: oops\n")
    result = doctor("--config", bad)
    assert result.returncode == 2
    assert "survers" in result.stderr
    result = doctor("--config", tmp_path / "absent.yaml")
    assert result.returncode == 2
    assert "cannot read" in result.stderr


@pytest.fixture
def empty_netns() -> Iterator[str]:
    """A fresh network namespace: only a loopback, down, and no routes."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2")
    name = f"llmgw-doc-{secrets.token_hex(4)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                          timeout=30)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {made.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def test_no_route_to_the_control_plane_blocks(empty_netns):
    result = doctor("--server", "http://10.255.0.1:8080", "--json",
                    prefix=("ip", "netns", "exec", empty_netns))
    assert result.returncode == 1, result.stdout + result.stderr
    report = as_json(result)
    (route,) = findings(report, "control-plane-route")
    assert route["severity"] == "blocking"
    assert "10.255.0.1" in route["summary"] and "unreachable" in route["summary"]
    assert "ip route" in route["fix"]
    assert findings(report, "control-plane-reach") == []  # nothing was sent
    assert report["node"]["servers"][0]["route"] is None
