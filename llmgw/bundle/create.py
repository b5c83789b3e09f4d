"""Making a bundle on a connected machine: download what a cluster would, check each
file against what its publisher says, write files/<path>, then the manifest and its
signature. The bundle is built in a dotted folder beside the output and takes the
output's name only when it is complete.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp

from llmgw.bundle import comfyui, signing, wheelsets
from llmgw.bundle import manifest as mf
from llmgw.bundle import nix as nixcache
from llmgw.bundle.manifest import BundleError, BundleFile, Manifest
from llmgw.bundle.remote import Fetcher, git_oid, shown
from llmgw.core.builds import NodeFacts, Refusal, candidate_builds, comfyui_archive
from llmgw.core.desired_engines import DEFAULT_VERSIONS, PUBLISHERS
from llmgw.core.digests import parse_digests
from llmgw.core.names import NameRuleError, check_model_name
from llmgw.core.weights import SourceError, check_patterns, parse_source
from llmgw.core.wheels import MAX_WHEEL_BYTES

DEFAULT_EXPIRY = timedelta(days=90)
DEFAULT_ARCHES = ("x86_64",)
MAX_ARCHIVE_BYTES = 4 * 2**30  # as the agent bounds an engine archive
_DURATION = re.compile(r"(\d+)([dhm])")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_UNITS = {"d": "days", "h": "hours", "m": "minutes"}

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class EngineWant:
    """One engine version to bundle: llama.cpp's archives for some processors and builds
    (none: every build it publishes for them), a Python engine's wheel set (vLLM,
    SGLang: wheelsets.py), or ComfyUI's source archive and the wheel set of its
    requirements.txt (comfyui.py); wheel sets are resolved for the request's
    ``python_target``."""

    name: str
    version: str
    arches: tuple[str, ...] = DEFAULT_ARCHES
    builds: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelWant:
    name: str
    repo: str
    revision: str
    patterns: tuple[str, ...] = ()


@dataclass
class Request:
    out: Path
    key_file: Path
    tar: bool = False
    engines: list[EngineWant] = field(default_factory=list)
    models: list[ModelWant] = field(default_factory=list)
    wheels: Path | None = None
    # llmgw's wheels from its source checkout instead: uv.lock's pins, resolved for each
    # of llmgw_targets from the index, and llmgw's own wheel (built there when not given).
    llmgw_lock: Path | None = None
    llmgw_wheel: Path | None = None
    llmgw_targets: list[wheelsets.Target] = field(default_factory=list)
    # llmgw's Nix closure instead of wheels: these store paths (or links to them, such as
    # `nix build`'s result) and everything they reference, copied with this nix command.
    nix_closure: list[str] = field(default_factory=list)
    nix: list[str] = field(default_factory=lambda: ["nix"])
    llmgw_version: str = ""
    expires_in: timedelta = DEFAULT_EXPIRY
    # "" is the engine's publisher (GitHub's releases and digests); otherwise
    # <release_url>/<version>/<file> with SHA256SUMS beside, as engines.*.release_url
    # (ComfyUI's archive: <release_url>/<file>, as engines.comfyui.release_url).
    release_url: str = ""
    # Engine files whose publisher gives no digest, pinned by the operator (file ->
    # sha256): ComfyUI's tag archives, as engines.comfyui.sha256 in server.yaml.
    engine_sha256: dict[str, str] = field(default_factory=dict)
    hub: str = "https://huggingface.co"
    hub_token: str | None = None
    # What Python engines' wheels are resolved for, and from which indexes.
    python_target: wheelsets.Target = field(default_factory=wheelsets.Target)
    now: datetime | None = None


@dataclass(frozen=True, slots=True)
class Created:
    path: Path
    manifest: Manifest
    sha256: str
    key_id: str
    size: int


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h`` or ``90m``."""
    match = _DURATION.fullmatch(text.strip())
    if not match or int(match[1]) == 0:
        raise BundleError(f"--expires-in {text!r}: write a number and d, h or m, e.g. 30d")
    return timedelta(**{_UNITS[match[2]]: int(match[1])})


