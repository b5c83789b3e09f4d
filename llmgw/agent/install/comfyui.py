"""ComfyUI: its release's source archive, unpacked beside the Python environment its
requirements file asks for.

``<root>/comfyui/<version>-<build>`` holds the source tree (``main.py`` at its top) and
``venv/``, the environment ``engines/comfyui.py`` runs ``main.py`` with; it exists only
once every step below passed, in a dotted scratch directory removed whatever the outcome:

1. the archive (GitHub's archive of the tag) matched the sha256 server.yaml pins: GitHub
   publishes none for a tag's archive, so a version without one is refused;
2. it unpacked under ``archive.py``'s rules, with ``main.py`` and ``requirements.txt`` at
   the top of the tree;
3. ``requirements.txt`` names packages from the index and nothing else (no URL, path, VCS
   reference or option), and resolves, pinned with hashes, as the index stood a day after
   the release (the newest file date in the archive, GitHub's commit time, unless
   server.yaml names ``exclude_newer``);
4. the environment built from that list (``pyenv.build_environment``, hashes required,
   torch from PyTorch's own index where the build says) ran the import check.

From the control plane's mirror, steps 3 and 4 read no index: the bundle holds the wheel
set ``llmgw bundle create`` resolved from the same archive by the same rules
(bundle/comfyui.py), beside the archive, and the environment is built from those wheels
(``pyenv.build_from_bundle``), each checked against the sha256 the control plane sent
from the bundle's signed manifest.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tarfile
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from yarl import URL

from llmgw.agent.install.archive import unpack_archive
from llmgw.agent.install.archives import (
    MARKER,
    MAX_ARCHIVE_BYTES,
    DownloadMeter,
    checked_name_version,
    find_binary,
    installed_archive,
    put_in_place,
    sweep_scratch,
)
from llmgw.agent.install.download import check_sha256, download, shown
from llmgw.agent.install.pyenv import (
    BUNDLED,
    build_environment,
    build_from_bundle,
    check_source_requirements,
    compile_requirements,
)
from llmgw.agent.install.pypi import InstallError
from llmgw.agent.weights.manifest import size_text
from llmgw.core import requirements

NAME = "comfyui"
MAIN = "main.py"
REQUIREMENTS = "requirements.txt"
ENVIRONMENT = "venv"  # beside main.py: where engines/comfyui.py looks for its Python
_SCRATCH_PREFIX = ".source@"  # '@' is in no valid name, so a sweep finds only its own
# ComfyUI's source is a few thousand files; its archive tens of MB.
_MAX_MEMBERS = 50_000
_MAX_UNPACKED_BYTES = 2 * 2**30


def no_sha256(version: str, asset: str) -> InstallError:
    return InstallError(
        f"ComfyUI {version} is refused: GitHub publishes no digest for a tag's source "
        f"archive, so {asset} cannot be checked without one; pin its sha256 in server.yaml "
        f"under engines.comfyui.sha256 (\"{asset}\": <64 hex digits>)")


def day_after(archive: Path) -> str | None:
    """A day after the newest file date in a tar archive (GitHub sets every member's to the
    tagged commit's time), as an RFC 3339 time; None where the archive gives no dates."""
    try:
        with tarfile.open(archive) as tar:
            newest = max((m.mtime for m in tar), default=0)
    except tarfile.TarError:
        return None  # a zip: no dates to go by
    return requirements.day_after(newest)


async def install_comfyui(http: aiohttp.ClientSession, *, root: Path, version: str,
                          directory: str, url: str, sha256: str, index_url: str,
                          extra_index_urls: Sequence[str], exclude_newer: str,
                          python: str, import_check: str, status: Callable[[str], None],
                          min_free_bytes: int,
                          wheel_set: Mapping[str, str] | None = None) -> Path:
    """Install ComfyUI ``version`` from the source archive at ``url`` into
    ``root/comfyui/directory`` and return that directory (an install already there is
    returned as it is). ``index_url`` and ``extra_index_urls`` are where packages come from
    (the control plane's and the build's, never the requirements file's), unless
    ``wheel_set`` is given: a bundle's files beside the archive (file -> sha256, from its
    signed manifest: the wheels and their requirements.txt), which are installed instead
    and no index is read. Every failure raises InstallError in words for the operator and
    leaves nothing in place."""
    _, directory = checked_name_version(NAME, directory)
    label = URL(url).name or shown(url)
    if not sha256:
        raise no_sha256(version, label)
    digest = check_sha256(sha256)
    existing = installed_archive(root, NAME, directory)
    if existing is not None:
        return existing
    try:
        await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(sweep_scratch, root, f"{_SCRATCH_PREFIX}{NAME}@{directory}")
        work = root / f"{_SCRATCH_PREFIX}{NAME}@{directory}@{secrets.token_hex(4)}"
        await asyncio.to_thread(work.mkdir)
    except OSError as err:
        raise InstallError(f"installing ComfyUI {version}: cannot use {root}: "
                           f"{err.strerror}") from None
    target = root / NAME / directory
    try:
        archive, tree = work / "archive", work / "tree"
        await download(http, url, archive, sha256=digest, max_bytes=MAX_ARCHIVE_BYTES,
                       progress=DownloadMeter(label, status))
        status(f"unpacking {label}")
        await asyncio.to_thread(tree.mkdir)
        await asyncio.to_thread(unpack_archive, archive, tree, max_members=_MAX_MEMBERS,
                                max_bytes=_MAX_UNPACKED_BYTES)
        source = await asyncio.to_thread(_source_top, tree, label)
        cutoff = None
        if wheel_set is None:
            cutoff = exclude_newer or await asyncio.to_thread(day_after, archive)
            if not cutoff:
                raise InstallError(f"{label} gives no file dates to tell when ComfyUI "
                                   f"{version} was released; name the day after in "
                                   "server.yaml under engines.comfyui.exclude_newer")
        await asyncio.to_thread(archive.unlink)

        # Built as an engine of its own in the scratch directory, then moved beside main.py
        # (uv made it relocatable).
        if wheel_set is not None:
            # The bundle's wheel set, beside the archive (engines/comfyui/<version>/).
            environment = await build_from_bundle(
                http, base_url=url.rsplit("/", 1)[0], pins=wheel_set, root=work, name=NAME,
                version=directory, python=python, import_check=import_check,
                status=status, min_free_bytes=min_free_bytes, cache_dir=root / ".uv-cache")
        else:
            what = f"ComfyUI {version}'s {REQUIREMENTS}"
            text = await asyncio.to_thread(_read_requirements, source / REQUIREMENTS, what)
            wanted = check_source_requirements(text, what)
            status(f"resolving {len(wanted)} requirements of ComfyUI {version} as of "
                   f"{cutoff}")
            pinned = await compile_requirements(
                text, index_url=index_url, extra_index_urls=extra_index_urls,
                exclude_newer=cutoff, python=python, cache_dir=root / ".uv-cache", what=what)
            environment = await build_environment(
                root=work, name=NAME, version=directory, requirements=pinned,
                index_url=index_url, extra_index_urls=extra_index_urls, python=python,
                exclude_newer=cutoff, import_check=import_check, status=status,
                min_free_bytes=min_free_bytes, cache_dir=root / ".uv-cache")
        # The pinned list and what was installed stay in venv/ (pyenv's files).
        await asyncio.to_thread(os.rename, environment, source / ENVIRONMENT)

        marker = {"name": NAME, "version": version, "url": shown(url), "sha256": digest,
                  "binary": MAIN, "python": f"{ENVIRONMENT}/bin/python",
                  "index_url": BUNDLED if wheel_set is not None else index_url,
                  "extra_index_urls": [] if wheel_set is not None else list(extra_index_urls),
                  "exclude_newer": cutoff, "import_check": import_check,
                  "installed_at": datetime.now(UTC).isoformat(timespec="seconds")}
        await asyncio.to_thread((source / MARKER).write_text, json.dumps(marker, indent=1))
        await asyncio.to_thread(put_in_place, source, target, work / "old")
    except OSError as err:
        raise InstallError(f"installing ComfyUI {version} in {root}: "
                           f"{err.strerror or err}") from None
    finally:
        await asyncio.to_thread(shutil.rmtree, work, ignore_errors=True)
    status(f"installed ComfyUI {version}")
    return target


def _source_top(tree: Path, label: str) -> Path:
    """The directory of the tree holding main.py and requirements.txt: the archive's one
    top directory (``ComfyUI-0.3.60``) or the tree itself."""
    main = find_binary(tree, MAIN)
    top = main.parent
    if top not in (tree, *tree.iterdir()):
        raise InstallError(f"{label} has no {MAIN} at its top; it is not a ComfyUI release")
    if not (top / REQUIREMENTS).is_file() or (top / REQUIREMENTS).is_symlink():
        raise InstallError(f"{label} has no {REQUIREMENTS} beside {MAIN}")
    return top


def _read_requirements(path: Path, what: str) -> str:
    size = path.stat().st_size
    if size > requirements.MAX_SOURCE_REQUIREMENTS_BYTES:
        raise InstallError(f"{what} is {size_text(size)}; over "
                           f"{size_text(requirements.MAX_SOURCE_REQUIREMENTS_BYTES)} is no "
                           "requirements file")
    return path.read_text(errors="replace")
