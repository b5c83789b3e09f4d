"""A Python engine's wheel set (vLLM, SGLang; ComfyUI's requirements.txt, comfyui.py) for
a bundle, so that air-gapped nodes can install it with no index.

``uv pip compile`` resolves ``NAME==VERSION`` (or a requirements text) for one target, a
CPython version on a Linux platform (``x86_64-manylinux_2_28``: glibc 2.28 or later on
x86_64), against the indexes as they stood at ``exclude_newer``, and writes the
resolution as a pylock.toml (PEP 751). uv 0.13 lists, for each package, the wheels that
can install on the target, with the sha256 the index gives, and drops the packages whose
markers the target does not meet. :func:`choose` keeps the one wheel per package that
suits the target most closely, as pip would rank them; :func:`requirements_text` pins
each with its sha256, one ``--require-hashes`` entry per package and no markers, for
``uv pip install --no-index --find-links <folder> --require-hashes -r requirements.txt``
on the nodes.

Wheels only: a node builds nothing, so a package of which the index serves only a source
archive for the target refuses the whole bundle. uv reads no configuration file and no
``UV_*``/``PIP_*`` variable here, downloads no Python, and keeps its cache in a scratch
folder removed afterwards.
"""

from __future__ import annotations

import itertools
import re
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from urllib.parse import unquote, urlsplit

from llmgw.bundle.manifest import BundleError
from llmgw.core.builds import ENVIRONMENT_PYTHON
from llmgw.core.desired_engines import PYPI
from llmgw.core.wheels import WHEEL
from llmgw.uvenv import UvFailed, run_uv

ENGINES = ("vllm", "sglang")
DEFAULT_PYTHON = ENVIRONMENT_PYTHON  # as the nodes build them
# vLLM's dependencies (llguidance) publish Linux wheels for glibc 2.31 and later only.
DEFAULT_PLATFORM = "x86_64-manylinux_2_31"
ARCHES = ("x86_64", "aarch64")
REQUIREMENTS = "requirements.txt"
RESOLVE_TIMEOUT_S = 600.0

