"""Onboarding end to end, with real processes on loopback: `llmgw server init` makes the
cluster, `llmgw ctl nodes add` a one-time token, `llmgw agent join` the node's identity;
the joined agent registers over mTLS and serves a shard; a reused, an expired and a
forged token are refused; `llmgw ctl nodes revoke` closes the node's stream."""

from __future__ import annotations

import contextlib
import io
import json
import os
import ssl
import stat
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx  # test-side only
import pytest
import yaml
from cryptography import x509

from llmgw import pki
from llmgw.cli.main import main
from llmgw.config import AgentConfig, ServerConfig, load
from tests.integration.cluster import _start, _stop_group, free_port, free_port_block, wait_for

SIM = {"name": "sim-join", "profiles": [{"engine": "sim"}], "replicas": 1}


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def llmgw(*args: str, env: dict | None = None) -> Ran:
    """``llmgw ARGS`` through its real entry point, in this process: a fresh interpreter
    per command costs seconds of imports on a loaded machine. The server is a process."""
    out, err = io.StringIO(), io.StringIO()
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return Ran(code, out.getvalue(), err.getvalue())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class Onboarded:
    """A server made by `llmgw server init`, on loopback ports, with what tests need."""

    def __init__(self, root: Path):
        self.root = root
        self.dir = root / "server"
        self.port, self.agent_port = free_port(), free_port()
        self.procs: list[subprocess.Popen] = []

    def init(self) -> None:
        done = llmgw("server", "init", "--dir", str(self.dir), "--address", "127.0.0.1",
                     "--address", "localhost", "--port", str(self.port),
                     "--agent-port", str(self.agent_port))
        assert done.returncode == 0, done.stderr
        # Told loopback, init listens there and nowhere else: the test runs what it wrote.
        path = self.dir / "server.yaml"
        config = yaml.safe_load(path.read_text())
        assert config["listen"]["host"] == config["tls"]["agent_listen"]["host"] == "127.0.0.1"
        # Quick node timeouts: edit what init wrote.
        config["nodes"] = {"heartbeat_interval_s": 0.5, "unreachable_after_s": 3,
                           "lost_after_s": 8}
        config["controller"] = {"interval_s": 0.5}
        config["models"] = [SIM]
        config["engines"] = {}  # no installs from GitHub: the test stays on loopback
        config["log_level"] = "debug"
        path.write_text(yaml.safe_dump(config))
        self.config = load(path, ServerConfig)
        self.ca = self.config.tls.ca_file
        self.token = (self.dir / "secrets" / "admin-token").read_text().strip()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=ssl.create_default_context(cafile=self.ca),
                            headers={"authorization": f"Bearer {self.token}"}, timeout=10)

    def start(self) -> None:
        self.server = _start(["server", "--config", str(self.dir / "server.yaml")],
                             self.root / "server.log")
        self.procs.append(self.server)
        with self.client() as c:
            wait_for(lambda: c.get("/healthz").status_code == 200, 30,
                     "the server to answer /healthz over https")

    def ctl(self, *args: str) -> Ran:
        # ctl trusts the cluster CA through OpenSSL's SSL_CERT_FILE.
        return llmgw("ctl", *args, "--server", self.url, "--token", self.token,
                     env={"SSL_CERT_FILE": self.ca})

    def log(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-6000:]}"
                         for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            _stop_group(proc)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    """One server for the module (starting one costs seconds); each test uses its own
    node names, so none sees another's tokens."""
    made = Onboarded(tmp_path_factory.mktemp("onboarding"))
    failed_before = request.session.testsfailed
    made.init()
    made.start()
    yield made
    made.stop()
    if request.session.testsfailed > failed_before:
        print(made.log())


