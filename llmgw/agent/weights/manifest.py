"""The manifest of a weights directory: its format, the checks on the paths it names,
hashing (with a cache, so a repeated scan reads only what changed), whether a directory
holds complete weights, writing a manifest for weights placed by hand, and what an engine
is given."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec

from llmgw.core.weights import SourceError, parse_source
from llmgw.engines import llamacpp

MANIFEST = "llmgw-manifest.json"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 16 * 2**20
CHUNK = 2**20
_SPLIT_GGUF = re.compile(r"(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf")

Hex40 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{40}$")]
Hex64 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class WeightsError(Exception):
    """Weights that cannot be read, found or fetched; the message says what to do."""


class ManifestFile(msgspec.Struct, kw_only=True, omit_defaults=True):
    path: str
    size: Annotated[int, msgspec.Meta(ge=0)]
    sha256: Hex64 | None = None
    git_oid: Hex40 | None = None  # sha1 of b"blob SIZE\0" + content, as git names a blob


class Manifest(msgspec.Struct, kw_only=True):
    version: int
    key: Annotated[str, msgspec.Meta(min_length=1, max_length=400)]
    source: str = ""
    revision: str = ""
    files: list[ManifestFile]


# --- sizes, paths, hashes --------------------------------------------------------------------


def size_text(n: float) -> str:
    """``15.2 GB``, ``3.0 MB``, ``812 bytes``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def part_of(part: int, total: int) -> str:
    """``3.1 of 15.2 GB``: both in the unit that suits the total."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if total >= scale:
            return f"{part / scale:.1f} of {total / scale:.1f} {unit}"
    return f"{part} of {total} bytes"


def check_path(path: str) -> str:
    """A path inside a weights directory: relative, ``/``-separated, no empty, ``.`` or
    ``..`` element, no backslash. Anything else is refused before it touches the disk."""
    if (not isinstance(path, str) or not path or path.startswith("/") or "\\" in path
            or "\0" in path or any(p in ("", ".", "..") for p in path.split("/"))):
        raise WeightsError(f"{path!r} is not a safe relative path")
    return path


def _inside(root_real: str, path: str | Path) -> str | None:
    """The real path of ``path`` if it resolves inside ``root_real``, else None."""
    real = os.path.realpath(path)
    return real if real.startswith(root_real.rstrip(os.sep) + os.sep) else None


def _hash_file(path: str, size: int, want: set[str]) -> dict[str, str]:
    sha256 = hashlib.sha256() if "sha256" in want else None
    git = hashlib.sha1(b"blob %d\0" % size) if "git_oid" in want else None
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            if sha256:
                sha256.update(chunk)
            if git:
                git.update(chunk)
    out = {}
    if sha256:
        out["sha256"] = sha256.hexdigest()
    if git:
        out["git_oid"] = git.hexdigest()
    return out


class Digests:
    """Digests by (path, size, mtime_ns, inode, device). A scan marks what it used; what it
    did not use (files gone or changed) is dropped at its end, so the cache stays as large
    as the weights on disk."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple, dict[str, str]] = {}
        self._used: set[tuple] | None = None

    @staticmethod
    def _ident(path: str, st: os.stat_result) -> tuple:
        return path, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev

    def get(self, path: str, st: os.stat_result, want: set[str]) -> dict[str, str]:
        ident = self._ident(path, st)
        with self._lock:
            have = dict(self._cache.get(ident, {}))
        if missing := want - have.keys():
            have.update(_hash_file(path, st.st_size, missing))
        self.put(path, st, have)
        return have

    def put(self, path: str, st: os.stat_result, digests: dict[str, str]) -> None:
        ident = self._ident(path, st)
        with self._lock:
            self._cache.setdefault(ident, {}).update(digests)
            if self._used is not None:
                self._used.add(ident)

    def begin(self) -> None:
        with self._lock:
            self._used = set()

    def prune(self) -> None:
        with self._lock:
            if self._used is not None:
                self._cache = {k: v for k, v in self._cache.items() if k in self._used}
            self._used = None


