"""The agent stream's mTLS listener, with real TLS on loopback: a real server with a tls
block, real agents with node certificates, and a small in-test client (the agent's own TLS
context, then a Register) for the peers a real agent would never be: a certificate from
another CA, an expired or revoked one, one naming another node, none at all.

Certificates are made here with ``llmgw.pki`` and recorded in the server's store, as
``llmgw agent join`` would have them. A revocation is written to the store from this
process, as another server sharing the store would write it, so the watcher's path is the
one measured.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import stat
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import httpx
import pytest

from llmgw import pki, wire
from llmgw.agent.agent import client_context
from llmgw.config import AgentTls
from llmgw.store import open_store, sqlite_url
from llmgw.store.pki import NodeCertRecord
from tests.integration.cluster import Cluster, free_port, wait_for


@dataclass
class TlsCluster(Cluster):
    """A Cluster whose server has a tls block: the API is https, agents dial the mTLS port."""

    agent_port: int = 0

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def agent_url(self) -> str:
        return f"https://127.0.0.1:{self.agent_port}"

    def node_ids(self) -> set[str]:
        return {n["id"] for n in self.status()["nodes"]}

    def log_text(self, name: str) -> str:
        path = self.root / name
        return path.read_text(errors="replace") if path.exists() else ""

    def log_line(self, name: str, *words: str, timeout_s: float = 20) -> str:
        """Wait for the first line of ``name`` (a log in root) holding every one of words."""
        return wait_for(lambda: next((line for line in self.log_text(name).splitlines()
                                      if all(w in line for w in words)), None),
                        timeout_s, f"a line of {name} with {words}", every_s=0.05)


@dataclass
class Pki:
    root: Path
    ca_key: pki.PrivateKey
    ca_pem: bytes

    @property
    def ca_file(self) -> Path:
        return self.root / "ca.pem"

    def node(self, node: str, *, lifetime: timedelta = timedelta(days=1),
             now: datetime | None = None, tag: str = "") -> tuple[AgentTls, pki.Issued]:
        """A node key and certificate signed by this CA, written next to the CA."""
        key = pki.new_key()
        issued = pki.sign_node_csr(self.ca_key, self.ca_pem, pki.make_csr(key, node), node,
                                   lifetime, now=now)
        base = self.root / f"{node}{tag}"
        Path(f"{base}.key").write_bytes(pki.key_pem(key))
        os.chmod(f"{base}.key", 0o600)
        Path(f"{base}.pem").write_bytes(issued.cert_pem)
        os.chmod(f"{base}.pem", 0o640)
        return AgentTls(ca_file=str(self.ca_file), cert_file=f"{base}.pem",
                        key_file=f"{base}.key"), issued


def make_pki(root: Path) -> Pki:
    root.mkdir(parents=True)
    ca_key, ca_pem = pki.create_ca()
    made = Pki(root, ca_key, ca_pem)
    made.ca_file.write_bytes(ca_pem)
    (root / "ca.key").write_bytes(pki.key_pem(ca_key))
    key_pem, cert_pem = pki.issue_server_cert(ca_key, ca_pem, ["127.0.0.1", "localhost"])
    (root / "server.key").write_bytes(key_pem)
    (root / "server.pem").write_bytes(cert_pem)
    return made


async def _record(db: Path, *issued: tuple[str, pki.Issued]) -> None:
    store = await open_store(sqlite_url(db))
    try:
        for node, cert in issued:
            await store.add_node_cert(NodeCertRecord(serial=str(cert.serial), node=node,
                                                     not_before=cert.not_before,
                                                     not_after=cert.not_after))
    finally:
        await store.close()


async def _revoke(db: Path, node: str) -> list[str]:
    store = await open_store(sqlite_url(db))
    try:
        return await store.revoke_node_certs(node, datetime.now(UTC))
    finally:
        await store.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtls")
    ca = make_pki(root / "pki")
    cluster = TlsCluster(root / "c", models=[], agent_port=free_port())
    cluster.root.mkdir()
    cluster.server_overrides = {
        "engines": {},
        "tls": {"ca_file": str(ca.ca_file), "ca_key_file": str(ca.root / "ca.key"),
                "cert_file": str(ca.root / "server.pem"), "key_file": str(ca.root / "server.key"),
                "agent_listen": {"host": "127.0.0.1", "port": cluster.agent_port}},
    }
    # httpx (the cluster's polling) trusts the cluster CA for the https API.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SSL_CERT_FILE", str(ca.ca_file))
        try:
            cluster.start_server()
            yield cluster, ca
        finally:
            cluster.stop()


@pytest.fixture(autouse=True)
def _logs_on_failure(request, env):
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(env[0].logs())


def _register(node: str) -> wire.Register:
    return wire.Register(node_id=node, address="127.0.0.1", inventory=wire.Inventory(hostname=node))


async def _dial(url: str, context: ssl.SSLContext, node: str) -> str:
    """Connect as an agent would and register as ``node``; how the server answered."""
    stream = url.replace("https://", "wss://") + "/agent/v1/stream"
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        try:
            async with http.ws_connect(stream, ssl=context) as ws:
                await ws.send_bytes(wire.encode(_register(node)))
                msg = await ws.receive(timeout=10)
                if msg.type == aiohttp.WSMsgType.BINARY:
                    return type(wire.decode_down(msg.data)).__name__
                return f"closed {msg.data} {msg.extra}"
        except aiohttp.WSServerHandshakeError as err:
            return f"http {err.status}"
        except (aiohttp.ClientError, OSError) as err:
            return f"tls {type(err).__name__}: {err}"


def _context(ca_file: Path, tls: AgentTls | None) -> ssl.SSLContext:
    if tls is not None:
        return client_context(tls)
    return ssl.create_default_context(cafile=str(ca_file))


def test_a_node_with_a_valid_certificate_registers_and_revocation_closes_its_stream(env):
    cluster, ca = env
    tls, issued = ca.node("n-ok")
    asyncio.run(_record(cluster.server_state / "llmgw.db", ("n-ok", issued)))
    agent = cluster.add_agent("n-ok", servers=[cluster.agent_url],
                              tls={"ca_file": tls.ca_file, "cert_file": tls.cert_file,
                                   "key_file": tls.key_file})
    cluster.log_line("server.log", "node n-ok, certificate serial", f"{issued.serial:x}",
                     timeout_s=30)
    wait_for(lambda: cluster.node_state("n-ok") == "ready", 20, "n-ok to be ready")

    # As an operator would: llmgw ctl nodes revoke n-ok.
    began = time.monotonic()
    answer = cluster.admin("POST", "/api/nodes/n-ok/revoke")
    assert answer.json()["revoked"] == [str(issued.serial)], answer.text
    line = cluster.log_line(agent.log.name, "refused: 4401", "revoked", timeout_s=10)
    closed_after = time.monotonic() - began
    print(f"revoke endpoint: the agent saw its stream closed {closed_after:.2f} s later")
    assert closed_after < 5, line
    cluster.log_line("server.log", "closing the agent stream of n-ok", "revoked")
    # The agent dials again at once, and the handshake is refused now.
    cluster.log_line("server.log", "refused: certificate serial", f"{issued.serial:x}",
                     "of node 'n-ok' was revoked")
    wait_for(lambda: cluster.node_state("n-ok") != "ready", 10, "n-ok to be not ready")
    agent.stop()


def test_certificates_that_do_not_prove_the_node_are_refused(env, tmp_path):
    cluster, ca = env
    db = cluster.server_state / "llmgw.db"
    other = make_pki(tmp_path / "other")
    foreign, _ = other.node("n-foreign")
    foreign = AgentTls(ca_file=str(ca.ca_file), cert_file=foreign.cert_file,
                       key_file=foreign.key_file)  # it trusts our server, but is not ours
    expired, expired_cert = ca.node("n-expired", lifetime=timedelta(hours=1),
                                    now=datetime.now(UTC) - timedelta(days=2))
    revoked, revoked_cert = ca.node("n-revoked")
    impostor, impostor_cert = ca.node("n-real")
    unknown, unknown_cert = ca.node("n-unknown")  # signed by the CA, never recorded
    asyncio.run(_record(db, ("n-expired", expired_cert), ("n-revoked", revoked_cert),
                        ("n-real", impostor_cert)))
    asyncio.run(_revoke(db, "n-revoked"))
    server_cert = AgentTls(ca_file=str(ca.ca_file), cert_file=str(ca.root / "server.pem"),
                           key_file=str(ca.root / "server.key"))

    cases = {
        # node: (its TLS files, a word of the server's refusal line)
        "n-foreign": (foreign, "TLS handshake refused", "unable to get local issuer"),
        "n-expired": (expired, "TLS handshake refused", "certificate has expired"),
        "n-server": (server_cert, "TLS handshake refused", "unsuitable certificate purpose"),
        "n-revoked": (revoked, f"refused: certificate serial {revoked_cert.serial:x}",
                      "was revoked"),
        "n-unknown": (unknown, f"refused: certificate serial {unknown_cert.serial:x}",
                      "not one this cluster issued"),
        "n-fake": (impostor, "disconnecting agent", "is node 'n-real' but it registered as "
                   "'n-fake'"),
        "n-none": (None, "refused: no client certificate", "llmgw agent join"),
    }

    async def dial_all() -> dict[str, str]:
        answers = await asyncio.gather(*(_dial(cluster.agent_url, _context(ca.ca_file, tls),
                                               node) for node, (tls, *_) in cases.items()))
        return dict(zip(cases, answers, strict=True))

    answers = asyncio.run(dial_all())
    print(answers)
    for node, (_, *words) in cases.items():
        cluster.log_line("server.log", *words)
        assert answers[node] != "Welcome", (node, answers[node])
    assert answers["n-none"] == "http 401"
    assert answers["n-revoked"] == answers["n-unknown"] == "http 403"
    assert answers["n-fake"].startswith("closed 4403"), answers["n-fake"]
    for node in ("n-foreign", "n-expired", "n-server"):
        assert answers[node].startswith("tls "), (node, answers[node])
    assert not cluster.node_ids() & {*cases, "n-real"}


def test_the_plain_route_sends_agents_to_the_mtls_listener(env):
    cluster, ca = env

    async def plain() -> tuple[int | None, str]:
        context = ssl.create_default_context(cafile=str(ca.ca_file))
        async with aiohttp.ClientSession() as http:
            url = f"wss://127.0.0.1:{cluster.port}/agent/v1/stream"
            async with http.ws_connect(url, ssl=context) as ws:
                await ws.send_bytes(wire.encode(_register("n-plain")))
                msg = await ws.receive(timeout=10)
                return msg.data, msg.extra or ""

    code, reason = asyncio.run(plain())
    assert code == 4401 and f":{cluster.agent_port}" in reason, (code, reason)
    # The API is TLS only: plain HTTP on its port gets no answer.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{cluster.port}/healthz", timeout=5)
    assert "n-plain" not in cluster.node_ids()


def test_a_certificate_near_its_end_is_renewed_over_the_stream(env):
    cluster, ca = env
    # Issued five minutes back (pki backdates) with 90 s to go: under a third is left.
    tls, issued = ca.node("n-renew", lifetime=timedelta(seconds=90))
    asyncio.run(_record(cluster.server_state / "llmgw.db", ("n-renew", issued)))
    mode = stat.S_IMODE(os.stat(tls.cert_file).st_mode)
    agent = cluster.add_agent("n-renew", servers=[cluster.agent_url],
                              tls={"ca_file": tls.ca_file, "cert_file": tls.cert_file,
                                   "key_file": tls.key_file})
    line = cluster.log_line("server.log", "renewed the certificate of node n-renew",
                            f"replaces {issued.serial:x}", timeout_s=30)
    new_serial = int(line.split("serial ")[1].split()[0], 16)
    cluster.log_line(agent.log.name, "renewed this node's certificate", f"{new_serial:x}")
    renewed = pki.load_cert(Path(tls.cert_file).read_bytes())
    assert renewed.serial_number == new_serial
    assert pki.node_of(renewed) == "n-renew"
    assert renewed.not_valid_after_utc - datetime.now(UTC) > timedelta(days=6)
    assert stat.S_IMODE(os.stat(tls.cert_file).st_mode) == mode

    # The next connection presents the new certificate.
    cluster.restart_server()
    cluster.log_line("server.log", "node n-renew, certificate serial", f"{new_serial:x}",
                     timeout_s=30)
    wait_for(lambda: cluster.node_state("n-renew") == "ready", 20, "n-renew ready again")

    # Revoked by another server sharing the store: this one's watcher closes the stream,
    # the renewed certificate included.
    began = time.monotonic()
    revoked = asyncio.run(_revoke(cluster.server_state / "llmgw.db", "n-renew"))
    assert str(new_serial) in revoked
    line = cluster.log_line(agent.log.name, "refused: 4401", "revoked", timeout_s=10)
    closed_after = time.monotonic() - began
    print(f"revoked in the store: the agent saw its stream closed {closed_after:.2f} s later")
    assert closed_after < 5, line
    agent.stop()
