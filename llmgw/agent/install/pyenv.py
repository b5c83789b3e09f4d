"""Python engines (vLLM, SGLang, ComfyUI's dependencies): a uv-built environment from
pinned, hashed requirements, proved to import before it is used.

``<root>/<name>/<version>`` exists only once every package matched the sha256 the
requirements give (``--require-hashes``), the resolved list was kept beside it
(``llmgw-resolved.txt``) and the engine's import check ran with the environment's own
Python. Until then it is a dotted scratch directory under ``root``, removed whatever the
outcome. The environment is made relocatable (``uv venv --relocatable``) because it is
renamed into place after it is built.

The requirements text may name PyPI packages and nothing else: a URL, a path, a VCS
reference, an editable install or an index option is refused before uv runs, so the only
code installed is what the index llmgw chose serves under the hashes it pinned. uv itself
reads no configuration file and no ``UV_*``/``PIP_*`` variable of the agent's environment.
"""

from __future__ import annotations

import asyncio
import json
import platform
import re
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from uv import find_uv_bin

from llmgw.agent.install import wheelset
from llmgw.agent.install.archives import (
    MARKER,
    checked_name_version,
    installed_archive,
    make_room,
    put_in_place,
    sweep_scratch,
)
from llmgw.agent.install.download import download
from llmgw.agent.install.ospkg import CommandResult, run_command
from llmgw.agent.install.pypi import InstallError
from llmgw.core import requirements as core_requirements
from llmgw.core.requirements import RequirementsError
from llmgw.core.wheels import MAX_WHEEL_BYTES
from llmgw.uvenv import UvFailed, run_uv, uv_env

REQUIREMENTS = "llmgw-requirements.txt"  # the text it was built from, hashes and all
RESOLVED = "llmgw-resolved.txt"  # what is installed, as `uv pip freeze` lists it
BUNDLED = "the control plane's bundle"  # the marker's index_url for a bundle's wheels
# A bundle's wheel set: its requirements (--require-hashes lines), beside its wheels.
BUNDLE_REQUIREMENTS = "requirements.txt"
_WHEELS_PREFIX = ".wheels@"
_SCRATCH_PREFIX = ".pyenv@"  # '@' is in no valid name, so a sweep finds only its own
VENV_TIMEOUT_S = 300.0
INSTALL_TIMEOUT_S = 3600.0  # vLLM is several GB of wheels
IMPORT_TIMEOUT_S = 600.0  # importing torch and touching the GPU the first time is slow


# An environment is marked like an archive install, and found the same way.
installed_environment = installed_archive


# --- the requirements text ---------------------------------------------------------------


def check_requirements(text: str) -> list[str]:
    """The packages (``name==version``) of a pinned, hashed requirements text; InstallError
    naming the first line that is anything else (core.requirements)."""
    try:
        return core_requirements.check_requirements(text)
    except RequirementsError as err:
        raise InstallError(str(err)) from None


def check_source_requirements(text: str, what: str) -> list[str]:
    """The requirements of a source tree (``numpy>=1.25.0``, ``torch``); InstallError naming
    the first line that is anything but a package from the index (core.requirements)."""
    try:
        return core_requirements.check_source_requirements(text, what)
    except RequirementsError as err:
        raise InstallError(str(err)) from None


# --- building ----------------------------------------------------------------------------


def _hash_mismatch(lines: Sequence[str]) -> str | None:
    """uv's "Hash mismatch" report in one sentence."""
    found = next((m for m in (re.search(r"Hash mismatch for `([^`]+)`", line)
                              for line in lines) if m), None)
    if found is None:
        return None
    expected: list[str] = []
    computed: list[str] = []
    into: list[str] | None = None
    for line in lines:
        word = line.strip()
        if word == "Expected:":
            into = expected
        elif word == "Computed:":
            into = computed
        elif into is not None and word.startswith(("sha256:", "sha384:", "sha512:")):
            into.append(word)
    return (f"{found[1]}: the file the index served has {' or '.join(computed) or '?'}, not "
            f"{' or '.join(expected) or '?'} as the requirements pin; it was changed after "
            "the hashes were taken (on the index or on the way), and nothing was installed")


def uv_failure(what: str, result: CommandResult) -> InstallError:
    readable = _hash_mismatch(result.tail)
    if readable:
        return InstallError(readable)
    # uv's own report starts at "error:"; what comes before is progress.
    lines = list(result.tail)
    start = next((i for i, line in enumerate(lines) if line.startswith("error:")), None)
    said = "\n".join(lines[start:] if start is not None else lines[-12:]).strip()
    return InstallError(f"{what} failed (exit {result.returncode}): {said}")


