"""Signed bundles made in a test from local files, with llmgw.bundle.manifest and
cryptography directly: the layout and signature a bundle has, independent of the code
that makes them (`llmgw bundle create`)."""

from __future__ import annotations

import base64
import hashlib
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from llmgw import __version__
from llmgw.bundle import manifest as mf


@dataclass(frozen=True)
class Signer:
    key: Ed25519PrivateKey

    @classmethod
    def new(cls) -> Signer:
        return cls(Ed25519PrivateKey.generate())

    @property
    def raw(self) -> bytes:
        return self.key.public_key().public_bytes(serialization.Encoding.Raw,
                                                  serialization.PublicFormat.Raw)

    @property
    def line(self) -> str:
        """The public key as bundle.trusted_keys lists it."""
        return "llmgw-bundle-ed25519:" + base64.b64encode(self.raw).decode()

    @property
    def key_id(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()[:16]


@dataclass(frozen=True)
class Made:
    root: Path
    manifest: mf.Manifest
    sha256: str  # of manifest.json


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def make_bundle(root: Path, signer: Signer, *,
                engines: dict[tuple[str, str], dict[str, Path]] | None = None,
                models: dict[str, tuple[str, str, dict[str, Path]]] | None = None,
                created_at: datetime | None = None,
                valid_for: timedelta = timedelta(days=30)) -> Made:
    """A bundle directory at ``root``: ``engines`` {(name, version): {file: source}},
    ``models`` {name: (ORG/NAME, revision, {path: source})}, each source copied to its
    place under files/, then manifest.json and its signature."""
    created_at = created_at or datetime.now(UTC).replace(microsecond=0)
    files: list[mf.BundleFile] = []

    def put(path: str, source: Path) -> str:
        dest = root / mf.FILES / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
        files.append(mf.BundleFile(path=path, size=dest.stat().st_size, sha256=_sha256(dest)))
        return path

    built = [mf.EngineBuild(name=name, version=version,
                            files=[put(mf.engine_path(name, version, f), src)
                                   for f, src in sorted(parts.items())])
             for (name, version), parts in sorted((engines or {}).items())]
    held = [mf.ModelFiles(name=name, repo=repo, revision=revision,
                          files=[put(mf.model_path(repo, revision, p), src)
                                 for p, src in sorted(parts.items())])
            for name, (repo, revision, parts) in sorted((models or {}).items())]
    manifest = mf.Manifest(llmgw_version=__version__, created_at=created_at,
                           expires_at=created_at + valid_for, key_id=signer.key_id,
                           engines=built, models=held, files=files)
    data = mf.encode(manifest)
    (root / mf.MANIFEST).write_bytes(data)
    (root / mf.SIGNATURE).write_bytes(base64.b64encode(signer.key.sign(data)) + b"\n")
    return Made(root, manifest, hashlib.sha256(data).hexdigest())
