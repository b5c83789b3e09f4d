"""Reading the agent's TLS files (``llmgw.agent.discovery.tls``), on a throwaway PKI made
with ``cryptography`` in each test: CAs, node certificates signed by them or by another CA,
expired and not-yet-valid ones, an intermediate, encrypted and mismatched keys, and files
that are no PEM at all. ``issue`` is shared with the doctor's tests."""

from __future__ import annotations

import errno
import os
import pwd
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw.agent.discovery.tls import read_tls


@dataclass(frozen=True)
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_path: Path  # the certificate alone, PEM
    key_path: Path  # its key, unencrypted PKCS#8 PEM unless a passphrase was given


def issue(directory: Path, name: str, issuer: Issued | None = None, *, now: float | None = None,
          days_left: float = 365.0, days_since: float = 1.0, uri: str = "", ca: bool = False,
          passphrase: bytes = b"") -> Issued:
    """A certificate for CN=``name``, signed by ``issuer`` (self-signed without one), valid
    from ``days_since`` days before ``now`` to ``days_left`` days after it; written to
    ``directory/name.pem`` and ``directory/name.key``."""
    at = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer.cert.subject if issuer else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(at - timedelta(days=days_since))
               .not_valid_after(at + timedelta(days=days_left))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if uri:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
    cert = builder.sign(issuer.key if issuer else key, hashes.SHA256())
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    encryption = (serialization.BestAvailableEncryption(passphrase) if passphrase
                  else serialization.NoEncryption())
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8, encryption))
    key_path.chmod(0o600)
    return Issued(cert, key, cert_path, key_path)


def bundle(path: Path, *parts: Path) -> Path:
    """One PEM file made of others, in order (a CA bundle, a chain, a cert with its key)."""
    path.write_bytes(b"".join(p.read_bytes() for p in parts))
    return path


def read(ca: Path, cert: Path, key: Path):
    return read_tls(str(ca), str(cert), str(key))


def test_a_node_certificate_from_the_ca_is_read_whole(tmp_path):
    ca = issue(tmp_path, "llmgw CA", ca=True)
    node = issue(tmp_path, "node01", ca, uri="spiffe://llmgw/node/node01")
    report = read(ca.cert_path, node.cert_path, node.key_path)
    assert [(f.role, f.error, f.problem) for f in report.files] == [
        ("ca_file", "", ""), ("cert_file", "", ""), ("key_file", "", "")]
    assert report.not_before == node.cert.not_valid_before_utc.timestamp()
    assert report.not_after == node.cert.not_valid_after_utc.timestamp()
    assert (report.common_name, report.uris) == ("node01", ("spiffe://llmgw/node/node01",))
    assert report.identity == "CN=node01, spiffe://llmgw/node/node01"
    assert (report.key_matches, report.issued_by_ca, report.issuer_problem) == (True, True, "")
    key = report.file("key_file")
    assert (key.owner, key.mode) == (pwd.getpwuid(os.geteuid()).pw_name, 0o600)


def test_a_ca_file_may_hold_several_cas(tmp_path):
    old, new = issue(tmp_path, "CA 2025", ca=True), issue(tmp_path, "CA 2026", ca=True)
    node = issue(tmp_path, "node01", new)
    cas = bundle(tmp_path / "cas.pem", old.cert_path, new.cert_path)
    report = read(cas, node.cert_path, node.key_path)
    assert (report.issued_by_ca, report.identity) == (True, "CN=node01")


def test_a_certificate_from_another_ca_is_not_issued_by_the_configured_one(tmp_path):
    ours, theirs = issue(tmp_path, "llmgw CA", ca=True), issue(tmp_path, "other CA", ca=True)
    node = issue(tmp_path, "node01", theirs)
    report = read(ours.cert_path, node.cert_path, node.key_path)
    assert (report.issued_by_ca, report.key_matches) == (False, True)
    assert report.issuer_problem == ("it was issued by CN=other CA, and ca_file holds "
                                     "CN=llmgw CA")


