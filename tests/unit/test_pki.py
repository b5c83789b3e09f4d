"""The cluster PKI (``llmgw.pki``): what the CA, server and node certificates say, and
every refusal, each checked against what ``cryptography`` reads back."""

from __future__ import annotations

import base64
import ipaddress
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw import pki

KINDS = ["ecdsa", "ed25519"]


def _ext(cert, cls):
    return cert.extensions.get_extension_for_class(cls)


@pytest.fixture(scope="module", params=KINDS)
def ca(request):
    key, pem = pki.create_ca(kind=request.param)
    return key, pem


def test_ca_is_a_ca_that_signs_leaves_only(ca):
    key, pem = ca
    cert = pki.load_cert(pem)
    constraints = _ext(cert, x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = _ext(cert, x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    assert _ext(cert, x509.SubjectKeyIdentifier).value == \
        x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert.verify_directly_issued_by(cert)  # self-signed
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "llmgw cluster CA"
    assert cert.not_valid_after_utc - cert.not_valid_before_utc > timedelta(days=3649)


def test_keys_round_trip_through_pem():
    for kind, cls in [("ecdsa", ec.EllipticCurvePrivateKey),
                      ("ed25519", ed25519.Ed25519PrivateKey)]:
        key = pki.new_key(kind)
        assert isinstance(key, cls)
        pem = pki.key_pem(key)
        assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, unencrypted
        assert pki.key_pem(pki.load_key(pem)) == pem
    assert pki.new_key().curve.name == "secp256r1"


def test_server_cert_names_its_hosts_and_serves_only(ca):
    ca_key, ca_pem = ca
    key_pem, cert_pem = pki.issue_server_cert(
        ca_key, ca_pem, ["cp1.example.org", "10.0.0.5", "::1", "localhost", "10.0.0.5"])
    cert = pki.load_cert(cert_pem)
    cert.verify_directly_issued_by(pki.load_cert(ca_pem))
    san = _ext(cert, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["cp1.example.org", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5"),
                                                       ipaddress.ip_address("::1")]
    assert list(_ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    usage = _ext(cert, x509.KeyUsage).value
    assert usage.digital_signature and not usage.key_encipherment and not usage.key_cert_sign
    assert not _ext(cert, x509.BasicConstraints).value.ca
    assert _ext(cert, x509.AuthorityKeyIdentifier).value.key_identifier == \
        _ext(pki.load_cert(ca_pem), x509.SubjectKeyIdentifier).value.digest
    key = pki.load_key(key_pem)
    assert key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) == \
        cert.public_key().public_bytes(serialization.Encoding.DER,
                                       serialization.PublicFormat.SubjectPublicKeyInfo)
    assert 396 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 397


@pytest.mark.parametrize("host", ["", "two words", "a..b", "under_score.example", "é.example"])
def test_server_cert_refuses_what_is_no_address(ca, host):
    with pytest.raises(pki.PkiError, match="neither an IP address nor a DNS name"):
        pki.issue_server_cert(*ca, ["ok.example", host])


def test_server_cert_needs_a_host(ca):
    with pytest.raises(pki.PkiError, match="at least one address"):
        pki.issue_server_cert(*ca, [])


def test_node_cert_names_the_node_the_ca_chose(ca):
    ca_key, ca_pem = ca
    node_key = pki.new_key()
    csr = pki.make_csr(node_key, "mallory")  # asks to be another node
    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    issued = pki.sign_node_csr(ca_key, ca_pem, csr, "gpu-01", timedelta(days=7), now=now)
    cert = pki.load_cert(issued.cert_pem)
    assert cert.serial_number == issued.serial
    assert issued.not_after == now + timedelta(days=7) == cert.not_valid_after_utc
    assert issued.not_before <= now
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-01"
    san = _ext(cert, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["llmgw://node/gpu-01"]
    assert list(_ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert _ext(cert, x509.KeyUsage).value.digital_signature
    assert pki.node_of(cert) == "gpu-01"
    assert pki.verify_node_cert(issued.cert_pem, ca_pem, node_key,
                                now=now + timedelta(days=1)) == "gpu-01"


def test_serials_are_random_and_distinct(ca):
    csr = pki.make_csr(pki.new_key(), "n1")
    serials = {pki.sign_node_csr(*ca, csr, "n1", timedelta(hours=1)).serial for _ in range(5)}
    assert len(serials) == 5 and all(s.bit_length() > 64 for s in serials)


def test_a_csr_whose_signature_does_not_verify_is_refused(ca):
    csr = x509.load_pem_x509_csr(pki.make_csr(pki.new_key(), "n1"))
    der = bytearray(csr.public_bytes(serialization.Encoding.DER))
    der[-3] ^= 0xFF  # inside the signature
    pem = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(pki.PkiError, match="signature does not verify"):
        pki.sign_node_csr(*ca, pem, "n1", timedelta(days=7))


def test_a_csr_signed_by_another_key_is_refused(ca):
    # The CSR carries one public key but is signed with another: built by hand.
    carried, signer = pki.new_key(), pki.new_key()
    good = x509.load_pem_x509_csr(pki.make_csr(carried, "n1"))
    other = x509.load_pem_x509_csr(pki.make_csr(signer, "n1"))
    # Swap in the other CSR's signature: same algorithm, wrong key.
    body = good.tbs_certrequest_bytes
    forged = _der_csr(body, other.signature_algorithm_oid, signer.sign(body, ec.ECDSA(
        hashes.SHA256())))
    with pytest.raises(pki.PkiError, match="signature does not verify"):
        pki.sign_node_csr(*ca, forged, "n1", timedelta(days=7))


def _der_csr(tbs: bytes, algorithm_oid, signature: bytes) -> bytes:
    """A CSR from its parts (DER SEQUENCE of tbs, AlgorithmIdentifier, BIT STRING)."""
    def tlv(tag: int, content: bytes) -> bytes:
        n = len(content)
        length = bytes([n]) if n < 128 else bytes([0x80 | ((n.bit_length() + 7) // 8)]) + \
            n.to_bytes((n.bit_length() + 7) // 8, "big")
        return bytes([tag]) + length + content

    def oid(dotted: str) -> bytes:
        parts = [int(p) for p in dotted.split(".")]
        out = bytes([40 * parts[0] + parts[1]])
        for p in parts[2:]:
            chunk = [p & 0x7F]
            p >>= 7
            while p:
                chunk.append(0x80 | (p & 0x7F))
                p >>= 7
            out += bytes(reversed(chunk))
        return tlv(0x06, out)

    algorithm = tlv(0x30, oid(algorithm_oid.dotted_string))
    der = tlv(0x30, tbs + algorithm + tlv(0x03, b"\x00" + signature))
    body = base64.encodebytes(der).replace(b"\n", b"")
    lines = [body[i:i + 64] for i in range(0, len(body), 64)]
    return b"-----BEGIN CERTIFICATE REQUEST-----\n" + b"\n".join(lines) + \
        b"\n-----END CERTIFICATE REQUEST-----\n"


def test_garbage_and_rsa_csrs_are_refused(ca):
    with pytest.raises(pki.PkiError, match="not a PEM certificate request"):
        pki.sign_node_csr(*ca, b"hello", "n1", timedelta(days=7))
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n1")]))
           .sign(rsa_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    with pytest.raises(pki.PkiError, match="ECDSA and Ed25519 node keys only"):
        pki.sign_node_csr(*ca, csr, "n1", timedelta(days=7))


def test_signing_refuses_a_bad_node_name_lifetime_or_ca(ca):
    ca_key, ca_pem = ca
    csr = pki.make_csr(pki.new_key(), "n1")
    with pytest.raises(pki.PkiError, match=r"node id '\.\./etc' is not allowed"):
        pki.sign_node_csr(ca_key, ca_pem, csr, "../etc", timedelta(days=7))
    with pytest.raises(pki.PkiError, match="lifetime"):
        pki.sign_node_csr(ca_key, ca_pem, csr, "n1", timedelta(0))
    with pytest.raises(pki.PkiError, match="not the key of the CA certificate"):
        pki.sign_node_csr(pki.new_key(), ca_pem, csr, "n1", timedelta(days=7))
    with pytest.raises(pki.PkiError, match=r"expires at .* before this certificate"):
        pki.sign_node_csr(ca_key, ca_pem, csr, "n1", timedelta(days=4000))
    leaf = pki.sign_node_csr(ca_key, ca_pem, csr, "n1", timedelta(days=1))
    with pytest.raises(pki.PkiError, match="is not a CA certificate"):
        pki.sign_node_csr(ca_key, leaf.cert_pem, csr, "n1", timedelta(days=1))
    with pytest.raises(pki.PkiError, match="time zone"):
        pki.sign_node_csr(ca_key, ca_pem, csr, "n1", timedelta(days=1), now=datetime(2026, 1, 1))


def test_verify_refuses_another_ca_a_server_cert_a_wrong_key_and_expiry(ca):
    ca_key, ca_pem = ca
    node_key = pki.new_key()
    issued = pki.sign_node_csr(ca_key, ca_pem, pki.make_csr(node_key, "n1"), "n1",
                               timedelta(days=7))
    _, other_pem = pki.create_ca(name="llmgw cluster CA")  # same name, another key
    with pytest.raises(pki.PkiError, match="not issued by the CA"):
        pki.verify_node_cert(issued.cert_pem, other_pem)
    _, server_pem = pki.issue_server_cert(ca_key, ca_pem, ["n1"])
    with pytest.raises(pki.PkiError, match="lacks clientAuth"):
        pki.verify_node_cert(server_pem, ca_pem)
    with pytest.raises(pki.PkiError, match="does not certify this node's key"):
        pki.verify_node_cert(issued.cert_pem, ca_pem, pki.new_key())
    with pytest.raises(pki.PkiError, match="expired at"):
        pki.verify_node_cert(issued.cert_pem, ca_pem, now=issued.not_after + timedelta(seconds=1))
    with pytest.raises(pki.PkiError, match="not valid before"):
        pki.verify_node_cert(issued.cert_pem, ca_pem, now=issued.not_before - timedelta(hours=1))


def _self_signed(subject_cn: str | None, uris: list[str]) -> x509.Certificate:
    key = pki.new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)] if subject_cn else [])
    now = datetime.now(UTC)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .public_key(key.public_key()).serial_number(1)
               .not_valid_before(now).not_valid_after(now + timedelta(days=1)))
    if uris:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier(u) for u in uris]), critical=False)
    return builder.sign(key, hashes.SHA256())


def test_node_of_prefers_the_uri_then_the_cn():
    assert pki.node_of(_self_signed("cn-name", ["https://x", "llmgw://node/uri-name"])) \
        == "uri-name"
    assert pki.node_of(_self_signed("cn-name", ["https://x"])) == "cn-name"
    assert pki.node_of(_self_signed(None, [])) is None
    assert pki.node_of(_self_signed("bad name", [])) is None
    assert pki.node_of(_self_signed("ok", ["llmgw://node/../x"])) is None
    assert pki.node_uri("gpu-01") == "llmgw://node/gpu-01"


def test_load_refusals_say_what_the_input_was_not():
    with pytest.raises(pki.PkiError, match="not a PEM certificate"):
        pki.load_cert(b"-----BEGIN CERTIFICATE-----\nxx\n-----END CERTIFICATE-----\n")
    with pytest.raises(pki.PkiError, match="not a PEM private key"):
        pki.load_key(b"nope")
    encrypted = pki.new_key().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"))
    with pytest.raises(pki.PkiError, match="encrypted"):
        pki.load_key(encrypted)
    rsa_pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption())
    with pytest.raises(pki.PkiError, match="ECDSA or Ed25519"):
        pki.load_key(rsa_pem)
    with pytest.raises(pki.PkiError, match="not supported"):
        pki.new_key("rsa")


def test_fingerprint_is_the_sha256_of_the_der(ca):
    cert = pki.load_cert(ca[1])
    assert pki.fingerprint(cert) == cert.fingerprint(hashes.SHA256()).hex()
