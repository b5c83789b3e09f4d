"""The cluster's certificates: its CA, the server's certificate and each node's.

Pure functions over ``cryptography`` objects and PEM bytes; nothing here reads or writes a
file or dials anyone. Two kinds of leaf certificate, with distinct key usages so that one
can never pass for the other: the server's (``serverAuth``, named by its addresses) and a
node's (``clientAuth``, named by its node id as the URI SAN ``llmgw://node/<id>`` and the
CN). A node's id is always the one the CA chose when it signed, never what the CSR or a
later message says. Every refusal is a :class:`PkiError` whose message says what to do.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.core.names import NameRuleError, check_element

PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey

KEY_KINDS = ("ecdsa", "ed25519")
NODE_URI_PREFIX = "llmgw://node/"
# Certificates start a little in the past, so a peer whose clock lags is not refused.
_BACKDATE = timedelta(minutes=5)


class PkiError(Exception):
    """A key, CSR or certificate that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class Issued:
    """A node certificate just signed, with what the store records about it."""

    cert_pem: bytes
    serial: int
    not_before: datetime
    not_after: datetime


# --- keys ----------------------------------------------------------------------------------


def new_key(kind: str = "ecdsa") -> PrivateKey:
    """A fresh private key: ``ecdsa`` (P-256) or ``ed25519``."""
    if kind == "ecdsa":
        return ec.generate_private_key(ec.SECP256R1())
    if kind == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    raise PkiError(f"key type {kind!r} is not supported: use one of {', '.join(KEY_KINDS)}")


def key_pem(key: PrivateKey) -> bytes:
    """The key as unencrypted PKCS#8 PEM (a service cannot type a passphrase)."""
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def load_key(pem: bytes) -> PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except TypeError:  # cryptography's word for "encrypted, and no password given"
        raise PkiError("the private key is encrypted; store it unencrypted with mode 0600 "
                       "(`openssl pkey -in KEY -out NEW.key`)") from None
    except (ValueError, UnsupportedAlgorithm) as err:
        raise PkiError(f"this is not a PEM private key llmgw can read: {err}") from None
    if not isinstance(key, PrivateKey):
        raise PkiError(f"a {type(key).__name__} is not supported: llmgw uses ECDSA or "
                       "Ed25519 keys")
    return key


def load_cert(pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as err:
        raise PkiError(f"this is not a PEM certificate: {err}") from None


def fingerprint(cert: x509.Certificate) -> str:
    """The SHA-256 of the certificate's DER, lowercase hex: what ``--ca-sha256`` pins."""
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def _public_der(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def _hash_for(key: PrivateKey) -> hashes.HashAlgorithm | None:
    # Ed25519 signs the message itself; it takes no separate hash.
    return None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()


def _now(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    if now.tzinfo is None:
        raise PkiError("`now` must carry a time zone (UTC)")
    return now


def _ca(ca_key: PrivateKey, ca_cert_pem: bytes) -> x509.Certificate:
    """The CA certificate, checked to be a CA and to belong to ``ca_key``."""
    ca_cert = load_cert(ca_cert_pem)
    try:
        constraints = ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise PkiError(f"{ca_cert.subject.rfc4514_string()} is not a CA certificate "
                       "(no basicConstraints CA=true); point at the cluster CA's ca.pem")
    if _public_der(ca_cert.public_key()) != _public_der(ca_key.public_key()):
        raise PkiError("the CA key is not the key of the CA certificate; the ca_key_file and "
                       "ca_file must come from the same `llmgw server init`")
    return ca_cert


def _authority_key_id(ca_cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key())


def _leaf_usage() -> x509.KeyUsage:
    # digitalSignature only: ECDSA and Ed25519 keys never encipher a key (that is RSA's).
    return x509.KeyUsage(digital_signature=True, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         key_cert_sign=False, crl_sign=False, encipher_only=False,
                         decipher_only=False)


# --- the CA and the server -----------------------------------------------------------------


def create_ca(name: str = "llmgw cluster CA", kind: str = "ecdsa",
              days: int = 3650) -> tuple[PrivateKey, bytes]:
    """A new self-signed cluster CA: (its key, its certificate PEM). It signs leaf
    certificates only (path length 0)."""
    if days <= 0:
        raise PkiError(f"a CA valid for {days} days is not valid at all; give days > 0")
    key = new_key(kind)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE).not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, _hash_for(key))
    )
    return key, cert.public_bytes(serialization.Encoding.PEM)


def _host_name(host: str) -> x509.GeneralName:
    host = host.strip()
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or not all(label and len(label) <= 63 and label.replace("-", "").isalnum()
                           and label.isascii() for label in labels):
        raise PkiError(f"{host!r} is neither an IP address nor a DNS name; give each "
                       "address the server is reached at (e.g. 10.0.0.5 or cp.example.org)")
    return x509.DNSName(host.rstrip(".").lower())


def issue_server_cert(ca_key: PrivateKey, ca_cert_pem: bytes, hosts: list[str], days: int = 397,
                      kind: str = "ecdsa") -> tuple[bytes, bytes]:
    """The server's certificate for ``hosts`` (IP addresses and DNS names): (key PEM,
    certificate PEM). ``serverAuth`` only, so a node cannot present it as a client."""
    if not hosts:
        raise PkiError("a server certificate needs at least one address it is reached at")
    if days <= 0:
        raise PkiError(f"a certificate valid for {days} days is not valid at all; give days > 0")
    ca_cert = _ca(ca_key, ca_cert_pem)
    names: list[x509.GeneralName] = []
    for host in hosts:
        name = _host_name(host)
        if name not in names:
            names.append(name)
    key = new_key(kind)
    now = datetime.now(UTC)
    not_after = min(now + timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(names[0].value))]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_usage(), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(_authority_key_id(ca_cert), critical=False)
        .sign(ca_key, _hash_for(ca_key))
    )
    return key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