def parse_engine(text: str, arches: tuple[str, ...], builds: tuple[str, ...]) -> EngineWant:
    """``NAME`` or ``NAME@VERSION`` (the version llmgw was checked against by default)."""
    name, _, version = text.partition("@")
    version = version or DEFAULT_VERSIONS.get(name, "")
    if name not in PUBLISHERS:
        raise BundleError(f"--engine {text!r}: no engine {name!r}; name one of "
                          + ", ".join(sorted(PUBLISHERS)))
    if not version:
        raise BundleError(f"--engine {text!r}: {name} has no default version; write "
                          f"{name}@VERSION")
    mf.check_element(version, f"--engine {text!r}: the version")
    return EngineWant(name, version, arches, builds)


def parse_engine_sha256(text: str) -> tuple[str, str]:
    """``FILE=SHA256``: the sha256 of an engine file its publisher gives none for."""
    file, eq, digest = text.partition("=")
    digest = digest.strip().lower()
    if not eq or not _SHA256.fullmatch(digest):
        raise BundleError(f"--engine-sha256 {text!r}: write FILE=SHA256, e.g. "
                          f"{comfyui_archive('0.3.60')}=<64 hex digits>")
    return mf.check_element(file, f"--engine-sha256 {text!r}: the file"), digest


def check_engine_sha256(engines: list[EngineWant], pins: dict[str, str]) -> None:
    """Every ComfyUI archive asked for is pinned, and every pin is of one asked for;
    BundleError before anything is downloaded."""
    archives = {comfyui_archive(e.version): e.version for e in engines
                if e.name == comfyui.NAME}
    for asset, version in archives.items():
        if asset not in pins:
            raise BundleError(
                f"--engine comfyui@{version}: GitHub publishes no digest for ComfyUI's tag "
                f"archive {asset}, so it cannot be checked without one: give "
                f"--engine-sha256 {asset}=SHA256, the sha256 server.yaml pins under "
                "engines.comfyui.sha256")
    for file in pins:
        if file not in archives:
            raise BundleError(f"--engine-sha256 {file}: no --engine asks for that file "
                              "(ComfyUI VERSION's archive is vVERSION.tar.gz)")


def parse_model(text: str) -> ModelWant:
    """``NAME=hf://ORG/REPO[@REVISION][:GLOB,...]``."""
    name, eq, source = text.partition("=")
    if not eq or not source.startswith("hf://"):
        raise BundleError(f"--model {text!r}: write NAME=hf://ORG/REPO[@REVISION][:GLOB,...]")
    where, _, globs = source[len("hf://"):].partition(":")
    try:
        check_model_name(name)
        src = parse_source("hf://" + where)
        patterns = check_patterns([g for g in globs.split(",") if g]) if globs else ()
    except (NameRuleError, SourceError) as err:
        raise BundleError(f"--model {text!r}: {err}") from None
    return ModelWant(name, src.repo, src.revision, patterns)


def llama_cpp_assets(want: EngineWant) -> list[str]:
    """The archive names core.builds installs from, for each processor and build."""
    assets: list[str] = []
    for arch in want.arches:
        # A CPU node, and a GPU node whose driver runs every CUDA line.
        nodes = (NodeFacts(arch=arch), NodeFacts(arch=arch, gpus=1, gpu_driver="9999"))
        found = [candidate_builds("llama.cpp", want.version, n) for n in nodes]
        refusals = [f for f in found if isinstance(f, Refusal)]
        if len(refusals) == len(found):
            raise BundleError(f"llama.cpp for {arch}: {refusals[0].reason}")
        for builds in found:
            for build in [] if isinstance(builds, Refusal) else builds:
                if (not want.builds or build.name in want.builds) and \
                        build.asset not in assets:
                    assets.append(build.asset)
    if not assets:
        raise BundleError(f"llama.cpp {want.version} has no build {', '.join(want.builds)} "
                          f"for {', '.join(want.arches)}")
    return assets


