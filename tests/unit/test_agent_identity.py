"""The pieces of the agent stream's identity that need no socket: the renewal messages,
when an agent renews, how it writes the new certificate, and which plain-text setups
each side refuses."""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime, timedelta

import pytest

from llmgw import pki, wire
from llmgw.agent.agent import check_servers, renewal_due, write_atomically
from llmgw.config import AgentConfig, ConfigError, ServerConfig, parse
from llmgw.server.agents.stream import plain_refusal
from llmgw.server.run import check_plain_http


def test_the_renewal_messages_round_trip():
    up = wire.RenewCertificate(csr="-----BEGIN CERTIFICATE REQUEST-----\n")
    assert wire.decode_up(wire.encode(up)) == up
    for down in (wire.Certificate(cert="C", ca="A"), wire.CertificateRefused(reason="no")):
        assert wire.decode_down(wire.encode(down)) == down


def test_renewal_is_due_once_less_than_a_third_is_left():
    ca = pki.create_ca()
    issued_at = datetime.now(UTC)
    issued = pki.sign_node_csr(*ca, pki.make_csr(pki.new_key(), "n1"), "n1",
                               timedelta(days=7), now=issued_at)
    lifetime = issued.not_after - issued.not_before
    third_left = issued.not_after - lifetime / 3
    assert not renewal_due(issued.cert_pem, issued_at)
    assert not renewal_due(issued.cert_pem, third_left - timedelta(seconds=2))
    assert renewal_due(issued.cert_pem, third_left + timedelta(seconds=2))
    assert renewal_due(issued.cert_pem, issued.not_after + timedelta(days=1))


def test_a_renewed_certificate_replaces_the_file_and_keeps_its_mode(tmp_path):
    path = tmp_path / "node.pem"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    write_atomically(path, b"new certificate")
    assert path.read_bytes() == b"new certificate"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["node.pem"]


def _agent(**fields) -> AgentConfig:
    return parse({"servers": ["http://127.0.0.1:8080"], **fields}, AgentConfig)


def test_an_agent_refuses_a_plain_control_plane_off_loopback():
    check_servers(_agent())
    check_servers(_agent(servers=["http://localhost:8080", "http://[::1]:8080"]))
    with pytest.raises(ConfigError, match=r"servers\[1\]: http://10.0.0.5:8080 is plain text"):
        check_servers(_agent(servers=["http://127.0.0.1:8080", "http://10.0.0.5:8080"]))
    check_servers(_agent(servers=["http://10.0.0.5:8080"], allow_plain_http=True))


def test_an_agent_needs_its_certificate_for_a_tls_control_plane():
    with pytest.raises(ConfigError, match="no tls block"):
        check_servers(_agent(servers=["https://cp.example.org:8443"]))
    check_servers(_agent(servers=["https://cp.example.org:8443"],
                         tls={"ca_file": "ca.pem", "cert_file": "n.pem", "key_file": "n.key"}))


_TLS = {"ca_file": "ca.pem", "ca_key_file": "ca.key", "cert_file": "s.pem", "key_file": "s.key",
        "agent_listen": {"host": "10.0.0.1", "port": 9443}}


def test_a_server_refuses_plain_http_off_loopback_unless_told():
    check_plain_http(parse({}, ServerConfig))
    check_plain_http(parse({"listen": {"host": "::1"}}, ServerConfig))
    with pytest.raises(ConfigError, match=r"listen\.allow_plain_http: true"):
        check_plain_http(parse({"listen": {"host": "0.0.0.0"}}, ServerConfig))
    check_plain_http(parse({"listen": {"host": "0.0.0.0", "allow_plain_http": True}},
                           ServerConfig))
    check_plain_http(parse({"listen": {"host": "0.0.0.0"}, "tls": _TLS}, ServerConfig))


def test_the_plain_agent_route_takes_whom():
    plain = parse({}, ServerConfig)
    assert plain_refusal(plain, "127.0.0.1") is None
    assert "loopback only" in plain_refusal(plain, "10.0.0.7")
    trusted = parse({"listen": {"host": "0.0.0.0", "allow_plain_http": True}}, ServerConfig)
    assert plain_refusal(trusted, "10.0.0.7") is None
    with_tls = parse({"tls": _TLS}, ServerConfig)
    assert "wss://10.0.0.1:9443" in plain_refusal(with_tls, "127.0.0.1")