def _python_option(python: str) -> list[str]:
    """uv's way to name the Python to resolve for: a version ("3.12") or an interpreter."""
    return ["--python-version" if re.fullmatch(r"\d+(\.\d+)*", python) else "--python",
            python]


async def compile_requirements(requirements: str, *, index_url: str,
                               extra_index_urls: Sequence[str] = (),
                               exclude_newer: str | None, python: str,
                               cache_dir: Path, what: str = "the requirements") -> str:
    """``requirements`` (packages from the index, any specifiers) resolved as the indexes
    stood at ``exclude_newer``, pinned with the sha256 of every file (``uv pip compile
    --generate-hashes``): the text ``build_environment`` takes. The indexes are the
    caller's (trusted configuration), never the requirements' own."""
    args = ["pip", "compile", "-", "--no-config", "--generate-hashes", "--no-header",
            "--no-annotate", *_python_option(python), "--index-url", index_url]
    for extra in extra_index_urls:
        args += ["--extra-index-url", extra]
    if exclude_newer:
        args += ["--exclude-newer", exclude_newer]
    try:
        return await run_uv(args, cache=cache_dir, timeout_s=VENV_TIMEOUT_S,
                            stdin=requirements)
    except UvFailed as err:
        if err.timed_out:
            raise InstallError(f"resolving {what} took over {VENV_TIMEOUT_S:.0f} s; "
                               f"is {index_url} reachable?") from None
        raise InstallError(f"resolving {what} failed: {err}") from None


async def build_environment(*, root: Path, name: str, version: str, requirements: str,
                            index_url: str, python: str, exclude_newer: str | None,
                            import_check: str, status: Callable[[str], None],
                            min_free_bytes: int, extra_index_urls: Sequence[str] = (),
                            cache_dir: Path | None = None,
                            find_links: Path | None = None) -> Path:
    """Build the environment ``name`` ``version`` into ``root/name/version`` and return it;
    an environment already built there is returned as it is. ``requirements`` is pinned
    and hashed (``uv pip compile --generate-hashes``); ``index_url`` (and
    ``extra_index_urls``, e.g. PyTorch's for a CUDA build of torch) is where packages come
    from, as the index stood at ``exclude_newer``; ``import_check`` is Python code run with
    the environment's interpreter (it may compute on the GPU). uv's cache is
    ``cache_dir``, by default ``root/.uv-cache`` (same filesystem: uv hard-links from it).
    With ``find_links`` (a folder of wheels: a bundle's, from the control plane's mirror)
    no index is read at all: the packages are those files, under the same hashes.
    Every failure raises InstallError in words for the operator, and leaves nothing in
    place."""
    name, version = checked_name_version(name, version)
    packages = check_requirements(requirements)
    existing = installed_environment(root, name, version)
    if existing is not None:
        return existing
    await make_room(root, name, version, min_free_bytes)
    cache = cache_dir or root / ".uv-cache"
    env = uv_env(cache)
    uv = find_uv_bin()
    await asyncio.to_thread(sweep_scratch, root, f"{_SCRATCH_PREFIX}{name}@{version}")
    work = root / f"{_SCRATCH_PREFIX}{name}@{version}@{secrets.token_hex(4)}"
    scratch_python = str(work / "bin" / "python")
    target = root / name / version
    try:
        status(f"creating a Python {python} environment for {name} {version}")
        result = await run_command(
            [uv, "venv", "--no-config", "--relocatable", "--python", python, str(work)],
            env=env, timeout_s=VENV_TIMEOUT_S)
        if result.returncode != 0:
            raise uv_failure(f"creating the Python {python} environment", result)
        await asyncio.to_thread((work / REQUIREMENTS).write_text, requirements)

        status(f"installing {len(packages)} packages for {name} {version}")
        argv = [uv, "pip", "install", "--no-config", "--python", scratch_python,
                "--require-hashes"]
        if find_links is not None:
            argv += ["--no-index", "--find-links", str(find_links)]
        else:
            argv += ["--index-url", index_url]
            for extra in extra_index_urls:
                argv += ["--extra-index-url", extra]
            if exclude_newer:
                argv += ["--exclude-newer", exclude_newer]
        result = await run_command([*argv, "-r", str(work / REQUIREMENTS)], env=env,
                                   timeout_s=INSTALL_TIMEOUT_S)
        if result.returncode != 0:
            raise uv_failure(f"installing {name} {version}'s packages", result)
        result = await run_command(
            [uv, "pip", "freeze", "--no-config", "--python", scratch_python], env=env,
            timeout_s=VENV_TIMEOUT_S, keep_lines=100_000)
        if result.returncode != 0:
            raise uv_failure(f"listing {name} {version}'s packages", result)
        resolved = [line for line in result.tail if "==" in line]
        await asyncio.to_thread((work / RESOLVED).write_text, "\n".join(resolved) + "\n")

        status(f"checking that {name} {version} imports")
        check_env = {k: v for k, v in env.items() if not k.startswith("UV_")}
        # Run from the root, so nothing beside the working directory shadows a package.
        result = await run_command([scratch_python, "-c", import_check], env=check_env,
                                   timeout_s=IMPORT_TIMEOUT_S, cwd=root)
        if result.returncode != 0:
            raise InstallError(f"{name} {version} was installed but does not import "
                               f"(exit {result.returncode}): {result.tail_text(8)}")

        marker = {"name": name, "version": version, "python": python,
                  "index_url": index_url if find_links is None else BUNDLED,
                  "extra_index_urls": list(extra_index_urls),
                  "exclude_newer": exclude_newer, "packages": len(resolved),
                  "hashes": "every package matched its --hash", "import_check": import_check,
                  "installed_at": datetime.now(UTC).isoformat(timespec="seconds")}
        await asyncio.to_thread((work / MARKER).write_text, json.dumps(marker, indent=1))
        await asyncio.to_thread(put_in_place, work, target, root / f"{work.name}.old")
    except OSError as err:
        raise InstallError(f"installing {name} {version} in {root}: "
                           f"{err.strerror or err}") from None
    finally:
        await asyncio.to_thread(shutil.rmtree, work, ignore_errors=True)
        await asyncio.to_thread(shutil.rmtree, root / f"{work.name}.old", ignore_errors=True)
    status(f"installed {name} {version}")
    return target






