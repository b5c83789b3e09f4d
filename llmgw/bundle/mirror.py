"""The control plane's mirror: the bundles it imported, and the one it serves.

    <mirror_dir>/current          a symlink to .bundles/<id>, swapped by one rename
    <mirror_dir>/.bundles/<id>/   one imported bundle: manifest.json, manifest.sig, files/
    <mirror_dir>/.import-*/       an import's private staging (removed when it is refused)

``<id>`` is the bundle's created_at (YYYYMMDDTHHMMSSZ) and its manifest's sha256[:12], so
the listing sorts by age. An import verifies the bundle inside the staging folder (what
is checked is what is used), then moves it under .bundles and swaps ``current``; a
refusal at any step leaves ``current`` and .bundles as they were. The bundle before the
current one is kept, so an operator can go back to it (``--allow-downgrade``).

Readers (the server's mirror routes) take ``current`` as verified: the manifest there
was checked at import and nothing else writes under the mirror.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from llmgw.bundle import manifest as mf
from llmgw.bundle import verify
from llmgw.bundle.manifest import BundleError, Manifest
from llmgw.config import ServerConfig

CURRENT = "current"
BUNDLES = ".bundles"
STAGING_PREFIX = ".import-"
LOCK = ".lock"


def configured_dir(server: ServerConfig) -> Path:
    """The server's mirror folder: bundle.mirror_dir, else <state_dir>/mirror."""
    return Path(server.bundle.mirror_dir or Path(server.state_dir) / "mirror")


def bundle_id(manifest: Manifest, manifest_sha256: str) -> str:
    """The folder name of an imported bundle: sorts by age, unique by content."""
    created = manifest.created_at.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{created}-{manifest_sha256[:12]}"


def current_dir(mirror_dir: str | Path) -> Path | None:
    """The folder of the bundle the mirror serves, or None before the first import."""
    link = Path(mirror_dir) / CURRENT
    try:
        target = os.readlink(link)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise BundleError(f"{link}: not the mirror's symlink ({err.strerror}); "
                          "import a bundle again to set it") from None
    # Only ever .bundles/<id>: a link pointing elsewhere was not made by an import.
    parts = Path(target).parts
    if len(parts) != 2 or parts[0] != BUNDLES:
        raise BundleError(f"{link} points at {target!r}, not at {BUNDLES}/<id>: "
                          "import a bundle again to set it")
    mf.check_element(parts[1], "the mirror's current bundle")
    return Path(mirror_dir) / BUNDLES / parts[1]


def current_manifest(mirror_dir: str | Path) -> Manifest | None:
    """The manifest of the bundle the mirror serves (verified at import), or None."""
    folder = current_dir(mirror_dir)
    if folder is None:
        return None
    path = folder / mf.MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{path} is missing: import the bundle again") from None
    return mf.decode(data, str(path))


def file_path(mirror_dir: str | Path, path: str) -> Path:
    """Where the current bundle keeps ``path`` (a manifest path). The path is checked as
    plain elements before it is joined, so it never leads outside the bundle; whether
    the manifest lists it is the caller's question (current_manifest)."""
    mf.check_path(path)
    folder = current_dir(mirror_dir)
    if folder is None:
        raise BundleError(f"{mirror_dir} holds no imported bundle: run "
                          "`llmgw bundle import` first")
    return folder / mf.FILES / path


def bundles(mirror_dir: str | Path) -> list[str]:
    """The ids of the bundles the mirror keeps, oldest first."""
    try:
        return sorted(p.name for p in (Path(mirror_dir) / BUNDLES).iterdir()
                      if not p.name.startswith("."))
    except FileNotFoundError:
        return []


@dataclass(frozen=True, slots=True)
class Imported:
    manifest: Manifest
    bundle_id: str
    sha256: str  # of manifest.json
    files: int
    size: int
    # True when the bundle was already the mirror's current one: nothing changed.
    unchanged: bool = False


@contextlib.contextmanager
def _locked(mirror: Path) -> Iterator[None]:
    """One import at a time per mirror; a second waits for the first."""
    fd = os.open(mirror / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def import_bundle(bundle: Path, mirror_dir: str | Path, trusted_keys: list[str],
                  sha256: str | None = None, allow_downgrade: bool = False,
                  now: datetime | None = None,
                  on_file: verify.OnFile | None = None) -> Imported:
    """Verify ``bundle`` into a private staging folder in the mirror, then make it the
    mirror's current bundle. Any refusal (a BundleError) leaves the mirror as it was."""
    mirror = Path(mirror_dir)
    try:
        mirror.mkdir(parents=True, exist_ok=True)
        (mirror / BUNDLES).mkdir(exist_ok=True)
    except OSError as err:
        raise BundleError(f"cannot use the mirror folder {mirror}: {err.strerror}") from None
    with _locked(mirror):
        # An import that was killed leaves its staging behind; none runs now (the lock).
        for stale in mirror.glob(STAGING_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        previous = current_dir(mirror)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=mirror))  # 0700
        try:
            with verify.open_bundle(bundle) as source:
                manifest, data, signature, digest = verify.check_manifest(
                    source, trusted_keys, sha256, now)
                new_id = bundle_id(manifest, digest)
                if previous is not None and previous.name == new_id:
                    return Imported(manifest, new_id, digest, len(manifest.files),
                                    sum(f.size for f in manifest.files), unchanged=True)
                _refuse_downgrade(mirror, manifest, allow_downgrade)
                (staging / mf.MANIFEST).write_bytes(data)
                (staging / mf.SIGNATURE).write_bytes(signature)
                files, size = verify.check_files(source, manifest, staging / mf.FILES,
                                                 on_file)
            _install(mirror, staging, new_id, previous)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return Imported(manifest, new_id, digest, files, size)


def _refuse_downgrade(mirror: Path, manifest: Manifest, allow: bool) -> None:
    current = current_manifest(mirror)
    if current is None or allow or manifest.created_at >= current.created_at:
        return
    raise BundleError(
        f"the bundle was made {manifest.created_at.isoformat()}, before the mirror's current "
        f"one ({current.created_at.isoformat()}, llmgw {current.llmgw_version}): going back "
        "is refused unless you pass --allow-downgrade")


def _install(mirror: Path, staging: Path, new_id: str, previous: Path | None) -> None:
    """Move the verified staging folder to .bundles/<id>, point ``current`` at it with one
    rename, and remove the bundles older than the one it replaced."""
    folder = mirror / BUNDLES / new_id
    if folder.exists():
        # An older copy of the same bundle (kept, not current): the fresh copy replaces it.
        aside = mirror / BUNDLES / f".old-{secrets.token_hex(4)}"
        os.rename(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(staging, folder)
    link = mirror / f".{CURRENT}-{secrets.token_hex(4)}"
    os.symlink(f"{BUNDLES}/{new_id}", link)
    try:
        os.replace(link, mirror / CURRENT)
    except BaseException:
        link.unlink(missing_ok=True)
        raise
    _fsync_dir(mirror)
    keep = {new_id} | ({previous.name} if previous is not None else set())
    for old in (mirror / BUNDLES).iterdir():
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