def test_another_ca_by_the_same_name_is_told_apart_by_its_signature(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours = issue(tmp_path / "a", "llmgw CA", ca=True)
    theirs = issue(tmp_path / "b", "llmgw CA", ca=True)  # another cluster's, same name
    node = issue(tmp_path, "node01", theirs)
    report = read(ours.cert_path, node.cert_path, node.key_path)
    assert report.issued_by_ca is False
    assert report.issuer_problem.startswith("CN=llmgw CA in ca_file bears its issuer's name "
                                            "but did not sign it")


def test_an_intermediate_after_the_certificate_links_it_to_the_ca(tmp_path):
    root = issue(tmp_path, "root CA", ca=True)
    intermediate = issue(tmp_path, "issuing CA", root, ca=True)
    node = issue(tmp_path, "node01", intermediate)
    chain = bundle(tmp_path / "chain.pem", node.cert_path, intermediate.cert_path)
    report = read(root.cert_path, chain, node.key_path)
    assert (report.issued_by_ca, report.common_name) == (True, "node01")  # the first is it
    report = read(root.cert_path, node.cert_path, node.key_path)  # without the intermediate
    assert report.issued_by_ca is False
    assert report.issuer_problem == ("it was issued by CN=issuing CA, and ca_file holds "
                                     "CN=root CA")


def test_a_key_that_is_not_the_certificates(tmp_path):
    ca = issue(tmp_path, "llmgw CA", ca=True)
    node01, node02 = issue(tmp_path, "node01", ca), issue(tmp_path, "node02", ca)
    report = read(ca.cert_path, node01.cert_path, node02.key_path)
    assert (report.key_matches, report.issued_by_ca) == (False, True)


def test_one_file_holding_certificate_and_key_serves_as_both(tmp_path):
    ca = issue(tmp_path, "llmgw CA", ca=True)
    node = issue(tmp_path, "node01", ca)
    both = bundle(tmp_path / "node01-both.pem", node.cert_path, node.key_path)
    report = read(ca.cert_path, both, both)
    assert all(not f.problem for f in report.files)
    assert (report.key_matches, report.issued_by_ca) == (True, True)


def test_dates_are_the_certificates_own_past_2050_too(tmp_path):
    # RFC 5280 switches from UTCTime to GeneralizedTime for dates in 2050 and later.
    ca = issue(tmp_path, "llmgw CA", ca=True, days_left=40 * 365)
    node = issue(tmp_path, "node01", ca, now=datetime(2049, 6, 1, tzinfo=UTC).timestamp(),
                 days_left=400, days_since=30)
    report = read(ca.cert_path, node.cert_path, node.key_path)
    assert datetime.fromtimestamp(report.not_before, UTC) == datetime(2049, 5, 2, tzinfo=UTC)
    assert datetime.fromtimestamp(report.not_after, UTC) == datetime(2050, 7, 6, tzinfo=UTC)


def test_an_encrypted_key_is_said_so_without_prompting(tmp_path):
    ca = issue(tmp_path, "llmgw CA", ca=True)
    node = issue(tmp_path, "node01", ca, passphrase=b"secret")
    report = read(ca.cert_path, node.cert_path, node.key_path)
    assert report.file("key_file").problem == ("is encrypted; the agent cannot type its "
                                               "passphrase")
    assert report.key_matches is None  # not judged without the key
    assert report.issued_by_ca is True


def test_files_that_hold_the_wrong_thing(tmp_path):
    ca = issue(tmp_path, "llmgw CA", ca=True)
    node = issue(tmp_path, "node01", ca)
    junk = tmp_path / "junk.txt"
    junk.write_text("this is not a certificate\n")
    report = read(junk, node.key_path, node.cert_path)  # cert and key swapped
    assert [f.problem for f in report.files] == [
        "holds no PEM certificate", "holds no PEM certificate", "holds no PEM private key"]
    assert (report.not_after, report.key_matches, report.issued_by_ca) == (None, None, None)

    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    problem = read(ca.cert_path, broken, node.key_path).file("cert_file").problem
    assert problem.startswith("holds a certificate that cannot be parsed: ")


def test_files_that_cannot_be_read(tmp_path):
    (tmp_path / "certs").mkdir()
    report = read(tmp_path / "certs", tmp_path / "missing.pem", tmp_path / "missing.key")
    assert [(f.error, f.errno) for f in report.files] == [
        ("Is a directory", errno.EISDIR), ("No such file or directory", errno.ENOENT),
        ("No such file or directory", errno.ENOENT)]
    assert report.file("ca_file").mode is not None  # stat saw the directory
    assert (report.not_after, report.issued_by_ca) == (None, None)
