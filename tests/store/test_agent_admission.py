"""The mTLS listener's checks after the handshake (``mtls.admit``) and its renewals
(``mtls.Renewer``), against a real store on both backends, with certificates made by
``llmgw.pki``. The handshake itself, and the same checks end to end, are in
tests/integration/test_agent_mtls.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw import pki, wire
from llmgw.server.agents.mtls import Refused, Renewer, admit
from llmgw.server.agents.protocol import Identity
from llmgw.store import Store
from llmgw.store.pki import NodeCertRecord


@pytest.fixture(scope="module")
def ca() -> tuple[pki.PrivateKey, bytes]:
    return pki.create_ca()


def _issue(ca, node: str, **kwargs) -> tuple[bytes, pki.Issued, pki.PrivateKey]:
    """(DER as the ssl layer hands it over, what was issued, the node's key)."""
    key = pki.new_key()
    issued = pki.sign_node_csr(*ca, pki.make_csr(key, node), node,
                               kwargs.pop("lifetime", timedelta(days=1)), **kwargs)
    der = pki.load_cert(issued.cert_pem).public_bytes(serialization.Encoding.DER)
    return der, issued, key


async def _record(store: Store, node: str, issued: pki.Issued) -> None:
    await store.add_node_cert(NodeCertRecord(serial=str(issued.serial), node=node,
                                             not_before=issued.not_before,
                                             not_after=issued.not_after))


async def test_a_recorded_unrevoked_node_certificate_is_admitted(store, ca):
    der, issued, _ = _issue(ca, "n1")
    await _record(store, "n1", issued)
    node, cert = await admit(der, ca[1], store)
    assert (node, cert.serial_number) == ("n1", issued.serial)


async def test_each_refusal_says_what_is_wrong(store, ca):
    with pytest.raises(Refused) as none:
        await admit(None, ca[1], store)
    assert none.value.status == 401 and "llmgw agent join" in none.value.reason

    unknown, unknown_cert, _ = _issue(ca, "n2")
    with pytest.raises(Refused) as refused:
        await admit(unknown, ca[1], store)
    assert refused.value.status == 403
    assert f"{unknown_cert.serial:x}" in refused.value.reason
    assert "not one this cluster issued" in refused.value.reason

    revoked, revoked_cert, _ = _issue(ca, "n3")
    await _record(store, "n3", revoked_cert)
    assert await store.revoke_node_certs("n3", datetime.now(UTC)) == [str(revoked_cert.serial)]
    with pytest.raises(Refused) as refused:
        await admit(revoked, ca[1], store)
    assert refused.value.status == 403 and "'n3' was revoked at" in refused.value.reason

    # Recorded for another node than it names: the store's word wins, so it is refused.
    misfiled, misfiled_cert, _ = _issue(ca, "n4")
    await _record(store, "n5", misfiled_cert)
    with pytest.raises(Refused) as refused:
        await admit(misfiled, ca[1], store)
    assert "names node 'n4' but the store issued it to 'n5'" in refused.value.reason

    expired, _, _ = _issue(ca, "n6", lifetime=timedelta(hours=1),
                           now=datetime.now(UTC) - timedelta(days=2))
    with pytest.raises(Refused) as refused:
        await admit(expired, ca[1], store)
    assert refused.value.status == 403 and "expired" in refused.value.reason

    other_ca = pki.create_ca("another cluster")
    foreign, _, _ = _issue(other_ca, "n7")
    with pytest.raises(Refused) as refused:
        await admit(foreign, ca[1], store)
    assert "not issued by the CA" in refused.value.reason


async def test_a_server_certificate_is_no_node_certificate(store, ca):
    _, cert_pem = pki.issue_server_cert(*ca, ["127.0.0.1"])
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    with pytest.raises(Refused) as refused:
        await admit(der, ca[1], store)
    assert "clientAuth" in refused.value.reason


async def test_a_renewal_is_signed_for_the_streams_node_and_recorded(store, ca):
    _, current, _ = _issue(ca, "n1")
    await _record(store, "n1", current)
    identity = Identity("n1", current.serial, current.not_after)
    renewer = Renewer(store, ca[0], ca[1], timedelta(days=7))
    # The CSR asks for another node; the certificate names the stream's node all the same.
    csr = pki.make_csr(pki.new_key(), "someone-else")
    answer = await renewer(identity, csr)
    assert isinstance(answer, wire.Certificate), answer
    cert = pki.load_cert(answer.cert.encode())
    assert pki.node_of(cert) == "n1"
    assert answer.ca.encode() == ca[1]
    record = await store.get_node_cert(str(cert.serial_number))
    assert record is not None and record.node == "n1" and record.revoked_at is None
    assert record.not_after - record.not_before >= timedelta(days=7)

    again = await renewer(identity, csr)
    assert isinstance(again, wire.CertificateRefused) and "ask again later" in again.reason


async def test_a_revoked_stream_gets_no_renewal(store, ca):
    _, current, key = _issue(ca, "n1")
    await _record(store, "n1", current)
    await store.revoke_node_certs("n1", datetime.now(UTC))
    renewer = Renewer(store, ca[0], ca[1], timedelta(days=7))
    answer = await renewer(Identity("n1", current.serial, current.not_after),
                           pki.make_csr(key, "n1"))
    assert isinstance(answer, wire.CertificateRefused) and "revoked" in answer.reason
    assert [c.serial for c in await store.list_node_certs("n1")] == [str(current.serial)]