class _Builder:
    def __init__(self, root: Path, fetcher: Fetcher, say: Say) -> None:
        self.root, self.fetcher, self.say = root, fetcher, say
        self.files: dict[str, BundleFile] = {}
        self.python_engines: dict[tuple[str, str], mf.EngineBuild] = {}

    def dest(self, path: str) -> Path:
        return self.root / mf.FILES / mf.check_path(path)

    def add(self, path: str, size: int, sha256: str) -> None:
        self.files[path] = BundleFile(path=path, size=size, sha256=sha256)

    async def engine(self, want: EngineWant, release_url: str) -> mf.EngineBuild:
        publisher, digests_url = PUBLISHERS[want.name]
        if release_url:
            base = release_url.rstrip("/")
            digests_url = f"{base}/{want.version}/SHA256SUMS"
        else:
            base, digests_url = publisher, digests_url.format(version=want.version)
        digests, _ = await self.fetcher.text(digests_url)
        paths = []
        for asset in llama_cpp_assets(want):
            expected = parse_digests(digests, asset)
            if expected is None:
                raise BundleError(f"{shown(digests_url)} gives no sha256 for {asset}: it is "
                                  "not published for this version; narrow --build or --arch")
            path = mf.engine_path(want.name, want.version, asset)
            paths.append(path)
            if path in self.files:
                continue  # the same engine version asked for twice
            url = f"{base}/{want.version}/{asset}"
            self.say(f"downloading {url}")
            size, got = await self.fetcher.download(url, self.dest(path), MAX_ARCHIVE_BYTES)
            if got != expected:
                raise BundleError(f"{shown(url)} has sha256 {got}, but its publisher says "
                                  f"{expected}: the file is corrupt, or not the one published")
            self.add(path, size, got)
        return mf.EngineBuild(name=want.name, version=want.version, files=paths)

    async def python_engine(self, want: EngineWant,
                            target: wheelsets.Target) -> mf.EngineBuild:
        """The wheel set wheelsets.resolve chooses, each checked against the sha256 the
        index lists, and its requirements.txt, under engines/<name>/<version>/."""
        if (want.name, want.version) in self.python_engines:
            return self.python_engines[want.name, want.version]  # asked for twice
        self._resolving(f"{want.name}=={want.version}", target)
        chosen = await wheelsets.resolve(want.name, want.version, target)
        return self._python_built(want, await self._wheel_set(want, chosen))

    async def comfyui(self, want: EngineWant, target: wheelsets.Target, release_url: str,
                      sha256: str) -> mf.EngineBuild:
        """ComfyUI's source archive, checked against the operator's pin, and beside it the
        wheel set of its requirements.txt (comfyui.py), under engines/comfyui/<version>/."""
        if (want.name, want.version) in self.python_engines:
            return self.python_engines[want.name, want.version]  # asked for twice
        asset = comfyui_archive(want.version)
        # As engines.comfyui.release_url: the archive at <release_url>/<file>.
        url = f"{release_url.rstrip('/') or PUBLISHERS[want.name][0]}/{asset}"
        path = mf.engine_path(want.name, want.version, asset)
        self.say(f"downloading {url}")
        size, got = await self.fetcher.download(url, self.dest(path), MAX_ARCHIVE_BYTES)
        if got != sha256:
            raise BundleError(f"{shown(url)} has sha256 {got}, but --engine-sha256 pins "
                              f"{sha256}: the file is corrupt, or not the one published")
        self.add(path, size, got)
        found = await asyncio.to_thread(comfyui.read_archive, self.dest(path), want.version)
        cutoff = target.exclude_newer or found.released_cutoff
        if not cutoff:
            raise BundleError(f"{asset} gives no file dates to tell when ComfyUI "
                              f"{want.version} was released; give --exclude-newer (the day "
                              "after its release)")
        # The node's rule: --exclude-newer (server.yaml's exclude_newer), else a day after.
        target = replace(target, exclude_newer=cutoff)
        what = f"ComfyUI {want.version}'s {comfyui.REQUIREMENTS}"
        self._resolving(f"{what} ({len(found.packages)} requirements)", target)
        chosen = await wheelsets.resolve_text(found.text, what, target)
        return self._python_built(want, [path, *await self._wheel_set(want, chosen)])

    def _resolving(self, what: str, target: wheelsets.Target) -> None:
        extra = "".join(f" and {url}" for url in target.extra_index_urls)
        self.say(f"resolving {what} for {target.shown} from {shown(target.index_url)}{extra}"
                 + (f" as it stood at {target.exclude_newer}" if target.exclude_newer else ""))

    async def _wheel_set(self, want: EngineWant, chosen: list[wheelsets.Chosen]) -> list[str]:
        """The chosen wheels and the requirements.txt that pins them, under
        engines/<name>/<version>/: their paths, the requirements last."""
        sizes = [c.wheel.size for c in chosen if c.wheel.size is not None]
        self.say(f"resolved {len(chosen)} packages" + (
            f", {sum(sizes):,} bytes of wheels" if len(sizes) == len(chosen) else ""))
        paths = await self._fetch_wheels(
            chosen, lambda file: mf.engine_path(want.name, want.version, file))
        requirements = mf.engine_path(want.name, want.version, wheelsets.REQUIREMENTS)
        text = wheelsets.requirements_text(chosen).encode()
        self.dest(requirements).write_bytes(text)
        self.add(requirements, len(text), hashlib.sha256(text).hexdigest())
        total = sum(self.files[p].size for p in paths)
        self.say(f"{want.name} {want.version}: {len(paths)} wheels, {total:,} bytes")
        return [*paths, requirements]

    def _python_built(self, want: EngineWant, paths: list[str]) -> mf.EngineBuild:
        built = mf.EngineBuild(name=want.name, version=want.version, files=paths)
        self.python_engines[want.name, want.version] = built
        return built

    async def _fetch_wheels(self, chosen: list[wheelsets.Chosen],
                            path_of: Callable[[str], str]) -> list[str]:
        """Each chosen wheel at ``path_of(its file)``, checked against the sha256 (and
        size) the index lists; one already in the bundle is not fetched again."""
        paths = []
        for c in chosen:
            path = path_of(c.wheel.file)
            paths.append(path)
            if path in self.files:
                continue
            url, size = c.wheel.url, c.wheel.size
            self.say(f"downloading {c.wheel.file}"
                     + (f" ({size:,} bytes)" if size is not None else ""))
            got_size, got = await self.fetcher.download(
                url, self.dest(path), MAX_WHEEL_BYTES if size is None else size)
            if got != c.wheel.sha256:
                raise BundleError(f"{c.wheel.file} from {shown(url)} has sha256 {got}, but "
                                  f"the index lists {c.wheel.sha256}: the file is corrupt, "
                                  "or not the one the index published")
            if size is not None and got_size != size:
                raise BundleError(f"{c.wheel.file} from {shown(url)} is {got_size} bytes; "
                                  f"the index lists {size}")
            self.add(path, got_size, got)
        return paths

    async def locked_wheels(self, project: Path, wheel: Path | None, version: str,
                            targets: list[wheelsets.Target]) -> mf.LlmgwRelease:
        """llmgw's own wheel and, for each target, its dependencies at the versions
        ``project``'s uv.lock pins, one wheel each, under llmgw/<version>/."""
        pins = await wheelsets.locked_requirements(project)
        with tempfile.TemporaryDirectory(prefix="llmgw-wheel-") as built:
            if wheel is None:
                self.say(f"building llmgw's wheel from {project}")
                wheel = await wheelsets.build_project_wheel(project, Path(built))
            if not (wheel.name.startswith(f"llmgw-{version}-")
                    and wheel.name.endswith(".whl")):
                raise BundleError(f"--llmgw-wheel {wheel} is not a wheel of llmgw {version}: "
                                  "give --llmgw-version, or build the checkout of that "
                                  "release")
            paths = [self._copy_in(wheel, mf.llmgw_path(version, wheel.name))]
        for target in targets:
            self.say(f"resolving llmgw {version}'s locked dependencies for {target.shown} "
                     f"from {shown(target.index_url)}")
            chosen = await wheelsets.resolve_text(
                pins, f"llmgw {version}'s dependencies (uv.lock)", target)
            for path in await self._fetch_wheels(
                    chosen, lambda file: mf.llmgw_path(version, file)):
                if path not in paths:
                    paths.append(path)
        return mf.LlmgwRelease(version=version, kind="wheels", files=paths,
                               platforms=[t.platform for t in targets])

    def _copy_in(self, source: Path, path: str) -> str:
        """A local file into the bundle at ``path``, hashed as it is copied."""
        hasher = hashlib.sha256()
        dest = self.dest(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(source, "rb") as src, open(dest, "xb") as out:
                while chunk := src.read(2**20):
                    hasher.update(chunk)
                    out.write(chunk)
        except OSError as err:
            raise BundleError(f"{source}: {err.strerror}") from None
        self.add(path, dest.stat().st_size, hasher.hexdigest())
        return path

    async def model(self, want: ModelWant) -> mf.ModelFiles:
        commit = want.revision if re.fullmatch(r"[0-9a-f]{40}", want.revision) else \
            await self.fetcher.commit(want.repo, want.revision)
        listed = await self.fetcher.listing(want.repo, commit)
        # Dotted files are the repository's git metadata (.gitattributes), never weights.
        listed = [f for f in listed if not any(e.startswith(".") for e in f.path.split("/"))]
        chosen = [f for f in listed if not want.patterns or any(
            fnmatch.fnmatchcase(f.path, p + "*" if p.endswith("/") else p)
            for p in want.patterns)]
        if not chosen:
            raise BundleError(f"model {want.name}: no file of {want.repo}@{want.revision} "
                              f"matches {', '.join(want.patterns) or 'anything'}")
        paths = []
        for f in chosen:
            try:
                path = mf.model_path(want.repo, commit, f.path)
            except BundleError as err:
                raise BundleError(f"model {want.name}: {err}; leave the file out with "
                                  "file patterns (NAME=hf://ORG/REPO:GLOB)") from None
            paths.append(path)
            if path in self.files:
                continue  # the same file at the same commit, for another model name
            self.say(f"downloading {want.repo}@{commit[:12]}/{f.path} ({f.size:,} bytes)")
            dest = self.dest(path)
            size, got = await self.fetcher.download(
                self.fetcher.file_url(want.repo, commit, f.path), dest, f.size)
            if size != f.size:
                raise BundleError(f"{want.repo}/{f.path} is {size} bytes; the hub's listing "
                                  f"says {f.size}")
            if f.sha256 is not None and got != f.sha256:
                raise BundleError(f"{want.repo}/{f.path} has sha256 {got}; the hub's "
                                  f"listing says {f.sha256}")
            if f.git_oid is not None and git_oid(dest, size) != f.git_oid:
                raise BundleError(f"{want.repo}/{f.path} is not the file the hub lists "
                                  "(its git blob id differs)")
            self.add(path, size, got)
        return mf.ModelFiles(name=want.name, repo=want.repo, revision=commit, files=paths)

    def wheels(self, folder: Path, version: str) -> mf.LlmgwRelease:
        paths, platforms = [], set()
        try:
            entries = sorted(folder.iterdir())
        except OSError as err:
            raise BundleError(f"--wheels {folder}: {err.strerror}") from None
        for entry in entries:
            if not entry.is_file():
                raise BundleError(f"--wheels {folder}: {entry.name} is not a file; the "
                                  "folder holds wheels (and their lists) only")
            if entry.name.endswith(".whl"):
                platforms.add(entry.name[:-4].split("-")[-1])
            paths.append(self._copy_in(entry, mf.llmgw_path(version, entry.name)))
        if not paths:
            raise BundleError(f"--wheels {folder} is empty")
        ours = [e.name for e in entries if e.name.startswith("llmgw-")]
        if not any(name.startswith(f"llmgw-{version}-") for name in ours):
            raise BundleError(
                f"--wheels {folder} holds no wheel of llmgw {version}"
                + (f" (it holds {', '.join(ours)}): give --llmgw-version" if ours else
                   ": put llmgw's own wheel beside its dependencies"))
        return mf.LlmgwRelease(version=version, kind="wheels", files=paths,
                               platforms=sorted(platforms))

    def nix_closure(self, nix: list[str], given: list[str], version: str,
                    now: datetime) -> mf.LlmgwRelease:
        """The closure as a binary cache under llmgw/<version>/nix, signed by a Nix key
        made for this bundle (nix.py)."""
        folder = mf.llmgw_path(version, mf.NIX_CACHE)
        cache = self.dest(folder)
        cache.parent.mkdir(parents=True, exist_ok=True)
        self.say(f"nix copy: the closure of {' '.join(given)}")
        public, roots = nixcache.export_closure(nix, given, cache, nixcache.key_name(now))
        paths = []
        for rel, size, sha256 in nixcache.cache_files(cache):
            path = mf.check_path(f"{folder}/{rel}")
            self.add(path, size, sha256)
            paths.append(path)
        return mf.LlmgwRelease(version=version, kind="nix", files=paths,
                               nix_public_key=public, roots=roots)


async def create_bundle(request: Request, say: Say = lambda _: None) -> Created:
    """Make the bundle ``request`` describes at request.out (a folder, or a tar)."""
    from llmgw import __version__

    private = signing.load_private_key(request.key_file)
    public = private.public_key()
    out = request.out
    if out.exists() or out.is_symlink():
        raise BundleError(f"{out} exists; give a new name for the bundle")
    version = mf.check_element(request.llmgw_version or __version__, "--llmgw-version")
    if request.llmgw_lock and not request.llmgw_targets:
        raise BundleError("--llmgw-lock: name the nodes' platforms (--llmgw-platform)")
    given = [option for option, value in (("--wheels", request.wheels),
                                          ("--llmgw-lock", request.llmgw_lock),
                                          ("--nix-closure", request.nix_closure)) if value]
    if len(given) > 1:
        raise BundleError(f"{' and '.join(given)}: a bundle carries llmgw one way; make one "
                          "bundle for each")
    check_engine_sha256(request.engines, request.engine_sha256)
    now = (request.now or datetime.now(UTC)).astimezone(UTC).replace(microsecond=0)
    try:
        root = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as err:
        raise BundleError(f"cannot write beside {out}: {err.strerror}") from None
    try:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            builder = _Builder(root, Fetcher(http, request.hub, request.hub_token), say)
            engines = []
            for e in request.engines:
                if e.name in wheelsets.ENGINES:
                    engines.append(await builder.python_engine(e, request.python_target))
                elif e.name == comfyui.NAME:
                    engines.append(await builder.comfyui(
                        e, request.python_target, request.release_url,
                        request.engine_sha256[comfyui_archive(e.version)]))
                else:
                    engines.append(await builder.engine(e, request.release_url))
            models = [await builder.model(m) for m in request.models]
            llmgw = await builder.locked_wheels(
                request.llmgw_lock, request.llmgw_wheel, version,
                request.llmgw_targets) if request.llmgw_lock else None
        if request.wheels:
            llmgw = builder.wheels(request.wheels, version)
        if request.nix_closure:
            llmgw = builder.nix_closure(request.nix, request.nix_closure, version, now)
        manifest = Manifest(
            llmgw_version=version, created_at=now, expires_at=now + request.expires_in,
            key_id=signing.key_id(public), llmgw=llmgw, engines=engines, models=models,
            files=sorted(builder.files.values(), key=lambda f: f.path))
        data = mf.encode(manifest)
        (root / mf.MANIFEST).write_bytes(data)
        (root / mf.SIGNATURE).write_bytes(signing.sign(private, data))
        if request.tar:
            _write_tar(root, out)
        else:
            os.rename(root, out)
    except OSError as err:
        raise BundleError(f"writing the bundle: {err.strerror}: {err.filename}") from None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return Created(out, manifest, hashlib.sha256(data).hexdigest(), manifest.key_id,
                   sum(f.size for f in manifest.files))


def _write_tar(root: Path, out: Path) -> None:
    """A plain tar: the manifest and signature first, then the files in path order, with
    no owner names or modes a reader would have to trust."""
    part = out.with_name(f".{out.name}.part")

    def plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = 0o755 if info.isdir() else 0o644
        return info

    try:
        with tarfile.open(part, "w", format=tarfile.PAX_FORMAT) as tar:
            for name in (mf.MANIFEST, mf.SIGNATURE):
                tar.add(root / name, arcname=name, filter=plain)
            files = root / mf.FILES
            for path in sorted(files.rglob("*")) if files.exists() else []:
                tar.add(path, arcname=str(path.relative_to(root)), recursive=False,
                        filter=plain)
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)