async def build_from_bundle(session: aiohttp.ClientSession, *, base_url: str,
                            pins: Mapping[str, str], root: Path, name: str, version: str,
                            python: str, import_check: str, status: Callable[[str], None],
                            min_free_bytes: int, cache_dir: Path | None = None) -> Path:
    """Build the environment from a bundle's wheel set on the control plane's mirror:
    ``pins`` maps each file at ``base_url`` to its sha256 (from the bundle's signed
    manifest, sent by the control plane), the wheels and their ``requirements.txt``; any
    other file pinned there (ComfyUI's source archive) is left alone. Only the wheels
    that can suit ``python`` here are fetched, each checked against its pin, and installed
    with no index (``build_environment`` with ``find_links``)."""
    name, version = checked_name_version(name, version)
    existing = installed_environment(root, name, version)
    if existing is not None:
        return existing
    if BUNDLE_REQUIREMENTS not in pins:
        raise InstallError(f"the control plane's bundle holds {name} {version} without its "
                           f"{BUNDLE_REQUIREMENTS}: make the bundle again with this llmgw's "
                           "`llmgw bundle create --engine`")
    target = wheelset.python_of(python)
    wheels = sorted(f for f in pins if wheelset.suits(f, target))
    if not wheels:
        held = sorted(f for f in pins if f.endswith(".whl"))
        raise InstallError(
            f"the control plane's bundle holds no wheel of {name} {version} for "
            f"{'CPython ' + python if target else python} on {platform.machine()} (it holds "
            f"{', '.join(held[:3]) or 'none'}{' and more' if len(held) > 3 else ''}): make "
            "the bundle with --python and --python-platform for this node")
    await make_room(root, name, version, min_free_bytes)
    folder = root / f"{_WHEELS_PREFIX}{name}@{version}@{secrets.token_hex(4)}"
    try:
        await asyncio.to_thread(sweep_scratch, root, f"{_WHEELS_PREFIX}{name}@{version}")
        await asyncio.to_thread(folder.mkdir, parents=True)
        status(f"downloading {len(wheels)} wheels of {name} {version} from the control plane")
        for file in [BUNDLE_REQUIREMENTS, *wheels]:
            await download(session, f"{base_url}/{file}", folder / file, sha256=pins[file],
                           max_bytes=MAX_WHEEL_BYTES)
        requirements = await asyncio.to_thread((folder / BUNDLE_REQUIREMENTS).read_text)
        return await build_environment(
            root=root, name=name, version=version, requirements=requirements, index_url="",
            python=python, exclude_newer=None, import_check=import_check, status=status,
            min_free_bytes=min_free_bytes, cache_dir=cache_dir, find_links=folder)
    except OSError as err:
        raise InstallError(f"installing {name} {version} in {root}: "
                           f"{err.strerror or err}") from None
    finally:
        await asyncio.to_thread(shutil.rmtree, folder, ignore_errors=True)