# --- nodes ---------------------------------------------------------------------------------


def node_uri(node: str) -> str:
    return f"{NODE_URI_PREFIX}{node}"


def _check_node(node: str) -> str:
    try:
        return check_element(node, "node id")
    except NameRuleError as err:
        raise PkiError(str(err)) from None


def make_csr(key: PrivateKey, node: str) -> bytes:
    """A certificate request for ``node``, signed by the node's own key (which stays on
    the node): CN=node and the URI SAN."""
    _check_node(node)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(
            node_uri(node))]), critical=False)
        .sign(key, _hash_for(key))
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def _load_csr(csr_pem: bytes) -> x509.CertificateSigningRequest:
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as err:
        raise PkiError(f"this is not a PEM certificate request (CSR): {err}") from None
    try:
        valid = csr.is_signature_valid
    except (ValueError, UnsupportedAlgorithm) as err:
        raise PkiError(f"the CSR's signature cannot be checked: {err}") from None
    if not valid:
        raise PkiError("the CSR's signature does not verify: it was not signed by the key it "
                       "carries (damaged in transit, or edited); make a new one")
    public = csr.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey):
        raise PkiError(f"the CSR carries a {type(public).__name__}; llmgw signs ECDSA and "
                       "Ed25519 node keys only (`llmgw agent join` makes one)")
    if isinstance(public, ec.EllipticCurvePublicKey) and public.curve.key_size < 256:
        raise PkiError(f"the CSR's key is on {public.curve.name}, under 256 bits; use P-256")
    return csr


def sign_node_csr(ca_key: PrivateKey, ca_cert_pem: bytes, csr_pem: bytes, node: str,
                  lifetime: timedelta, now: datetime | None = None) -> Issued:
    """Sign a node's CSR as ``node``, whatever name the CSR asked for: the CA, not the
    node, decides who it is. ``clientAuth`` only, so it cannot serve as a server."""
    _check_node(node)
    if lifetime <= timedelta(0):
        raise PkiError(f"a node certificate lifetime of {lifetime} is not valid; give one "
                       "above zero (tls.node_cert_days)")
    ca_cert = _ca(ca_key, ca_cert_pem)
    csr = _load_csr(csr_pem)
    at = _now(now)
    not_before = at - _BACKDATE
    not_after = at + lifetime
    if not_after > ca_cert.not_valid_after_utc:
        raise PkiError(f"the cluster CA expires at {ca_cert.not_valid_after_utc:%Y-%m-%d %H:%M} "
                       "UTC, before this certificate would; make a new CA")
    serial = x509.random_serial_number()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .issuer_name(ca_cert.subject).public_key(csr.public_key())
        .serial_number(serial).not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_usage(), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(
            node_uri(node))]), critical=False)
        .add_extension(_authority_key_id(ca_cert), critical=False)
        .sign(ca_key, _hash_for(ca_key))
    )
    # The certificate keeps whole seconds; report exactly what it says.
    return Issued(cert.public_bytes(serialization.Encoding.PEM), serial,
                  cert.not_valid_before_utc, cert.not_valid_after_utc)


def node_of(cert: x509.Certificate) -> str | None:
    """The node a certificate names: its ``llmgw://node/<id>`` URI SAN, else its CN; None
    when it names none, or a name the node rules refuse."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except (x509.ExtensionNotFound, ValueError):
        uris = []
    ours = [u[len(NODE_URI_PREFIX):] for u in uris if u.startswith(NODE_URI_PREFIX)]
    if ours:
        candidate = ours[0]
    else:
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not names:
            return None
        candidate = str(names[0].value)
    try:
        return check_element(candidate, "node id")
    except NameRuleError:
        return None


def verify_node_cert(cert_pem: bytes, ca_cert_pem: bytes, key: PrivateKey | None = None,
                     now: datetime | None = None) -> str:
    """Check a node certificate as a node (and the server) must trust it: issued by the CA,
    valid at ``now``, meant for clientAuth, naming a node, and (when ``key`` is given)
    certifying that key. Returns the node id."""
    cert = load_cert(cert_pem)
    ca_cert = load_cert(ca_cert_pem)
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (InvalidSignature, ValueError, TypeError) as err:
        raise PkiError(f"the certificate was not issued by the CA "
                       f"{ca_cert.subject.rfc4514_string()} ({err or 'bad signature'}); "
                       "is this the right cluster?") from None
    at = _now(now)
    if at < cert.not_valid_before_utc:
        raise PkiError(f"the certificate is not valid before {cert.not_valid_before_utc} UTC; "
                       "is this machine's clock right?")
    if at > cert.not_valid_after_utc:
        raise PkiError(f"the certificate expired at {cert.not_valid_after_utc} UTC; join "
                       "again with a new token (llmgw ctl nodes add NAME)")
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is None or ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
        raise PkiError("the certificate is not a node certificate (its extendedKeyUsage "
                       "lacks clientAuth); use the one `llmgw agent join` wrote")
    node = node_of(cert)
    if node is None:
        raise PkiError("the certificate names no node (no llmgw://node/ URI, no usable CN)")
    if key is not None and _public_der(key.public_key()) != _public_der(cert.public_key()):
        raise PkiError("the certificate does not certify this node's key; the server "
                       "answered for another request")
    return node
