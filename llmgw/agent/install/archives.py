"""Installing an engine published as a release archive (llama.cpp), and proving it runs.

``<root>/<name>/<version>`` exists only once its archive matched the publisher's sha256,
unpacked under the rules of ``archive.py``, ``ldd`` found every library its binary needs,
and ``<binary> --version`` ran; a marker file there records what was checked. Everything
before that happens in a dotted scratch directory under ``root`` that is removed whatever
the outcome, so an interrupted install never looks installed. ``recheck`` runs the same
checks again on what is installed, for the agent's ten-minute pass: an unrelated upgrade
can take a library away.

Names and versions come from the control plane and are validated before any path is
built from them: a version of ``../x`` never reaches the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from yarl import URL

from llmgw.agent.install.archive import unpack_archive
from llmgw.agent.install.download import check_sha256, download, shown
from llmgw.agent.install.ldd import library_problems
from llmgw.agent.install.pypi import InstallError
from llmgw.agent.weights.manifest import part_of, size_text
from llmgw.core.names import NameRuleError, check_element

MARKER = ".llmgw-installed.json"
MAX_ARCHIVE_BYTES = 4 * 2**30
VERSION_TIMEOUT_S = 30.0
PROGRESS_INTERVAL_S = 1.0
_SCRATCH_PREFIX = ".install@"  # '@' is in no valid name, so one install's sweep is its own
_MAX_OUTPUT = 2000


def checked_name_version(name: str, version: str) -> tuple[str, str]:
    """The engine's name and version as given, once each is a safe single path element
    (InstallError otherwise): checked before any path is built from them."""
    try:
        return check_element(name, "engine name"), check_element(version, "engine version")
    except NameRuleError as err:
        raise InstallError(str(err)) from None


def installed_archive(root: Path, name: str, version: str) -> Path | None:
    """``root/name/version`` when an install (an archive, or a Python environment) finished
    there, else None."""
    name, version = checked_name_version(name, version)
    path = root / name / version
    return path if (path / MARKER).is_file() else None


def read_marker(path: Path) -> dict:
    """What was checked when ``path`` was installed: url, sha256, binary (relative to
    ``path``), the first lines of its ``--version``, and when."""
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as err:
        raise InstallError(f"{path / MARKER} cannot be read: {err}") from None


def find_binary(tree: Path, binary: str) -> Path:
    """The regular file called ``binary`` nearest the top of ``tree`` (archives differ:
    ``build/bin/llama-server``, ``llama-b6000/llama-server``); links are not followed."""
    queue = deque([tree])
    while queue:
        directory = queue.popleft()
        with os.scandir(directory) as entries:
            found = sorted(entries, key=lambda e: e.name)
        for entry in found:
            if entry.name == binary and entry.is_file(follow_symlinks=False):
                return Path(entry.path)
        queue.extend(Path(e.path) for e in found if e.is_dir(follow_symlinks=False))
    raise InstallError(f"the archive has no file named {binary}")


def run_version(binary: Path) -> str:
    """Run ``binary --version`` (bounded in time) and return what it printed; InstallError
    when it cannot start, fails, or hangs."""
    try:
        proc = subprocess.Popen([str(binary), "--version"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as err:
        raise InstallError(f"{binary.name} does not run on this node: {err.strerror}") from None
    timed_out = False
    with proc:
        try:
            out, _ = proc.communicate(timeout=VERSION_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            timed_out, out = True, b""
        finally:
            # Its own session: whatever it started goes with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if timed_out:
        raise InstallError(f"{binary.name} --version did not finish within "
                           f"{VERSION_TIMEOUT_S:.0f} s")
    text = out.decode(errors="replace").strip()[-_MAX_OUTPUT:]
    if proc.returncode != 0:
        raise InstallError(f"{binary.name} --version failed (exit {proc.returncode})"
                           + (f": {text}" if text else ""))
    return text


def recheck(path: Path, binary: str) -> list[str]:
    """The problems of an installed engine now: libraries missing or too old, or a
    ``--version`` that no longer runs; ``[]`` when it still works."""
    try:
        exe = find_binary(path, binary)
    except (InstallError, OSError) as err:
        return [str(err)]
    problems = library_problems(exe)
    if problems:
        return problems
    try:
        run_version(exe)
    except InstallError as err:
        return [str(err)]
    return []


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def sweep_scratch(root: Path, prefix: str) -> None:
    """Remove what an earlier, interrupted install left: scratch directories named
    ``<prefix>...@<random>`` ('@' is in no valid name, so a sweep finds only its own)."""
    for leftover in root.glob(f"{prefix}@*"):
        shutil.rmtree(leftover, ignore_errors=True)


async def make_room(root: Path, name: str, version: str, min_free_bytes: int) -> None:
    """Create ``root`` and refuse, with the figures, when it has less than
    ``min_free_bytes`` free: before anything is downloaded or built."""
    try:
        await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
        free = await asyncio.to_thread(free_bytes, root)
    except OSError as err:
        raise InstallError(f"installing {name} {version}: cannot use {root}: "
                           f"{err.strerror}") from None
    if free < min_free_bytes:
        raise InstallError(f"{name} needs {size_text(min_free_bytes)} free in {root}; "
                           f"{size_text(free)} is")


class DownloadMeter:
    """Download progress as status lines: the size once, then at most every second."""

    def __init__(self, label: str, status: Callable[[str], None]) -> None:
        self.label, self.status = label, status
        self.last = float("-inf")

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        if done == 0:
            size = f" ({size_text(total)})" if total is not None else ""
            self.status(f"downloading {self.label}{size}")
            self.last = now
        elif now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            self.status(f"downloading {self.label}: "
                        + (part_of(done, total) if total else size_text(done)))


async def install_archive(session: aiohttp.ClientSession, *, url: str, sha256: str, root: Path,
                          name: str, version: str, binary: str,
                          status: Callable[[str], None], min_free_bytes: int = 0) -> Path:
    """Install ``name`` ``version`` from the archive at ``url`` into ``root/name/version``
    and return that directory; an existing install that still passes ``recheck`` is
    returned as it is. One install of a name and version at a time. ``status`` hears each
    step ("downloading llama-b6000-bin-ubuntu-x64.tar.gz (16.0 MB)", "unpacking …",
    "checking the libraries llama-server needs", "running llama-server --version",
    "installed …"); a failure raises InstallError in words for the operator."""
    name, version = checked_name_version(name, version)
    try:
        check_element(binary, "engine binary")
    except NameRuleError as err:
        raise InstallError(str(err)) from None
    digest = check_sha256(sha256)
    label = URL(url).name or shown(url)

    existing = installed_archive(root, name, version)
    if existing is not None:
        problems = await asyncio.to_thread(recheck, existing, binary)
        if not problems:
            return existing
        status(f"reinstalling {name} {version}: {'; '.join(problems)}")

    await make_room(root, name, version, min_free_bytes)
    await asyncio.to_thread(sweep_scratch, root, f"{_SCRATCH_PREFIX}{name}@{version}")
    work = root / f"{_SCRATCH_PREFIX}{name}@{version}@{secrets.token_hex(4)}"
    target = root / name / version
    try:
        await asyncio.to_thread(work.mkdir)
        archive, tree = work / "archive", work / "tree"
        await download(session, url, archive, sha256=digest, max_bytes=MAX_ARCHIVE_BYTES,
                       progress=DownloadMeter(label, status))
        status(f"unpacking {label}")
        await asyncio.to_thread(tree.mkdir)
        await asyncio.to_thread(unpack_archive, archive, tree)
        await asyncio.to_thread(archive.unlink)
        exe = await asyncio.to_thread(find_binary, tree, binary)

        status(f"checking the libraries {binary} needs")
        problems = await asyncio.to_thread(library_problems, exe)
        if problems:
            raise InstallError(f"{label}: {binary} cannot start on this node: "
                               + "; ".join(problems))
        status(f"running {binary} --version")
        output = await asyncio.to_thread(run_version, exe)

        marker = {"name": name, "version": version, "url": shown(url), "sha256": digest,
                  "binary": str(exe.relative_to(tree)), "libraries": "ldd found every one",
                  "version_output": output,
                  "installed_at": datetime.now(UTC).isoformat(timespec="seconds")}
        await asyncio.to_thread((tree / MARKER).write_text, json.dumps(marker, indent=1))
        await asyncio.to_thread(put_in_place, tree, target, work / "old")
    except OSError as err:
        raise InstallError(f"installing {name} {version} in {root}: "
                           f"{err.strerror or err}") from None
    finally:
        await asyncio.to_thread(shutil.rmtree, work, ignore_errors=True)
    status(f"installed {name} {version}")
    return target


def put_in_place(tree: Path, target: Path, aside: Path) -> None:
    """Rename ``tree`` to ``target``; whatever was there (a broken install) moves to
    ``aside``, which the caller removes."""
    target.parent.mkdir(exist_ok=True)
    if os.path.lexists(target):
        os.rename(target, aside)
    os.rename(tree, target)