_PLATFORM = re.compile(r"(?P<arch>[a-z0-9_]+)-manylinux_2_(?P<glibc>\d+)")
_PYTHON = re.compile(r"3\.(\d+)")
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_VERSION = re.compile(r"[A-Za-z0-9.+!_-]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# manylinux's names before PEP 600, each the same as a glibc version's.
_LEGACY = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


@dataclass(frozen=True, slots=True)
class Target:
    """What a Python engine's wheels are resolved for (``python``: a CPython version,
    ``platform``: ARCH-manylinux_2_NN) and where from, as the index stood at
    ``exclude_newer`` (a date or an RFC 3339 time; "" for now)."""

    python: str = DEFAULT_PYTHON
    platform: str = DEFAULT_PLATFORM
    index_url: str = PYPI
    extra_index_urls: tuple[str, ...] = ()
    exclude_newer: str = ""

    def __post_init__(self) -> None:
        if not _PYTHON.fullmatch(self.python):
            raise BundleError(f"--python {self.python!r}: write a CPython version, 3.MINOR "
                              f"(the nodes build engines with {DEFAULT_PYTHON})")
        found = _PLATFORM.fullmatch(self.platform)
        if not found or found["arch"] not in ARCHES or int(found["glibc"]) < 17:
            raise BundleError(
                f"--python-platform {self.platform!r}: write ARCH-manylinux_2_NN, ARCH one "
                f"of {', '.join(ARCHES)} and 2_NN the oldest glibc of the nodes, 2_17 or "
                f"later (e.g. {DEFAULT_PLATFORM}, aarch64-manylinux_2_28)")
        for option, url in [("--index-url", self.index_url),
                            *(("--extra-index-url", u) for u in self.extra_index_urls)]:
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
                raise BundleError(f"{option} {url!r}: write the http(s) URL of a package "
                                  "index (PEP 503), e.g. https://pypi.org/simple")
        if self.exclude_newer:
            try:
                datetime.fromisoformat(self.exclude_newer)
            except ValueError:
                raise BundleError(f"--exclude-newer {self.exclude_newer!r}: write a date "
                                  "(2025-06-30) or an RFC 3339 time "
                                  "(2025-06-30T12:00:00Z)") from None

    @property
    def shown(self) -> str:
        return f"CPython {self.python} on {self.platform}"


@dataclass(frozen=True, slots=True)
class Wheel:
    file: str
    url: str
    sha256: str
    size: int | None  # as the index lists it, where it does


@dataclass(frozen=True, slots=True)
class Locked:
    """One package of a pylock.toml: its wheels for the target, and whether the index
    has a source archive of it."""

    name: str
    version: str
    wheels: tuple[Wheel, ...]
    sdist: bool


@dataclass(frozen=True, slots=True)
class Chosen:
    name: str
    version: str
    wheel: Wheel


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- the target's tags, as pip ranks them -------------------------------------------------


def platform_tags(platform: str) -> list[str]:
    """The platform tags a node of ``platform`` installs, the most specific first:
    manylinux_2_28_x86_64 down to manylinux_2_5 (with the legacy names), then
    linux_x86_64."""
    found = _PLATFORM.fullmatch(platform)
    assert found is not None, platform
    arch, glibc = found["arch"], int(found["glibc"])
    tags = []
    for minor in range(glibc, 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in _LEGACY:
            tags.append(f"{_LEGACY[minor]}_{arch}")
    return [*tags, f"linux_{arch}"]


def supported_tags(python: str, platform: str) -> list[str]:
    """PYTHON-ABI-PLATFORM tags CPython ``python`` installs on ``platform``, the most
    specific first (the order of pip's ``packaging.tags.sys_tags``)."""
    found = _PYTHON.fullmatch(python)
    assert found is not None, python
    minor = int(found[1])
    cp, platforms = f"cp3{minor}", platform_tags(platform)
    tags = [f"{cp}-{abi}-{p}" for abi in (cp, "abi3", "none") for p in platforms]
    tags += [f"cp3{older}-abi3-{p}" for older in range(minor - 1, 1, -1) for p in platforms]
    pys = [f"py3{minor}", "py3", *(f"py3{older}" for older in range(minor - 1, -1, -1))]
    tags += [f"{py}-none-{p}" for py in pys for p in platforms]
    return [*tags, f"{cp}-none-any", *(f"{py}-none-any" for py in pys)]


def wheel_tags(file: str) -> list[str]:
    """The tags a wheel's file name gives, compressed sets expanded (py2.py3 -> both)."""
    found = WHEEL.fullmatch(file)
    if found is None:
        return []
    return ["-".join(t) for t in itertools.product(
        found["python"].split("."), found["abi"].split("."), found["platform"].split("."))]


# --- reading the resolution ---------------------------------------------------------------


def _wheel(entry: object, name: str, where: str) -> Wheel:
    if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
        raise BundleError(f"{where}: a wheel with no url; only packages from an index are "
                          "taken")
    url = entry["url"]
    file = entry.get("name") or unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    hashes = entry.get("hashes")
    sha256 = hashes.get("sha256") if isinstance(hashes, dict) else None
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise BundleError(f"{where}: {file} has no sha256; the index must list one for "
                          "every file")
    size = entry.get("size")
    found = WHEEL.fullmatch(file) if isinstance(file, str) else None
    if found is None:
        raise BundleError(f"{where}: {url} is not a wheel's file name")
    if _canonical(found["name"]) != _canonical(name):
        raise BundleError(f"{where}: the index serves {file}, a wheel of another package")
    return Wheel(file, url, sha256, size if isinstance(size, int) and size >= 0 else None)


def read_pylock(text: str) -> list[Locked]:
    """The packages of uv's pylock.toml (PEP 751); BundleError for anything but packages
    from an index."""
    try:
        lock = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise BundleError(f"uv's resolution is not TOML: {err}") from None
    if not str(lock.get("lock-version", "")).startswith("1."):
        raise BundleError(f"uv's resolution has lock-version {lock.get('lock-version')!r}; "
                          "this llmgw reads pylock.toml 1.x")
    packages, seen = [], set()
    for entry in lock.get("packages", []):
        name, version = (entry.get("name"), entry.get("version")) if isinstance(
            entry, dict) else (None, None)
        if not isinstance(name, str) or not _NAME.fullmatch(name) or \
                not isinstance(version, str) or not _VERSION.fullmatch(version):
            raise BundleError(f"uv's resolution has a package {name!r} {version!r} that is "
                              "not a name and version from an index")
        where = f"{name} {version}"
        if any(key in entry for key in ("vcs", "directory", "archive")):
            raise BundleError(f"{where} is not from an index; only packages from an "
                              "index are taken")
        if _canonical(name) in seen:
            raise BundleError(f"uv's resolution lists {name} twice")
        seen.add(_canonical(name))
        wheels = tuple(_wheel(w, name, where) for w in entry.get("wheels", []))
        packages.append(Locked(name, version, wheels, isinstance(entry.get("sdist"), dict)))
    if not packages:
        raise BundleError("uv's resolution names no packages")
    return packages


def choose(packages: list[Locked], target: Target) -> list[Chosen]:
    """One wheel per package, the one whose best tag ``target`` ranks first (sorted by
    name); BundleError naming the first package with no wheel for it."""
    rank = {tag: i for i, tag in enumerate(supported_tags(target.python, target.platform))}
    chosen = []
    for p in sorted(packages, key=lambda p: _canonical(p.name)):
        ranked = sorted((min(rank.get(t, len(rank)) for t in wheel_tags(w.file)), w.file, w)
                        for w in p.wheels)
        ranked = [r for r in ranked if r[0] < len(rank)]
        if ranked:
            chosen.append(Chosen(p.name, p.version, ranked[0][2]))
            continue
        has = (f"the index has only {', '.join(w.file for w in p.wheels[:3])}"
               f"{' and more' if len(p.wheels) > 3 else ''}" if p.wheels
               else "only a source archive" if p.sdist else "no file of it")
        found = _PLATFORM.fullmatch(target.platform)
        assert found is not None
        raise BundleError(
            f"{p.name} {p.version} has no wheel for {target.shown} ({has}): a node installs "
            f"wheels and builds nothing; if the nodes' glibc is newer than 2.{found['glibc']} "
            f"(`ldd --version` on a node), say so with --python-platform "
            f"{found['arch']}-manylinux_2_NN for glibc 2.NN, or choose a --python it "
            "publishes wheels for, or serve a wheel of it from an index of your own and add "
            "that with --extra-index-url")
    return chosen


def requirements_text(chosen: list[Chosen]) -> str:
    """The ``--require-hashes`` text that installs exactly ``chosen`` from a folder."""
    return "".join(f"{c.name}=={c.version} \\\n    --hash=sha256:{c.wheel.sha256}\n"
                   for c in sorted(chosen, key=lambda c: _canonical(c.name)))


# --- resolving ----------------------------------------------------------------------------


def compile_args(target: Target) -> list[str]:
    """``uv pip compile`` of the requirements on stdin into a pylock.toml for ``target``."""
    argv = ["pip", "compile", "-", "--no-config", "--no-python-downloads",
            "--python", sys.executable, "--generate-hashes", "--format", "pylock.toml",
            "--python-version", target.python, "--python-platform", target.platform,
            "--index-url", target.index_url]
    for extra in target.extra_index_urls:
        argv += ["--extra-index-url", extra]
    if target.exclude_newer:
        argv += ["--exclude-newer", target.exclude_newer]
    return argv


async def resolve(name: str, version: str, target: Target) -> list[Chosen]:
    """``name==version`` and everything it needs, one wheel each, for ``target``."""
    return await resolve_text(f"{name}=={version}\n", f"{name}=={version}", target)


async def resolve_text(requirements: str, what: str, target: Target) -> list[Chosen]:
    """``requirements`` (a requirements.txt; ``what`` names it) and everything they need,
    one wheel each, for ``target``."""
    with tempfile.TemporaryDirectory(prefix="llmgw-uv-cache-") as cache:
        try:
            out = await run_uv(compile_args(target), cache=Path(cache),
                               timeout_s=RESOLVE_TIMEOUT_S, stdin=requirements)
        except UvFailed as err:
            if err.timed_out:
                raise BundleError(f"resolving {what} took over {RESOLVE_TIMEOUT_S:.0f} s; "
                                  f"is {target.index_url} reachable?") from None
            raise BundleError(f"resolving {what} for {target.shown} failed: {err}") from None
    return choose(read_pylock(out), target)


async def _uv(args: list[str], what: str) -> str:
    """``uv ARGS`` with a scratch cache; its output, or BundleError saying ``what`` failed."""
    with tempfile.TemporaryDirectory(prefix="llmgw-uv-cache-") as cache:
        try:
            return await run_uv(args, cache=Path(cache), timeout_s=RESOLVE_TIMEOUT_S)
        except UvFailed as err:
            raise BundleError(f"{what} failed: {err}") from None


async def locked_requirements(project: Path) -> str:
    """What ``project``'s uv.lock pins llmgw's dependencies to at run time (no dev group,
    not the project itself), as a requirements.txt: ``uv export --frozen``."""
    if not (project / "uv.lock").is_file():
        raise BundleError(f"--llmgw-lock {project}: no uv.lock there; give llmgw's source "
                          "checkout (the folder with pyproject.toml and uv.lock)")
    return await _uv(["export", "--frozen", "--no-dev", "--no-emit-project", "--no-hashes",
                      "--no-header", "--no-annotate", "--no-config", "--format",
                      "requirements.txt", "--project", str(project)],
                     f"reading {project}/uv.lock (uv export)")


async def build_project_wheel(project: Path, out: Path) -> Path:
    """``project``'s own wheel (``uv build --wheel``; its build backend comes from the
    index uv is configured with, on the connected machine)."""
    await _uv(["build", "--wheel", "--no-config", "--out-dir", str(out), str(project)],
              f"building llmgw's wheel from {project} (uv build)")
    built = sorted(out.glob("*.whl"))
    if len(built) != 1:
        raise BundleError(f"uv build of {project} made {len(built)} wheels, not one")
    return built[0]
