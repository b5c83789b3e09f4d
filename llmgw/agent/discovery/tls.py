"""The agent's TLS files, read as the agent would read them: whether each one (tls.ca_file,
tls.cert_file, tls.key_file) can be read and holds what it should, and what the node
certificate says: who it names, when it is valid, whether the key is its key, and whether
the configured CA issued it. Parsed with ``cryptography``; nothing here dials anyone.
"""

from __future__ import annotations

import contextlib
import os
import pwd
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    PublicFormat,
    load_pem_private_key,
)
from cryptography.x509.oid import NameOID

_MAX_BYTES = 1 << 20  # PEM files are a few KiB; a CA bundle a few hundred


@dataclass(frozen=True)
class TlsFile:
    role: str  # ca_file, cert_file or key_file
    path: str
    error: str = ""  # why it could not be read (the OS's words); empty when it was
    errno: int | None = None
    owner: str = ""  # its owner and permission bits, where stat could see them
    mode: int | None = None
    problem: str = ""  # read, but not what it should be ("holds no PEM certificate")


@dataclass(frozen=True)
class TlsReport:
    """The three files, and what the node certificate (the first in cert_file) says.
    A field about the certificate is None (or empty) where the files it needs were not
    usable, so it was not judged."""

    files: tuple[TlsFile, ...]  # ca_file, cert_file, key_file, in that order
    not_before: float | None = None
    not_after: float | None = None
    common_name: str = ""  # the subject's CN
    uris: tuple[str, ...] = ()  # URI subject alternative names
    key_matches: bool | None = None  # key_file holds the certificate's private key
    issued_by_ca: bool | None = None  # a certificate in ca_file issued it
    issuer_problem: str = ""  # why not, when issued_by_ca is False

    def file(self, role: str) -> TlsFile:
        return next(f for f in self.files if f.role == role)

    @property
    def identity(self) -> str:
        """Who the certificate names: its CN and URI SANs, as an operator reads them."""
        return ", ".join(filter(None, [self.common_name and f"CN={self.common_name}",
                                       *self.uris]))


def read_tls(ca_file: str, cert_file: str, key_file: str) -> TlsReport:
    """Read and judge the three files. Never raises for a missing, unreadable or
    malformed file: each says what is wrong with it."""
    ca, cas = _certificates(*_read("ca_file", ca_file))
    cert, chain = _certificates(*_read("cert_file", cert_file))
    key, private = _private_key(*_read("key_file", key_file))
    files = (ca, cert, key)
    if not chain:
        return TlsReport(files)
    leaf = chain[0]
    key_matches = None
    if private is not None:
        # A key type cryptography cannot compare is left to the TLS handshake.
        with contextlib.suppress(ValueError, UnsupportedAlgorithm):
            key_matches = _spki(leaf.public_key()) == _spki(private.public_key())
    problem = _issuer_problem(chain, cas) if cas else ""
    return TlsReport(
        files, not_before=leaf.not_valid_before_utc.timestamp(),
        not_after=leaf.not_valid_after_utc.timestamp(), common_name=_common_name(leaf),
        uris=_uris(leaf), key_matches=key_matches,
        issued_by_ca=(not problem) if cas else None, issuer_problem=problem)


def _read(role: str, path: str) -> tuple[TlsFile, bytes | None]:
    owner, mode = "", None
    try:
        st = os.stat(path)
        owner, mode = _owner(st.st_uid), st.st_mode & 0o7777
        with open(path, "rb") as f:
            return TlsFile(role, path, owner=owner, mode=mode), f.read(_MAX_BYTES)
    except OSError as err:
        return TlsFile(role, path, err.strerror or str(err), err.errno, owner, mode), None


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _with_problem(fact: TlsFile, problem: str) -> TlsFile:
    return TlsFile(fact.role, fact.path, fact.error, fact.errno, fact.owner, fact.mode, problem)


def _certificates(fact: TlsFile, data: bytes | None) -> tuple[TlsFile, list[x509.Certificate]]:
    if data is None:
        return fact, []
    try:
        return fact, x509.load_pem_x509_certificates(data)
    except ValueError as err:
        if b"-----BEGIN CERTIFICATE-----" not in data:
            return _with_problem(fact, "holds no PEM certificate"), []
        return _with_problem(fact, f"holds a certificate that cannot be parsed: {err}"), []


def _private_key(fact: TlsFile, data: bytes | None) -> tuple[TlsFile, PrivateKeyTypes | None]:
    if data is None:
        return fact, None
    try:
        return fact, load_pem_private_key(data, password=None)
    except TypeError:  # cryptography's word for "encrypted, and no password given"
        return _with_problem(fact, "is encrypted; the agent cannot type its passphrase"), None
    except (ValueError, UnsupportedAlgorithm) as err:
        if b"PRIVATE KEY-----" not in data:
            return _with_problem(fact, "holds no PEM private key"), None
        return _with_problem(fact, f"holds a private key that cannot be read: {err}"), None


def _spki(public_key) -> bytes:
    return public_key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)


def _common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _uris(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError):  # none, or one that does not parse
        return ()
    return tuple(san.get_values_for_type(x509.UniformResourceIdentifier))


def _name(name: x509.Name) -> str:
    return name.rfc4514_string() or "(an empty name)"


def _signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> str:
    """Empty when ``issuer`` signed ``cert``; otherwise why not."""
    try:
        cert.verify_directly_issued_by(issuer)
    except InvalidSignature:
        return (f"{_name(issuer.subject)} in ca_file bears its issuer's name but did not "
                "sign it (another CA by the same name?)")
    except (ValueError, TypeError) as err:  # names differ, or a key or algorithm it lacks
        return str(err)
    return ""


def _issuer_problem(chain: list[x509.Certificate], cas: list[x509.Certificate]) -> str:
    """Empty when a CA in ca_file issued the certificate, directly or through the
    intermediates that follow it in cert_file; otherwise why not."""
    for i, cert in enumerate(chain):
        reasons = [_signed_by(cert, ca) for ca in cas if ca.subject == cert.issuer]
        if "" in reasons:
            return ""
        if i + 1 < len(chain) and not _signed_by(cert, chain[i + 1]):
            continue  # an intermediate in cert_file signed it: try that one against the CA
        if reasons:
            return reasons[0]
        held = "; ".join(_name(ca.subject) for ca in cas)
        return f"it was issued by {_name(cert.issuer)}, and ca_file holds {held}"
    return ""
