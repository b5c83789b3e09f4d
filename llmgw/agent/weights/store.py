"""WeightsStore: a node's weights directories, tying the manifest checks and the hub
together: what the directories hold (scan, find), clearing what an earlier run left
(prepare), and fetching what is missing (ensure), one fetch per key at a time."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace
from yarl import URL

from llmgw import wire
from llmgw.agent.control_plane import ControlPlane, TlsFilesUnusable
from llmgw.agent.discovery import host
from llmgw.agent.weights.fetch import Hub, Meter, check_space
from llmgw.agent.weights.manifest import (
    MANIFEST_VERSION,
    Digests,
    Manifest,
    WeightsError,
    check_complete,
    read_manifest,
    size_text,
    write_manifest_file,
)
from llmgw.config import AgentConfig
from llmgw.core.weights import Source, SourceError, check_patterns, directory_name, parse_source
from llmgw.tracing import OFF, Tracing, end

log = logging.getLogger(__package__)  # "llmgw.agent.weights", as before the split

PARTIAL_PREFIX = ".partial-"
PUBLIC_HUB = "https://huggingface.co"
_MAX_NOTES = 10


@dataclass(frozen=True, slots=True)
class Directory:
    """A configured weights directory; ``shared`` when other nodes use it too (a filer)."""

    path: Path
    shared: bool = False


class WeightsStore:
    """The weights directories of one node."""

    def __init__(self, directories: list[tuple[Path, bool]], hub: str | None = None,
                 token: str | None = None, *, connect_timeout_s: float = 30.0,
                 read_timeout_s: float = 120.0, progress_interval_s: float = 2.0) -> None:
        """``hub``: agent.yaml's weights.hub; None is the control plane's mirror when it
        serves one, else PUBLIC_HUB (see hub_for)."""
        self.directories = [Directory(Path(p), bool(shared)) for p, shared in directories]
        self.hub = hub.rstrip("/") if hub else None
        self.token = token or None
        # The server of the agent's stream (set by the agent at each connection).
        self.control_plane: ControlPlane | None = None
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.progress_interval_s = progress_interval_s
        self._digests = Digests()
        self._unprepared: dict[Path, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._active: set[Path] = set()
        # A fetch is a trace of its own (a model job), linked to the start that asked.
        self.tracing: Tracing = OFF

    @classmethod
    def from_config(cls, config: AgentConfig) -> WeightsStore:
        """From agent.yaml's ``weights`` (directories resolved against state_dir); reads
        the token file."""
        weights = config.weights
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
        return cls([(Path(d.path), d.shared) for d in config.weights_directories()],
                   weights.hub, token)

    # -- scanning ----------------------------------------------------------------------------

    def prepare(self) -> list[str]:
        """Create missing local directories (0755) and remove partial downloads a previous
        run left in them. A missing shared directory is not created: it is a filer that is
        not mounted, and a local directory in its place would be mistaken for the filer.
        Returns what it did; failures end up in scan's notes."""
        done: list[str] = []
        self._unprepared.clear()
        for d in self.directories:
            if d.shared and not d.path.is_dir():
                self._unprepared[d.path] = (f"shared directory {d.path} is missing: is the "
                                            "filer mounted?")
                done.append(self._unprepared[d.path])
                continue
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
            key, why = check_complete(Path(entry.path), self._digests)
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
                if (manifest is not None and manifest.key == key
                        and check_complete(path, self._digests)[1] is None):
                    return path
        return None

    # -- fetching ----------------------------------------------------------------------------

    async def ensure(self, key: str, source: str, patterns: list[str], label: str,
                     progress: Callable[[str], None],
                     caused_by: trace.Span | None = None) -> Path:
        """The directory of complete weights for ``key``, fetched from ``source`` first if
        no directory holds them. Concurrent calls for one key make one fetch. The fetch's
        trace links to ``caused_by`` (the shard start that asked first)."""
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
            if not self.tracing.enabled:
                return await self._fetch(key, source, src, patterns, label, progress,
                                         trace.INVALID_SPAN)
            job = self.tracing.start(f"weights {key}", links=self.tracing.link_to(caused_by),
                                     attributes={"llmgw.weights_key": key,
                                                 "llmgw.source": source})
            try:
                found = await self._fetch(key, source, src, patterns, label, progress, job)
            except BaseException as err:
                end(job, error=str(err) or type(err).__name__)
                raise
            end(job, **{"llmgw.path": str(found)})
            return found

    def _fetch_root(self) -> Path:
        chosen = next((d for d in self.directories if not d.shared), self.directories[0])
        return chosen.path

    def hub_for(self) -> tuple[str, bool]:
        """The hub hf:// sources come from, and whether it is the control plane's mirror:
        agent.yaml's weights.hub when set, else the mirror of the server the agent is
        connected to when it serves one, else the public hub."""
        if self.hub:
            return self.hub, False
        plane = self.control_plane
        if plane is not None and plane.hub:
            return plane.hub, True
        return PUBLIC_HUB, False

    async def _fetch(self, key: str, source: str, src: Source, patterns: list[str], label: str,
                     progress: Callable[[str], None], job: trace.Span) -> Path:
        hub_url, mirror = self.hub_for()
        endpoint = URL(src.endpoint or hub_url)
        root = self._fetch_root()
        step = self.tracing.step
        try:
            # The node's TLS, for the mirror on an https control plane.
            ssl = self.control_plane.ssl_context() if mirror and self.control_plane else True
        except TlsFilesUnusable as err:
            raise WeightsError(f"fetching {label}: {err}") from None
        # The token is agent.yaml's, for its hub (or the public one): never the mirror's.
        async with Hub.connect(hub_url, None if mirror else self.token,
                               self.connect_timeout_s, self.read_timeout_s,
                               mirror=mirror, ssl=ssl) as hub:
            with step("list files", job, **{"llmgw.hub": str(endpoint)}) as listing:
                files = await hub.listing(endpoint, src, patterns, label)
                listing.set_attribute("llmgw.files", len(files))
            total = sum(f.size for f in files)
            free = check_space(root, total, label)
            name = directory_name(key)
            partial = root / f"{PARTIAL_PREFIX}{name}-{secrets.token_hex(4)}"
            self._active.add(partial)
            log.info("weights: fetching %s (%s, %d files) from %s into %s", label,
                     size_text(total), len(files), endpoint, root)
            try:
                partial.mkdir(mode=0o755)
                meter = Meter(label, total, progress, self.progress_interval_s)
                entries = []
                for f in files:
                    with step(f"download {f.path}", job, **{"llmgw.bytes": f.size}):
                        entries.append(await hub.download(endpoint, src, f, partial, meter,
                                                          label))
                manifest = Manifest(version=MANIFEST_VERSION, key=key, source=source,
                                    revision=src.revision, files=entries)
                with step("place", job, **{"llmgw.directory": str(root / name)}):
                    await asyncio.to_thread(write_manifest_file, partial, manifest)
                    final = await asyncio.to_thread(self._place, partial, root / name, key)
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    raise WeightsError(
                        f"fetching {label}: the disk holding {root} is full: the weights need "
                        f"{size_text(total)} and {size_text(free)} was free when the fetch "
                        "began; free space or add a weights directory") from None
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
            held, why = check_complete(final, self._digests)
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