# --- manifests -----------------------------------------------------------------------------


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest of a weights directory; None when it has none, WeightsError when it
    cannot be read or is not a valid manifest."""
    path = Path(directory) / MANIFEST
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise WeightsError(f"cannot read {MANIFEST}: {err.strerror}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise WeightsError(f"{MANIFEST} is larger than {size_text(MAX_MANIFEST_BYTES)}")
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as err:
        raise WeightsError(f"{MANIFEST} is not a valid manifest: {err}") from None
    if manifest.version != MANIFEST_VERSION:
        raise WeightsError(f"{MANIFEST} has version {manifest.version}; this llmgw reads "
                           f"version {MANIFEST_VERSION}")
    return manifest


def write_manifest_file(directory: Path, manifest: Manifest) -> Path:
    """Write ``manifest`` into ``directory`` atomically (a temporary file renamed in)."""
    final = directory / MANIFEST
    tmp = directory / f".{MANIFEST}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(manifest), indent=1) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def write_manifest(directory: Path, key: str, source: str = "",
                   on_file: Callable[[str, int], None] | None = None) -> Path:
    """Hash every regular file under ``directory`` (sha256) and write its manifest
    atomically, for weights placed by hand. Hidden directories (.git, .cache) are left
    out; a symlink that leaves the directory is refused. ``on_file(path, size)`` is called
    before each file is hashed."""
    directory = Path(directory)
    if not directory.is_dir():
        raise WeightsError(f"{directory} is not a directory")
    if not key or len(key) > 400 or any(c in key for c in "\n\r\0"):
        raise WeightsError(f"key {key!r}: give the model's name, or ORG/NAME@REVISION for "
                           "weights that came from a hub")
    revision = ""
    if source:
        try:
            revision = parse_source(source).revision
        except SourceError as err:
            raise WeightsError(str(err)) from None
    root = os.path.realpath(directory)
    files: list[ManifestFile] = []

    def fail(err: OSError) -> None:
        raise WeightsError(f"cannot read {err.filename}: {err.strerror}")

    for dirpath, dirnames, filenames in os.walk(directory, onerror=fail):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames + [d for d in dirnames
                                        if os.path.islink(os.path.join(dirpath, d))]):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, directory).replace(os.sep, "/")
            if rel == MANIFEST or (rel.startswith(f".{MANIFEST}.") and rel.endswith(".tmp")):
                continue
            real = _inside(root, full)
            if real is None:
                raise WeightsError(f"{rel} links to {os.path.realpath(full)}, outside "
                                   f"{directory}: copy the file in instead")
            try:
                st = os.stat(real)
            except OSError as err:
                raise WeightsError(f"{rel}: {err.strerror}") from None
            if stat.S_ISDIR(st.st_mode):
                continue  # a link to a directory inside: its files are listed where they are
            if not stat.S_ISREG(st.st_mode):
                raise WeightsError(f"{rel} is not a regular file")
            check_path(rel)
            if on_file:
                on_file(rel, st.st_size)
            try:
                digest = _hash_file(real, st.st_size, {"sha256"})["sha256"]
            except OSError as err:
                raise WeightsError(f"cannot read {rel}: {err.strerror}") from None
            files.append(ManifestFile(path=rel, size=st.st_size, sha256=digest))
    if not files:
        raise WeightsError(f"{directory} holds no files")
    manifest = Manifest(version=MANIFEST_VERSION, key=key, source=source, revision=revision,
                        files=files)
    try:
        return write_manifest_file(directory, manifest)
    except OSError as err:
        raise WeightsError(f"cannot write {directory / MANIFEST}: {err.strerror}") from None


def model_path(directory: Path, engine: str) -> Path:
    """What an engine is given: llama.cpp the GGUF file (the first part of a split one),
    other engines the directory."""
    directory = Path(directory)
    if engine != llamacpp.NAME:
        return directory
    manifest = read_manifest(directory)
    names = ([f.path for f in manifest.files] if manifest else
             [p.relative_to(directory).as_posix() for p in directory.rglob("*.gguf")])
    ggufs = sorted(p for p in names if p.lower().endswith(".gguf")
                   and not p.rsplit("/", 1)[-1].startswith("mmproj"))
    if len(ggufs) == 1:
        return directory / ggufs[0]
    if not ggufs:
        raise WeightsError(f"{directory} holds no .gguf file, which llama.cpp loads: give the "
                           "profile a GGUF repository and a files pattern such as "
                           "'*Q4_K_M.gguf'")
    parts = [m for p in ggufs if (m := _SPLIT_GGUF.fullmatch(p))]
    if len(parts) == len(ggufs) and len({(m["stem"], m["count"]) for m in parts}) == 1:
        first = [m.string for m in parts if int(m["part"]) == 1]
        if first:
            return directory / first[0]
        raise WeightsError(f"{directory} holds a split GGUF without its first part "
                           f"(-00001-of-{parts[0]['count']}.gguf)")
    shown = ", ".join(ggufs[:6]) + (", …" if len(ggufs) > 6 else "")
    raise WeightsError(f"{directory} holds several GGUF files ({shown}): give the profile a "
                       "files pattern that selects one, such as '*Q4_K_M.gguf'")


# --- completeness ---------------------------------------------------------------------------


def check_complete(directory: Path, digests: Digests) -> tuple[str | None, str | None]:
    """(key, None) for complete weights, else (key or None, why not)."""
    try:
        manifest = read_manifest(directory)
    except WeightsError as err:
        return None, str(err)
    if manifest is None:
        return None, "no manifest"
    key = manifest.key
    if not manifest.files:
        return key, "the manifest lists no files"
    root = os.path.realpath(directory)
    for f in manifest.files:
        try:
            check_path(f.path)
        except WeightsError as err:
            return key, f"the manifest names {err}"
        real = _inside(root, directory / f.path)
        if real is None:
            return key, f"{f.path} leads outside the directory"
        try:
            st = os.stat(real)
        except FileNotFoundError:
            return key, f"{f.path} is missing"
        except OSError as err:
            return key, f"{f.path}: {err.strerror}"
        if not stat.S_ISREG(st.st_mode):
            return key, f"{f.path} is not a regular file"
        if st.st_size != f.size:
            return key, f"{f.path} is {part_of(st.st_size, f.size)}"
        want = {k for k in ("sha256", "git_oid") if getattr(f, k)}
        if not want:
            continue
        try:
            got = digests.get(real, st, want)
        except OSError as err:
            return key, f"cannot read {f.path}: {err.strerror}"
        for k in sorted(want):
            if got[k] != getattr(f, k):
                return key, f"{f.path} has {k} {got[k]}, the manifest says {getattr(f, k)}"
    return key, None