def add_node(cluster: Onboarded, node: str, *extra: str) -> dict:
    done = cluster.ctl("nodes", "add", node, "--json", *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def join(command: str, directory: Path, *extra: str) -> Ran:
    """Run the printed command as a person would paste it, with a state dir of the test's."""
    words = command.split()
    assert words[:3] == ["llmgw", "agent", "join"], command
    return llmgw("agent", "join", *words[3:], "--dir", str(directory), "--no-start", *extra)


def test_server_init_writes_private_files_and_refuses_to_replace_a_ca(tmp_path) -> None:
    directory = tmp_path / "s"
    done = llmgw("server", "init", "--dir", str(directory), "--address", "10.1.2.3",
                 "--address", "cp.example.org", "--key-type", "ed25519")
    assert done.returncode == 0, done.stderr
    config = load(directory / "server.yaml", ServerConfig)
    assert config.state_dir == str(directory)
    for path in (directory, directory / "secrets", directory / "tls"):
        assert mode(path) == 0o700, path
    for path in (config.tls.ca_key_file, config.tls.key_file, directory / "secrets/admin-token",
                 directory / "server.yaml"):
        assert mode(Path(path)) == 0o600, path
    ca = pki.load_cert(Path(config.tls.ca_file).read_bytes())
    assert pki.fingerprint(ca) in done.stdout
    server = pki.load_cert(Path(config.tls.cert_file).read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["cp.example.org"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
    assert config.tls.public_urls == ["https://10.1.2.3:8080", "https://cp.example.org:8080"]
    # An address and a name: one socket cannot listen on just those, so every interface.
    assert config.listen.host == config.tls.agent_listen.host == "0.0.0.0"
    token = (directory / "secrets/admin-token").read_text()

    again = llmgw("server", "init", "--dir", str(directory), "--address", "10.1.2.3")
    assert again.returncode == 2
    assert "exists already" in again.stderr and "--force" in again.stderr
    assert pki.load_cert(Path(config.tls.ca_file).read_bytes()) == ca  # untouched

    forced = llmgw("server", "init", "--dir", str(directory), "--address", "10.1.2.3", "--force")
    assert forced.returncode == 0, forced.stderr
    assert pki.load_cert(Path(config.tls.ca_file).read_bytes()) != ca
    assert (directory / "secrets/admin-token").read_text() == token  # the admin token stays


def test_add_join_register_serve_and_revoke(cluster: Onboarded, tmp_path) -> None:
    added = add_node(cluster, "node-a")
    ca_sha = pki.fingerprint(pki.load_cert(Path(cluster.ca).read_bytes()))
    assert added["command"] == (f"llmgw agent join {cluster.url} {added['token']} "
                                f"--ca-sha256 {ca_sha}")
    agent_dir = tmp_path / "agent-a"
    done = join(added["command"], agent_dir, "--label", "zone=a", "--fabric", "ib-a",
                "--disable-engine", "vllm")
    assert done.returncode == 0, done.stderr

    # The files, their modes, and an agent.yaml llmgw's own loader takes.
    tls = agent_dir / "tls"
    assert mode(agent_dir) == 0o700 and mode(tls) == 0o700
    assert mode(tls / "node.key") == 0o600
    config = load(agent_dir / "agent.yaml", AgentConfig)
    assert config.servers == [f"https://127.0.0.1:{cluster.agent_port}"]
    assert (config.tls.ca_file, config.tls.cert_file, config.tls.key_file) == (
        str(tls / "ca.pem"), str(tls / "node.pem"), str(tls / "node.key"))
    assert (config.labels, config.fabric, config.disable_engines) == (
        {"zone": "a"}, "ib-a", ["vllm"])
    assert config.node_id == "node-a"  # the certificate's, not this machine's hostname
    written = yaml.safe_load((agent_dir / "agent.yaml").read_text())
    assert set(written) == {"servers", "node_id", "state_dir", "fabric", "labels",
                            "disable_engines", "tls"}  # nothing but what was given
    key = pki.load_key((tls / "node.key").read_bytes())
    assert pki.verify_node_cert((tls / "node.pem").read_bytes(),
                                Path(cluster.ca).read_bytes(), key) == "node-a"

    # The token works once: a second join is refused and leaves the node's files alone.
    before = (tls / "node.key").read_bytes()
    again = join(added["command"], agent_dir)
    assert again.returncode == 1
    assert "this join token was already used at" in again.stderr
    assert "make a new one with llmgw ctl nodes add node-a" in again.stderr
    assert (tls / "node.key").read_bytes() == before

    # A token nobody made.
    forged = join(added["command"].replace(added["token"], "llmgwj_" + "x" * 43),
                  tmp_path / "forged")
    assert forged.returncode == 1 and "not known to the cluster" in forged.stderr
    assert not (tmp_path / "forged").exists()

    # The agent runs from what join wrote (plus what a test needs: processes, loopback).
    # Its engines stop with it: they run in their own session, out of the agent's group.
    written.update({"runtime": "process", "address": "127.0.0.1", "stop_shards_on_exit": True,
                    "port_range": list(free_port_block()),
                    "reconnect": {"initial_s": 0.2, "max_s": 1.0}, "log_level": "debug",
                    "weights": {"directories": [{"path": str(agent_dir / "weights")}]}})
    (agent_dir / "agent.yaml").write_text(yaml.safe_dump(written))
    cluster.procs.append(_start(["agent", "--config", str(agent_dir / "agent.yaml")],
                                cluster.root / "agent-a.log"))
    with cluster.client() as c:
        ready = wait_for(lambda: [r for r in c.get("/api/status").json()["replicas"]
                                  if r["state"] == "ready"], 60, "sim-join ready on node-a")
        assert [s["node"] for s in ready[0]["shards"]] == ["node-a"]
        key_reply = c.post("/api/keys", json={"name": "join-test"})
        assert key_reply.status_code == 201, key_reply.text
        chat = c.post("/v1/chat/completions",
                      headers={"authorization": f"Bearer {key_reply.json()['key']}"},
                      json={"model": "sim-join", "messages": [{"role": "user",
                                                               "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"]

    serial = str(pki.load_cert((tls / "node.pem").read_bytes()).serial_number)
    revoked = cluster.ctl("nodes", "revoke", "node-a", "--json")
    assert revoked.returncode == 0, revoked.stderr
    assert json.loads(revoked.stdout) == {"node": "node-a", "revoked": [serial]}
    wait_for(lambda: "closing the agent stream of node-a" in
             (cluster.root / "server.log").read_text(), 5, "node-a's stream to be closed")


def test_an_expired_token_is_refused(cluster: Onboarded, tmp_path) -> None:
    added = add_node(cluster, "node-b", "--ttl", "1")
    expires = datetime.fromisoformat(added["expires_at"])
    # On the clock's condition, bounded: the token is past its expiry.
    wait_for(lambda: datetime.now(UTC) > expires, 5, "the token's expiry to pass", every_s=0.05)
    done = join(added["command"], tmp_path / "agent-b")
    assert done.returncode == 1
    assert f"this join token expired at {expires:%Y-%m-%d %H:%M:%S} UTC" in done.stderr
    assert "llmgw ctl nodes add node-b" in done.stderr
    assert not (tmp_path / "agent-b").exists()


def test_a_wrong_ca_pin_sends_no_token(cluster: Onboarded, tmp_path) -> None:
    added = add_node(cluster, "node-c")
    wrong = added["command"].replace(added["ca_sha256"], "0" * 64)
    done = join(wrong, tmp_path / "agent-c")
    assert done.returncode == 1
    assert "not the pinned" in done.stderr
    # The token was never sent, so it still works.
    done = join(added["command"], tmp_path / "agent-c", "--engine",
                "llama.cpp=/opt/llama/llama-server")
    assert done.returncode == 0, done.stderr
    config = load(tmp_path / "agent-c" / "agent.yaml", AgentConfig)
    assert config.engines["llama.cpp"].binary == "/opt/llama/llama-server"
    bad = join(added["command"], tmp_path / "agent-c2", "--label", "no-equals-sign")
    assert bad.returncode == 2 and "write it as NAME=VALUE" in bad.stderr


def test_join_refuses_a_bad_csr_and_keeps_the_token(cluster: Onboarded) -> None:
    added = add_node(cluster, "node-d")
    with cluster.client() as c:
        bad = c.post("/api/join", json={"token": added["token"], "csr": "not a CSR"})
        assert bad.status_code == 400, bad.text
        assert "not a PEM certificate request" in bad.json()["error"]["message"]
        csr = pki.make_csr(pki.new_key(), "someone-else").decode()
        good = c.post("/api/join", json={"token": added["token"], "csr": csr})
        assert good.status_code == 200, good.text  # the refused CSR did not spend it
        cert = pki.load_cert(good.json()["cert"].encode())
        assert pki.node_of(cert) == "node-d"  # the token's node, not the CSR's
        assert c.post("/api/nodes/bad name/join-tokens", json={}).status_code == 400
        assert c.post("/api/join", json={"token": "x", "csr": csr, "node": "n"}).json()[
            "error"]["message"] == "`node` cannot be set here"
