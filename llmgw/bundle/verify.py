"""Checking a bundle, a directory or a tar of one, before anything of it is used.

In this order, each refusal a BundleError naming what is wrong: the tar's entries (plain
files and folders with plain names only: no links, devices, absolute or ``..`` names);
the signature, by a key the control plane trusts; the manifest's sha256 when the operator
carried one; the expiry; then the files: none missing, none extra, each of the size and
sha256 the manifest says. :func:`check_files` can copy the files as it hashes them, so an
import uses exactly the bytes that were checked (mirror.py).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO, Protocol

import msgspec

from llmgw.bundle import manifest as mf
from llmgw.bundle import signing
from llmgw.bundle.manifest import BundleError, Manifest

CHUNK = 2**20
MAX_MANIFEST_BYTES = 64 * 2**20
MAX_SIGNATURE_BYTES = 1024
MAX_ENTRIES = 200_000  # a tar's entries, a directory's files

OnFile = Callable[[str, int], None]  # (path, size) as each file is checked


@dataclass(frozen=True, slots=True)
class Checked:
    manifest: Manifest
    sha256: str  # of manifest.json
    files: int
    size: int


class Source(Protocol):
    """A bundle as read: its two small files and the files under files/."""

    where: str

    def read_meta(self, name: str, limit: int) -> bytes: ...

    def listing(self) -> dict[str, int]: ...  # path under files/ -> size

    def open(self, path: str) -> BinaryIO: ...


def _fail(where: str, text: str) -> BundleError:
    return BundleError(f"{where}: {text}")


class DirSource:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)

    def read_meta(self, name: str, limit: int) -> bytes:
        path = self.root / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            raise _fail(self.where, f"{name} is missing: this is not a bundle") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise _fail(self.where, f"{name} is not a regular file of at most {limit} bytes")
        with _open_plain(path) as f:
            return f.read(limit + 1)[:limit]

    def listing(self) -> dict[str, int]:
        for entry in os.scandir(self.root):
            if entry.name not in (mf.MANIFEST, mf.SIGNATURE, mf.FILES):
                raise _fail(self.where, f"extra file {entry.name}: a bundle holds "
                            f"{mf.MANIFEST}, {mf.SIGNATURE} and {mf.FILES}/ only")
        found: dict[str, int] = {}
        top = self.root / mf.FILES
        if top.is_symlink() or (top.exists() and not top.is_dir()):
            raise _fail(self.where, f"{mf.FILES} is not a folder")
        if top.is_dir():
            self._walk(top, "", found)
        return found

    def _walk(self, folder: Path, prefix: str, found: dict[str, int]) -> None:
        for entry in os.scandir(folder):
            rel = prefix + entry.name
            if entry.is_symlink():
                raise _fail(self.where, f"{mf.FILES}/{rel} is a symbolic link; a bundle "
                            "holds plain files only")
            if entry.is_dir(follow_symlinks=False):
                self._walk(Path(entry.path), rel + "/", found)
            elif entry.is_file(follow_symlinks=False):
                if len(found) >= MAX_ENTRIES:
                    raise _fail(self.where, f"more than {MAX_ENTRIES} files")
                found[rel] = entry.stat(follow_symlinks=False).st_size
            else:
                raise _fail(self.where, f"{mf.FILES}/{rel} is not a plain file")

    def open(self, path: str) -> BinaryIO:
        return _open_plain(self.root / mf.FILES / mf.check_path(path))


def _open_plain(path: Path) -> BinaryIO:
    # O_NOFOLLOW: a file swapped for a link after the listing is still refused.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise BundleError(f"cannot read {path}: {err.strerror}") from None
    return os.fdopen(fd, "rb")


_KINDS = [(tarfile.TarInfo.issym, "a symbolic link"), (tarfile.TarInfo.islnk, "a hard link"),
          (tarfile.TarInfo.ischr, "a character device"),
          (tarfile.TarInfo.isblk, "a block device"), (tarfile.TarInfo.isfifo, "a FIFO")]


class TarSource:
    """A tar (plain or compressed), read member by member: nothing is extracted by
    tarfile, and every entry is checked before any is read."""

    def __init__(self, path: Path) -> None:
        self.where = str(path)
        try:
            self.tar = tarfile.open(path, "r:*")  # noqa: SIM115 — closed by close()
        except (OSError, tarfile.TarError) as err:
            raise _fail(self.where, f"not a readable tar ({err})") from None
        try:
            self.members = self._check_members()
        except BaseException:
            self.tar.close()
            raise

    def _check_members(self) -> dict[str, tarfile.TarInfo]:
        members: dict[str, tarfile.TarInfo] = {}
        for count, info in enumerate(self.tar, 1):
            if count > MAX_ENTRIES:
                raise _fail(self.where, f"more than {MAX_ENTRIES} entries")
            name = info.name.removeprefix("./")
            if name in ("", "."):
                continue
            for test, kind in _KINDS:
                if test(info):
                    raise _fail(self.where, f"{info.name} is {kind}; a bundle holds plain "
                                "files and folders only")
            if not (info.isreg() or info.isdir()):
                raise _fail(self.where, f"{info.name} is not a plain file or folder")
            try:
                mf.check_path(name)
            except BundleError as err:
                raise _fail(self.where, f"entry {info.name!r}: {err}") from None
            top = name.split("/", 1)[0]
            if info.isdir():
                known = top == mf.FILES
            else:
                known = name in (mf.MANIFEST, mf.SIGNATURE) or (
                    top == mf.FILES and name != mf.FILES)
            if not known:
                raise _fail(self.where, f"extra file {name}: a bundle holds {mf.MANIFEST}, "
                            f"{mf.SIGNATURE} and {mf.FILES}/ only")
            if name in members:
                raise _fail(self.where, f"{name} is in the tar twice")
            members[name] = info
        return members

    def read_meta(self, name: str, limit: int) -> bytes:
        info = self.members.get(name)
        if info is None or not info.isreg():
            raise _fail(self.where, f"{name} is missing: this is not a bundle")
        if info.size > limit:
            raise _fail(self.where, f"{name} is larger than {limit} bytes")
        with self.open_member(info) as f:
            return f.read(limit)

    def listing(self) -> dict[str, int]:
        prefix = mf.FILES + "/"
        return {name[len(prefix):]: info.size for name, info in self.members.items()
                if info.isreg() and name.startswith(prefix)}

    def open(self, path: str) -> BinaryIO:
        return self.open_member(self.members[f"{mf.FILES}/{path}"])

    def open_member(self, info: tarfile.TarInfo) -> BinaryIO:
        f = self.tar.extractfile(info)
        assert f is not None  # a regular member always has content
        return f

    def close(self) -> None:
        self.tar.close()


@contextmanager
def open_bundle(path: Path) -> Iterator[Source]:
    """The bundle at ``path``: a directory, or a tar file."""
    if path.is_dir():
        yield DirSource(path)
        return
    if not path.is_file():
        raise BundleError(f"{path}: no such bundle (a directory or a tar file)")
    source = TarSource(path)
    try:
        yield source
    finally:
        source.close()


class _Signer(msgspec.Struct):
    key_id: str


def check_manifest(source: Source, trusted_keys: list[str], sha256: str | None = None,
                   now: datetime | None = None) -> tuple[Manifest, bytes, bytes, str]:
    """The signature, the carried sha256 and the expiry, in that order: the manifest, its
    bytes, the signature's bytes and the manifest's sha256."""
    data = source.read_meta(mf.MANIFEST, MAX_MANIFEST_BYTES)
    signature = source.read_meta(mf.SIGNATURE, MAX_SIGNATURE_BYTES)
    try:
        signer = msgspec.json.decode(data, type=_Signer).key_id
    except msgspec.DecodeError:
        raise _fail(source.where, f"{mf.MANIFEST} is not a bundle manifest (no key_id)"
                    ) from None
    signing.verify(data, signature, signer, trusted_keys)
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256.strip().lower():
        raise BundleError(f"the manifest's sha256 is {digest}, not the {sha256.strip()} "
                          "you carried: this is not the bundle that was made")
    manifest = mf.decode(data, f"{source.where}: {mf.MANIFEST}")
    if manifest.created_at.tzinfo is None or manifest.expires_at.tzinfo is None:
        raise _fail(source.where, "created_at and expires_at must name their time zone")
    now = now or datetime.now(UTC)
    if now > manifest.expires_at:
        raise BundleError(f"the bundle expired at {manifest.expires_at.isoformat()} (it was "
                          f"made {manifest.created_at.isoformat()}): make a new one")
    return manifest, data, signature, digest


def check_files(source: Source, manifest: Manifest, copy_to: Path | None = None,
                on_file: OnFile | None = None) -> tuple[int, int]:
    """Every file the manifest lists is there with its size and sha256, and nothing else
    is; with ``copy_to``, each is written there as it is hashed. (files, bytes)."""
    present = source.listing()
    listed = {f.path: f for f in manifest.files}
    extra = sorted(set(present) - set(listed))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise _fail(source.where, f"extra file {mf.FILES}/{extra[0]}{more}: the manifest "
                    "does not list it, so the bundle is not as it was signed")
    missing = sorted(set(listed) - set(present))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _fail(source.where, f"{mf.FILES}/{missing[0]}{more} is missing: the bundle "
                    "is incomplete; copy it again")
    for path, entry in sorted(listed.items()):
        if present[path] != entry.size:
            raise _fail(source.where, f"{mf.FILES}/{path} is {present[path]} bytes; the "
                        f"manifest says {entry.size}")
    total = 0
    for path, entry in sorted(listed.items()):
        if on_file:
            on_file(path, entry.size)
        dest = None
        if copy_to is not None:
            dest = copy_to / path
            dest.parent.mkdir(parents=True, exist_ok=True)
        _check_one(source, entry, dest)
        total += entry.size
    return len(listed), total


def _check_one(source: Source, entry: mf.BundleFile, dest: Path | None) -> None:
    hasher = hashlib.sha256()
    done = 0
    out = open(dest, "xb") if dest is not None else None  # noqa: SIM115 — closed below
    try:
        with source.open(entry.path) as f:
            while chunk := f.read(CHUNK):
                done += len(chunk)
                if done > entry.size:
                    break
                hasher.update(chunk)
                if out is not None:
                    out.write(chunk)
    finally:
        if out is not None:
            out.close()
    if done != entry.size:
        raise _fail(source.where, f"{mf.FILES}/{entry.path} changed while it was read "
                    f"({done} bytes, the manifest says {entry.size})")
    got = hasher.hexdigest()
    if got != entry.sha256:
        raise _fail(source.where, f"{mf.FILES}/{entry.path} has sha256 {got}; the "
                    f"manifest says {entry.sha256}: the file was changed or damaged")


def verify_bundle(path: Path, trusted_keys: list[str], sha256: str | None = None,
                  now: datetime | None = None, on_file: OnFile | None = None) -> Checked:
    """Check the bundle at ``path`` in place, nothing written anywhere."""
    with open_bundle(path) as source:
        manifest, _, _, digest = check_manifest(source, trusted_keys, sha256, now)
        files, size = check_files(source, manifest, on_file=on_file)
    return Checked(manifest, digest, files, size)
