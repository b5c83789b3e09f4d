"""Model weights on a node: which complete weights its directories hold, and fetching the
missing ones from a Hugging Face-style hub.

A model's weights are one directory holding the files and ``llmgw-manifest.json``, which
names the key (see core.weights) and every file with its size and checksum. Weights are
*complete* only when every listed file is there with that size and checksum: an empty
directory and a half-finished download look alike, and placement must never be sent to
either. Fetched weights live at ``<weights dir>/<directory_name(key)>``; weights placed by
hand may sit in any direct subdirectory, with a manifest ``llmgw weights manifest`` wrote.

Concurrency: ``scan()`` and ``find()`` are synchronous and may hash gigabytes, so the agent
runs them in a thread; digests are cached by (path, size, mtime_ns, inode), so a scan
repeated every minute reads nothing that did not change. ``ensure()`` runs on the event
loop, one fetch per key at a time; disk writes and hashing go to a thread in chunks of at
most ``CHUNK`` bytes. A fetch writes into ``.partial-<name>-<random>`` beside its final
place and renames it in only when every file checked out, so a failure of any kind leaves
nothing behind and touches nothing that was complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fnmatch
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import aiohttp
import msgspec
from yarl import URL

from llmgw import wire
from llmgw.agent.discovery import host
from llmgw.config import Weights
from llmgw.core.weights import (
    Source,
    SourceError,
    check_patterns,
    directory_name,
    parse_source,
)
from llmgw.engines import llamacpp

log = logging.getLogger(__name__)

MANIFEST = "llmgw-manifest.json"
MANIFEST_VERSION = 1
PARTIAL_PREFIX = ".partial-"
MAX_FILES = 10_000  # entries in a repository's listing
MAX_LISTING_BYTES = 64 * 2**20
MAX_MANIFEST_BYTES = 16 * 2**20
MAX_PAGES = 1_000
MAX_REDIRECTS = 10
CHUNK = 2**20
_MAX_NOTES = 10
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
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


@dataclass(frozen=True, slots=True)
class Directory:
    path: Path
    shared: bool = False


# --- sizes, paths, hashes --------------------------------------------------------------------


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def _of(part: int, total: int) -> str:
    """``3.1 of 15.2 GB``: both in the unit that suits the total."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if total >= scale:
            return f"{part / scale:.1f} of {total / scale:.1f} {unit}"
    return f"{part} of {total} bytes"


def _fraction(done: int, total: int) -> str:
    """Progress: ``3.1/15.2 GB``, or MB for totals under 1 GB."""
    unit, scale = ("GB", 1e9) if total >= 1e9 else ("MB", 1e6)
    return f"{done / scale:.1f}/{total / scale:.1f} {unit}"


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


class _Digests:
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
        raise WeightsError(f"{MANIFEST} is larger than {_size(MAX_MANIFEST_BYTES)}")
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as err:
        raise WeightsError(f"{MANIFEST} is not a valid manifest: {err}") from None
    if manifest.version != MANIFEST_VERSION:
        raise WeightsError(f"{MANIFEST} has version {manifest.version}; this llmgw reads "
                           f"version {MANIFEST_VERSION}")
    return manifest


def _write_manifest_file(directory: Path, manifest: Manifest) -> Path:
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
        return _write_manifest_file(directory, manifest)
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


# --- the store -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Remote:
    path: str
    size: int
    sha256: str | None
    git_oid: str | None


class _Meter:
    """Calls ``progress`` at most every ``interval`` seconds, and once at the end."""

    def __init__(self, label: str, total: int, progress: Callable[[str], None],
                 interval: float) -> None:
        self.label, self.total, self.progress, self.interval = label, total, progress, interval
        self.done = 0
        self._last = float("-inf")

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self.say()

    def say(self) -> None:
        self.progress(f"fetching {self.label}: {_fraction(self.done, self.total)}")


class _Sink:
    """One file being written: hashed as it is written, the bytes counted."""

    def __init__(self, path: Path, size: int, git: bool) -> None:
        self.file = open(path, "xb")  # noqa: SIM115 — closed by close()
        self.written = 0
        self.sha256 = hashlib.sha256()
        self.git = hashlib.sha1(b"blob %d\0" % size) if git else None

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.sha256.update(data)
        if self.git:
            self.git.update(data)
        self.written += len(data)

    def close(self) -> None:
        self.file.close()


def _why(err: BaseException) -> str:
    if isinstance(err, TimeoutError):
        return "timed out"
    if isinstance(err, aiohttp.ClientPayloadError):
        return "the connection closed before the end"
    return str(err) or type(err).__name__


