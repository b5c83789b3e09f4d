"""Wheels of llmgw and of everything it needs at run time, made offline, for the tests that
install a release (``llmgw ctl upgrade``).

llmgw's wheel is zipped from this checkout the way pyproject.toml's hatch config lays it
out. The dependencies are repacked from this venv's site-packages: each installed
distribution's RECORD names its files, and a wheel is those files plus the dist-info, with
what lives outside site-packages (``../../../bin/uv``, headers) moved under
``<name>-<version>.data/``. Nothing is built or compiled, and no index is asked.

Every wheel is written ZIP_STORED (compressing ~290 MB costs seconds of CPU and a stored
zip is a valid wheel) with a fixed timestamp, so the same input gives the same bytes.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import re
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

from uv import find_uv_bin

ROOT = Path(__file__).resolve().parents[2]

# What an installer writes into a dist-info, not what a wheel carries; RECORD is rewritten.
_INSTALLER_FILES = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json", "uv_cache.json",
                    "uv_build.json"}
_PREFIX = "../../../"  # a RECORD path that leaves site-packages: relative to the venv prefix
_EPOCH = (1980, 1, 1, 0, 0, 0)


def _normalize(name: str) -> str:
    """A distribution name as a wheel's file name spells it."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


class _Wheel:
    """A wheel being written: each file goes into the zip and into RECORD."""

    def __init__(self, path: Path, dist_info: str) -> None:
        self.path = path
        self.dist_info = dist_info
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_STORED)
        self.record: list[str] = []

    def add(self, name: str, data: bytes, mode: int = 0o644) -> None:
        info = zipfile.ZipInfo(name, date_time=_EPOCH)
        info.external_attr = (0o100000 | (mode & 0o7777)) << 16  # a regular file, its bits
        self.zip.writestr(info, data)
        self.record.append(f"{name},{_digest(data)},{len(data)}")

    def close(self) -> Path:
        record = f"{self.dist_info}/RECORD"
        lines = [*self.record, f"{record},,"]
        info = zipfile.ZipInfo(record, date_time=_EPOCH)
        info.external_attr = 0o100644 << 16
        self.zip.writestr(info, "".join(line + "\n" for line in lines))
        self.zip.close()
        return self.path


def _skipped(path: PurePosixPath) -> bool:
    return "__pycache__" in path.parts or path.suffix == ".pyc"


def llmgw_wheel(dest: Path, version: str) -> Path:
    """A wheel of this checkout's llmgw at ``version`` (e.g. "0.1.1"), written into
    ``dest``; returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    installed = md.distribution("llmgw")
    dist_info = f"llmgw-{version}.dist-info"
    wheel = _Wheel(dest / f"llmgw-{version}-py3-none-any.whl", dist_info)
    # [tool.hatch.build.targets.wheel]: packages = ["llmgw"], migrations -> llmgw/_migrations
    for source, target in [("llmgw", "llmgw"), ("migrations", "llmgw/_migrations")]:
        for file in sorted((ROOT / source).rglob("*")):
            relative = PurePosixPath(file.relative_to(ROOT / source).as_posix())
            if file.is_file() and not _skipped(relative):
                wheel.add(f"{target}/{relative}", file.read_bytes(), file.stat().st_mode)
    metadata, replaced = re.subn(r"(?m)^Version: .*$", f"Version: {version}",
                                 installed.read_text("METADATA") or "", count=1)
    if not replaced:
        raise ValueError("the installed llmgw's METADATA has no Version line")
    wheel.add(f"{dist_info}/METADATA", metadata.encode())
    wheel.add(f"{dist_info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: llmgw-tests\n"
                                    b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    wheel.add(f"{dist_info}/entry_points.txt",
              (installed.read_text("entry_points.txt") or "").encode())
    return wheel.close()


def runtime_requirements() -> dict[str, str]:
    """Name -> version of what llmgw needs at run time, as uv.lock pins it."""
    out = subprocess.run(
        [find_uv_bin(), "export", "--frozen", "--no-dev", "--no-hashes", "--no-emit-project"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout
    pins = {}
    for line in out.splitlines():
        if line and not line.startswith((" ", "#")):
            name, _, version = line.split(";")[0].strip().partition("==")
            pins[name] = version
    return pins


def _tags(wheel_file: str) -> str:
    """The compressed tag set (PEP 425) of a WHEEL file's ``Tag:`` lines."""
    triples = [line.split(":", 1)[1].strip().split("-")
               for line in wheel_file.splitlines() if line.startswith("Tag:")]
    if not triples:
        raise ValueError("WHEEL lists no Tag")
    return "-".join(".".join(dict.fromkeys(t[i] for t in triples)) for i in range(3))


def _shebang_for_wheel(data: bytes) -> bytes:
    """A script whose ``#!`` names this venv's Python, as a wheel carries it: ``#!python``,
    which the installer rewrites to the new venv's."""
    first, newline, rest = data.partition(b"\n")
    if first.startswith(b"#!") and first[2:].strip().startswith(sys.prefix.encode()):
        return b"#!python" + newline + rest
    return data


def _repack(dist: md.Distribution, dest: Path) -> Path:
    name, version = dist.metadata["Name"], dist.version
    wheel_file = dist.read_text("WHEEL") or ""
    files = [PurePosixPath(str(f)) for f in dist.files or []]
    dist_info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    data_dir = dist_info.removesuffix(".dist-info") + ".data"
    entry_scripts = {e.name for e in dist.entry_points
                     if e.group in ("console_scripts", "gui_scripts")}
    wheel = _Wheel(dest / f"{_normalize(name)}-{version}-{_tags(wheel_file)}.whl", dist_info)
    for file in files:
        source = Path(dist.locate_file(file))
        if _skipped(file) or (file.parts[0] == dist_info and file.name in _INSTALLER_FILES):
            continue
        text = str(file)
        if not text.startswith(_PREFIX):
            wheel.add(text, source.read_bytes(), source.stat().st_mode)
            continue
        outside = PurePosixPath(text.removeprefix(_PREFIX))
        if outside.parent == PurePosixPath("bin"):
            if outside.name in entry_scripts:  # the installer writes these itself
                continue
            data = _shebang_for_wheel(source.read_bytes())
            wheel.add(f"{data_dir}/scripts/{outside.name}", data, source.stat().st_mode)
        else:
            wheel.add(f"{data_dir}/data/{outside}", source.read_bytes(), source.stat().st_mode)
    return wheel.close()


def dependency_wheels(dest: Path) -> list[Path]:
    """Wheels of every runtime dependency of llmgw as installed in this venv, repacked from
    site-packages."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for name, pinned in runtime_requirements().items():
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:  # only for another platform (sys_platform == 'win32')
            continue
        if dist.version != pinned:
            raise RuntimeError(f"{name} {dist.version} is installed, uv.lock pins {pinned}: "
                               "run `make sync`")
        wheels.append(_repack(dist, dest))
    return wheels


def release_wheels(dest: Path, version: str) -> Path:
    """``dest`` filled with both (llmgw at ``version`` + every dependency); returns dest."""
    llmgw_wheel(dest, version)
    dependency_wheels(dest)
    return dest


def requirements_for(wheels: list[Path]) -> str:
    """``name==version --hash=sha256:...`` for each wheel, from its file name and bytes."""
    lines = []
    for wheel in sorted(wheels):
        name, version = wheel.name.split("-")[:2]
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        lines.append(f"{name}=={version} --hash=sha256:{sha}\n")
    return "".join(lines)
