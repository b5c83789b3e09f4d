"""A bundle's signature: Ed25519 over the exact bytes of manifest.json.

The private key stays on the machine that makes bundles (a PEM file, 0600); the control
plane trusts public keys written as one line, ``llmgw-bundle-ed25519:`` and the raw key
in base64, as ``llmgw bundle keygen`` prints it. A key's id is the first 16 hex digits of
the sha256 of the raw public key: the manifest names it, so a refusal can say which key
signed a bundle.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from llmgw.bundle.manifest import BundleError
from llmgw.files import write_atomically

PREFIX = "llmgw-bundle-ed25519:"
SIGNATURE_BYTES = 64


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_line(public: Ed25519PublicKey) -> str:
    """The public key as bundle.trusted_keys lists it."""
    return PREFIX + base64.b64encode(_raw(public)).decode()


def key_id(public: Ed25519PublicKey) -> str:
    return hashlib.sha256(_raw(public)).hexdigest()[:16]


def keygen(path: Path) -> str:
    """Write a new private key to ``path`` (PEM, 0600; an existing file is never replaced)
    and return its public key line."""
    if path.exists() or path.is_symlink():
        raise BundleError(f"{path} exists; llmgw never replaces a signing key: choose "
                          "another file, or remove that one if it is no longer needed")
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    try:
        write_atomically(path, pem, mode=0o600)
    except OSError as err:
        raise BundleError(f"cannot write the key to {path}: {err.strerror}") from None
    return public_line(private.public_key())


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise BundleError(f"cannot read the signing key {path}: {err.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as err:
        raise BundleError(f"{path} is not an unencrypted PEM private key ({err}); make one "
                          "with `llmgw bundle keygen`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BundleError(f"{path} holds a {type(key).__name__}, not an Ed25519 key; make "
                          "one with `llmgw bundle keygen`")
    return key


def load_public_key(line: str) -> Ed25519PublicKey:
    """A public key line (``llmgw-bundle-ed25519:BASE64``)."""
    text = line.strip()
    shown = text if len(text) <= 80 else text[:77] + "..."
    if not text.startswith(PREFIX):
        raise BundleError(f"trusted key {shown!r} does not start with {PREFIX}; copy the "
                          "line `llmgw bundle keygen` printed")
    try:
        raw = base64.b64decode(text[len(PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise BundleError(f"trusted key {shown!r} is not 32 bytes of base64 after "
                          f"{PREFIX}; copy the line `llmgw bundle keygen` printed")
    return Ed25519PublicKey.from_public_bytes(raw)


def sign(private: Ed25519PrivateKey, manifest_bytes: bytes) -> bytes:
    """manifest.sig's content: the base64 of the signature over ``manifest_bytes``."""
    return base64.b64encode(private.sign(manifest_bytes)) + b"\n"


def verify(manifest_bytes: bytes, signature: bytes, signer: str,
           trusted_keys: list[str]) -> str:
    """Check manifest.sig against the trusted key whose id is ``signer`` (the manifest's
    key_id); the key id it was signed with. Every trusted key line is parsed first, so a
    malformed one is named even when another would have matched."""
    trusted = {key_id(k): k for k in map(load_public_key, trusted_keys)}
    if not trusted:
        raise BundleError("no key is trusted: list the bundle signer's public key in "
                          "server.yaml's bundle.trusted_keys (or give --trusted-key)")
    public = trusted.get(signer)
    if public is None:
        raise BundleError(f"the bundle is signed by key {signer}, which bundle.trusted_keys "
                          "does not list: add that key's public line if you trust it")
    try:
        raw = base64.b64decode(signature.strip(), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != SIGNATURE_BYTES:
        raise BundleError(f"manifest.sig is not a base64 Ed25519 signature "
                          f"({SIGNATURE_BYTES} bytes): the bundle is damaged")
    try:
        public.verify(raw, manifest_bytes)
    except InvalidSignature:
        raise BundleError("the signature does not match the manifest (it was changed after "
                          "signing, or signed by another key): the bundle cannot be trusted"
                          ) from None
    return signer