def _show(url: URL) -> str:
    """A URL for messages: without its query, which may carry a signature."""
    return str(url.with_query(None).with_fragment(None))


class WeightsStore:
    """The weights directories of one node."""

    def __init__(self, directories: list[tuple[Path, bool]], hub: str = "https://huggingface.co",
                 token: str | None = None, *, connect_timeout_s: float = 30.0,
                 read_timeout_s: float = 120.0, progress_interval_s: float = 2.0) -> None:
        self.directories = [Directory(Path(p), bool(shared)) for p, shared in directories]
        self.hub = hub.rstrip("/")
        self.token = token or None
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.progress_interval_s = progress_interval_s
        self._digests = _Digests()
        self._unprepared: dict[Path, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._active: set[Path] = set()

    @classmethod
    def from_config(cls, weights: Weights) -> WeightsStore:
        """From agent.yaml's ``weights`` (config.Weights); reads the token file."""
        token = None
        if weights.token_file:
            try:
                token = Path(weights.token_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as err:
                why = getattr(err, "strerror", None) or "not a text file"
                raise WeightsError(f"weights.token_file {weights.token_file}: cannot read: "
                                   f"{why}") from None
            if not token:
                raise WeightsError(f"weights.token_file {weights.token_file} is empty")
        return cls([(Path(d.path), d.shared) for d in weights.directories], weights.hub, token)

    # -- scanning ----------------------------------------------------------------------------

    def prepare(self) -> list[str]:
        """Create missing directories (0755) and remove partial downloads a previous run
        left in local ones. Returns what it did; failures end up in scan's notes."""
        done: list[str] = []
        self._unprepared.clear()
        for d in self.directories:
            try:
                d.path.mkdir(parents=True)
                d.path.chmod(0o755)
                done.append(f"created {d.path}")
            except FileExistsError:
                pass
            except OSError as err:
                self._unprepared[d.path] = f"cannot create {d.path}: {err.strerror}"
                done.append(self._unprepared[d.path])
                continue
            if d.shared:
                continue  # another node may be fetching into it right now
            with contextlib.suppress(OSError), os.scandir(d.path) as entries:
                for entry in entries:
                    partial = Path(entry.path)
                    if entry.name.startswith(PARTIAL_PREFIX) and partial not in self._active:
                        shutil.rmtree(partial, ignore_errors=True)
                        done.append(f"removed the unfinished download {partial}")
        for line in done:
            log.info("weights: %s", line)
        return done

    def _subdirs(self, path: Path) -> list[os.DirEntry]:
        with os.scandir(path) as entries:
            return sorted((e for e in entries if not e.name.startswith(".")
                           and e.name != "lost+found" and e.is_dir()), key=lambda e: e.name)

    def _check(self, directory: Path) -> tuple[str | None, str | None]:
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
                return key, f"{f.path} is {_of(st.st_size, f.size)}"
            want = {k for k in ("sha256", "git_oid") if getattr(f, k)}
            if not want:
                continue
            try:
                got = self._digests.get(real, st, want)
            except OSError as err:
                return key, f"cannot read {f.path}: {err.strerror}"
            for k in sorted(want):
                if got[k] != getattr(f, k):
                    return key, f"{f.path} has {k} {got[k]}, the manifest says {getattr(f, k)}"
        return key, None

    def _scan_one(self, d: Directory) -> wire.WeightsDir:
        total = free = 0
        notes: list[str] = []
        held: set[str] = set()
        try:
            total, free = host.disk_mib(d.path)
            subdirs = self._subdirs(d.path)
        except OSError as err:
            subdirs = []
            notes.append(self._unprepared.get(d.path)
                         or (f"{d.path} does not exist" if isinstance(err, FileNotFoundError)
                             else f"{d.path} is not a directory"
                             if isinstance(err, NotADirectoryError)
                             else f"cannot read {d.path}: {err.strerror}"))
        for entry in subdirs:
            key, why = self._check(Path(entry.path))
            if why is None and key is not None:
                held.add(key)
            else:
                notes.append(f"{entry.name}: {why}")
        if len(notes) > _MAX_NOTES:
            notes[_MAX_NOTES:] = [f"and {len(notes) - _MAX_NOTES} more"]
        return wire.WeightsDir(path=str(d.path), shared=d.shared, total_mib=total,
                               free_mib=free, held=sorted(held), note="; ".join(notes))

    def scan(self) -> list[wire.WeightsDir]:
        """Every configured directory, in order, with the keys of the complete weights in
        it. Synchronous and possibly slow the first time (hashing): run it in a thread."""
        self._digests.begin()
        try:
            return [self._scan_one(d) for d in self.directories]
        finally:
            self._digests.prune()

    def free_mib(self) -> list[int]:
        """Free MiB of each directory, in order (0 where it cannot be read): cheap enough
        for every heartbeat."""
        free = []
        for d in self.directories:
            try:
                free.append(host.disk_mib(d.path)[1])
            except OSError:
                free.append(0)
        return free

    def find(self, key: str) -> Path | None:
        """The directory of complete weights for ``key``; the first configured directory
        that holds them wins."""
        name = directory_name(key)
        for d in self.directories:
            try:
                subdirs = self._subdirs(d.path)
            except OSError:
                continue
            subdirs.sort(key=lambda e: e.name != name)  # where a fetch puts it, first
            for entry in subdirs:
                path = Path(entry.path)
                try:
                    manifest = read_manifest(path)
                except WeightsError:
                    continue
                if manifest is not None and manifest.key == key and self._check(path)[1] is None:
                    return path
        return None

    # -- fetching ----------------------------------------------------------------------------

    async def ensure(self, key: str, source: str, patterns: list[str], label: str,
                     progress: Callable[[str], None]) -> Path:
        """The directory of complete weights for ``key``, fetched from ``source`` first if
        no directory holds them. Concurrent calls for one key make one fetch."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            found = await asyncio.to_thread(self.find, key)
            if found is not None:
                return found
            if not source:
                places = ", ".join(str(d.path) for d in self.directories)
                raise WeightsError(f"{label}: no complete weights for {key} in {places}, and "
                                   "no source to fetch them from: place them in a weights "
                                   "directory and run `llmgw weights manifest DIR --key "
                                   f"'{key}'`")
            try:
                src = parse_source(source)
                patterns = list(check_patterns(patterns))
            except SourceError as err:
                raise WeightsError(f"{label}: {err}") from None
            return await self._fetch(key, source, src, patterns, label, progress)

    def _fetch_root(self) -> Path:
        chosen = next((d for d in self.directories if not d.shared), self.directories[0])
        return chosen.path

    async def _fetch(self, key: str, source: str, src: Source, patterns: list[str], label: str,
                     progress: Callable[[str], None]) -> Path:
        endpoint = URL(src.endpoint or self.hub)
        root = self._fetch_root()
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s,
                                        sock_connect=self.connect_timeout_s,
                                        sock_read=self.read_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            files = await self._list(http, endpoint, src, patterns, label)
            total = sum(f.size for f in files)
            try:
                root.mkdir(parents=True, exist_ok=True)
                st = os.statvfs(root)
            except OSError as err:
                raise WeightsError(f"fetching {label}: cannot use {root}: {err.strerror}") from None
            free = st.f_bavail * st.f_frsize
            if total > free:
                raise WeightsError(f"fetching {label} needs {_size(total)}; {root} has "
                                   f"{_size(free)} free: free space or add a weights directory")
            name = directory_name(key)
            partial = root / f"{PARTIAL_PREFIX}{name}-{secrets.token_hex(4)}"
            self._active.add(partial)
            log.info("weights: fetching %s (%s, %d files) from %s into %s", label, _size(total),
                     len(files), endpoint, root)
            try:
                partial.mkdir(mode=0o755)
                meter = _Meter(label, total, progress, self.progress_interval_s)
                entries = [await self._download(http, endpoint, src, f, partial, meter, label)
                           for f in files]
                manifest = Manifest(version=MANIFEST_VERSION, key=key, source=source,
                                    revision=src.revision, files=entries)
                await asyncio.to_thread(_write_manifest_file, partial, manifest)
                final = await asyncio.to_thread(self._place, partial, root / name, key)
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    raise WeightsError(
                        f"fetching {label}: the disk holding {root} is full: the weights need "
                        f"{_size(total)} and {_size(free)} was free when the fetch began; "
                        "free space or add a weights directory") from None
                raise WeightsError(f"fetching {label}: writing into {root}: {err}") from None
            finally:
                self._active.discard(partial)
                if os.path.lexists(partial):
                    await asyncio.to_thread(shutil.rmtree, partial, True)
        meter.say()
        log.info("weights: fetched %s into %s", label, final)
        return final

    def _place(self, partial: Path, final: Path, key: str) -> Path:
        """Rename the checked download into place; keep complete weights already there."""
        if os.path.lexists(final):
            held, why = self._check(final)
            if why is None:
                if held != key:
                    raise WeightsError(f"{final} already holds complete weights for {held}")
                return final  # another fetch (another node, on a filer) got there first
            aside = final.with_name(f"{PARTIAL_PREFIX}{final.name}-old-{secrets.token_hex(4)}")
            os.rename(final, aside)
            os.rename(partial, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(partial, final)
        root = os.path.realpath(final)
        for f in read_manifest(final).files:  # what was just checked needs no second read
            real = os.path.join(root, f.path)
            self._digests.put(real, os.stat(real), {"sha256": f.sha256} | (
                {"git_oid": f.git_oid} if f.git_oid else {}))
        return final

    @contextlib.asynccontextmanager
    async def _get(self, http: aiohttp.ClientSession, url: URL,
                   label: str) -> AsyncIterator[aiohttp.ClientResponse]:
        """GET following redirects. The token goes to the configured hub's origin only:
        never to its CDN, nor to another host a profile's source names."""
        for _ in range(MAX_REDIRECTS + 1):
            headers = {}
            if self.token and url.origin() == URL(self.hub).origin():
                headers["Authorization"] = f"Bearer {self.token}"
            try:
                resp = await http.get(url, headers=headers, allow_redirects=False)
            except (aiohttp.ClientError, TimeoutError) as err:
                raise WeightsError(f"fetching {label}: GET {_show(url)}: {_why(err)}") from None
            if resp.status in _REDIRECTS and "Location" in resp.headers:
                location = resp.headers["Location"]
                resp.release()
                url = url.join(URL(location))
                if url.scheme not in ("http", "https"):
                    raise WeightsError(f"fetching {label}: redirected to {_show(url)}")
                continue
            try:
                if resp.status != 200:
                    raise WeightsError(self._http_error(label, url, resp.status))
                yield resp
            finally:
                resp.release()
            return
        raise WeightsError(f"fetching {label}: more than {MAX_REDIRECTS} redirects from "
                           f"{_show(url)}")

    def _http_error(self, label: str, url: URL, status: int) -> str:
        hint = ""
        if status in (401, 403):
            if url.origin() != URL(self.hub).origin():
                hint = (f"gated or private: the token in weights.token_file goes only to "
                        f"weights.hub ({self.hub})")
            elif self.token:
                hint = "gated or private, and the token in weights.token_file was refused"
            else:
                hint = "gated or private: set weights.token_file to a token that may read it"
        elif status == 404:
            hint = "no such repository or revision"
        elif status == 429 or status >= 500:
            hint = "the hub is unavailable; the fetch is tried again later"
        return f"fetching {label}: GET {_show(url)} answered {status}" + (
            f": {hint}" if hint else "")

    async def _list(self, http: aiohttp.ClientSession, endpoint: URL, src: Source,
                    patterns: list[str], label: str) -> list[_Remote]:
        url: URL | None = URL(f"{str(endpoint).rstrip('/')}/api/models/{src.repo}/tree/"
                              f"{quote(src.revision, safe='')}?recursive=true", encoded=True)
        entries: list = []
        pages = 0
        while url is not None:
            pages += 1
            if pages > MAX_PAGES:
                raise WeightsError(f"fetching {label}: the listing of {src.repo} runs past "
                                   f"{MAX_PAGES} pages")
            async with self._get(http, url, label) as resp:
                body = bytearray()
                try:
                    async for chunk in resp.content.iter_chunked(CHUNK):
                        body += chunk
                        if len(body) > MAX_LISTING_BYTES:
                            raise WeightsError(f"fetching {label}: the listing of {src.repo} "
                                               f"is larger than {_size(MAX_LISTING_BYTES)}")
                except (aiohttp.ClientError, TimeoutError) as err:
                    raise WeightsError(f"fetching {label}: GET {_show(url)}: {_why(err)}") \
                        from None
                following = resp.links.get("next")
            try:
                page = json.loads(body)
            except ValueError:
                page = None
            if not isinstance(page, list):
                raise WeightsError(f"fetching {label}: GET {_show(url)} did not answer a file "
                                   "listing (a JSON list); is the hub a Hugging Face-style hub?")
            entries.extend(page)
            if len(entries) > MAX_FILES:
                raise WeightsError(f"fetching {label}: {src.repo} lists more than {MAX_FILES} "
                                   "files and folders; llmgw refuses a repository that large")
            url = URL(following["url"]) if following else None
        files = _parse_listing(entries, f"fetching {label}: the listing of {src.repo}")
        chosen = [f for f in files if not patterns or any(
            fnmatch.fnmatchcase(f.path, p + "*" if p.endswith("/") else p) for p in patterns)]
        if not chosen:
            have = ", ".join(f.path for f in files[:8]) + (", …" if len(files) > 8 else "")
            raise WeightsError(f"fetching {label}: no file of {src.repo}@{src.revision} matches "
                               f"{', '.join(patterns) or 'anything'}; it has: {have or 'nothing'}")
        return chosen

    async def _download(self, http: aiohttp.ClientSession, endpoint: URL, src: Source,
                        f: _Remote, partial: Path, meter: _Meter, label: str) -> ManifestFile:
        url = URL(f"{str(endpoint).rstrip('/')}/{src.repo}/resolve/"
                  f"{quote(src.revision, safe='')}/{quote(f.path)}", encoded=True)
        dest = partial / f.path
        await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
        sink = await asyncio.to_thread(_Sink, dest, f.size, f.git_oid is not None)
        try:
            async with self._get(http, url, label) as resp:
                buffer = bytearray()
                try:
                    async for chunk in resp.content.iter_chunked(CHUNK):
                        if sink.written + len(buffer) + len(chunk) > f.size:
                            raise WeightsError(f"fetching {label}: {f.path} is larger than the "
                                               f"{f.size} bytes the listing says")
                        buffer += chunk
                        meter.add(len(chunk))
                        if len(buffer) >= CHUNK:
                            await asyncio.to_thread(sink.write, bytes(buffer))
                            buffer.clear()
                except (aiohttp.ClientError, TimeoutError) as err:
                    raise WeightsError(
                        f"fetching {label}: GET {_show(resp.url)} broke off after "
                        f"{_of(sink.written + len(buffer), f.size)}: {_why(err)}") from None
                if buffer:
                    await asyncio.to_thread(sink.write, bytes(buffer))
        finally:
            sink.close()
        if sink.written != f.size:
            raise WeightsError(f"fetching {label}: {f.path} is {sink.written} bytes, the listing "
                               f"says {f.size}")
        sha256 = sink.sha256.hexdigest()
        checks = [("sha256", f.sha256, sha256)]
        if sink.git:
            checks.append(("git oid", f.git_oid, sink.git.hexdigest()))
        for what, expected, got in checks:
            if expected and got != expected:
                raise WeightsError(f"fetching {label}: {f.path}: {what} mismatch: expected "
                                   f"{expected}, got {got}")
        return ManifestFile(path=f.path, size=f.size, sha256=sha256, git_oid=f.git_oid)


def _parse_listing(entries: list, where: str) -> list[_Remote]:
    """The files of a Hugging Face tree listing, every path checked. For an LFS file the
    entry's ``oid`` names the pointer, so its content is checked by ``lfs.oid`` (sha256)."""
    files: dict[str, _Remote] = {}
    for e in entries:
        if not isinstance(e, dict) or e.get("type") not in ("file", "directory"):
            raise WeightsError(f"{where} has an entry that is neither file nor directory: "
                               f"{str(e)[:200]}")
        path = e.get("path")
        try:
            check_path(path)
        except WeightsError:
            raise WeightsError(f"{where} names {path!r}, which is not a safe relative path; "
                               "nothing was fetched") from None
        if e["type"] != "file":
            continue
        if path == MANIFEST:
            raise WeightsError(f"{where} holds a file named {MANIFEST}, which is llmgw's own")
        lfs = e.get("lfs") if isinstance(e.get("lfs"), dict) else None
        size = lfs.get("size", e.get("size")) if lfs else e.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise WeightsError(f"{where} gives {path} no valid size")
        sha256 = lfs.get("oid") if lfs else None
        git_oid = None if lfs else e.get("oid")
        if sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", str(sha256)):
            raise WeightsError(f"{where} gives {path} the sha256 {sha256!r}")
        if git_oid is not None and not re.fullmatch(r"[0-9a-f]{40}", str(git_oid)):
            git_oid = None  # not a git blob id: rely on size (and sha256 where there is one)
        if path in files:
            raise WeightsError(f"{where} names {path} twice")
        files[path] = _Remote(path, size, sha256, git_oid)
    for path in files:
        parent = path.rpartition("/")[0]
        while parent:
            if parent in files:
                raise WeightsError(f"{where} names {parent} as a file and as a folder")
            parent = parent.rpartition("/")[0]
    return sorted(files.values(), key=lambda f: f.path)
