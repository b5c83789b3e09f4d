"""The agent replacing its own llmgw (``llmgw ctl upgrade``), from the control plane's
mirror, and running whichever llmgw was installed last.

Installations live in the agent's state directory:

    <state_dir>/llmgw/versions/<version>/   a Python environment with llmgw and its wheels
    <state_dir>/llmgw/current               a link to the one the agent runs
    <state_dir>/llmgw/previous              a link to the one before, to go back to

An upgrade downloads the release's wheels that can suit this machine from the mirror,
each checked against the sha256 the control plane sent (from the bundle's signed
manifest), installs them into a new environment with ``uv pip install --no-index
--require-hashes`` (so nothing else can enter it), checks that the new llmgw imports and
reports the version asked for, and only then moves ``current``. The agent then replaces
its process with the new llmgw (``os.execv``: the same PID, so a service manager sees no
restart), which adopts the shards that kept running.

An agent started from elsewhere (a unit's ExecStart naming the llmgw first installed)
hands over to ``current`` at start, so that a restart or a reboot does not quietly go
back to the old release. A Nix-installed llmgw is the system's: it never replaces itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp
from uv import find_uv_bin

from llmgw import wire
from llmgw.agent.control_plane import ControlPlane, TlsFilesUnusable
from llmgw.agent.install import wheelset
from llmgw.agent.install.archives import free_bytes, put_in_place, sweep_scratch
from llmgw.agent.install.download import download
from llmgw.agent.install.ospkg import run_command
from llmgw.agent.install.pyenv import VENV_TIMEOUT_S, uv_failure
from llmgw.agent.install.pypi import InstallError
from llmgw.agent.weights.manifest import size_text
from llmgw.uvenv import uv_env

log = logging.getLogger(__name__)

FOLDER = "llmgw"
VERSIONS = "versions"
CURRENT = "current"
PREVIOUS = "previous"
_SCRATCH_PREFIX = ".upgrade"
# Set in the environment of an agent this module started, so that it never hands over
# again (a loop between two installations that each take the other for current).
HANDED_OVER = "LLMGW_AGENT_HANDED_OVER"
INSTALL_TIMEOUT_S = 900.0
CHECK_TIMEOUT_S = 120.0
# Room for the wheels, uv's unpacked copies and the environment, over the wheels' size.
_ROOM_FACTOR = 4
_VERSION = re.compile(r"[0-9][A-Za-z0-9.+!_-]{0,63}")


def installation() -> str:
    """wire.INSTALL_NIX when this llmgw runs from the Nix store, else INSTALL_PYTHON."""
    for path in (sys.prefix, sys.executable):
        if Path(path).resolve().is_relative_to("/nix/store"):
            return wire.INSTALL_NIX
    return wire.INSTALL_PYTHON


def root_of(state_dir: str | Path) -> Path:
    return Path(state_dir) / FOLDER


def _file(wheel: wire.UpgradeWheel) -> str:
    return wheel.url.rsplit("/", 1)[-1]


def suitable(wheels: Sequence[wire.UpgradeWheel]) -> list[wire.UpgradeWheel]:
    """The wheels that can install for this agent's own Python (install/wheelset.py)."""
    return [w for w in wheels if wheelset.suits(_file(w), sys.version_info[:2])]


def _link(root: Path, name: str, target: Path) -> None:
    """Point ``root/name`` at ``target`` (relative to root) in one rename."""
    temporary = root / f".{name}.{secrets.token_hex(4)}"
    os.symlink(os.path.relpath(target, root), temporary)
    os.replace(temporary, root / name)


def switch(root: Path, target: Path) -> None:
    """Make ``target`` current, the current one previous, and remove any older one but
    the one this process runs from (after a rollback, it may be neither)."""
    current = root / CURRENT
    before = current.resolve() if current.is_symlink() else None
    if before is not None and before != target.resolve() and before.is_dir():
        _link(root, PREVIOUS, before)
    _link(root, CURRENT, target)
    keep = {p.resolve() for p in (root / CURRENT, root / PREVIOUS) if p.is_symlink()}
    keep.add(Path(sys.prefix).resolve())
    for installed in (root / VERSIONS).iterdir():
        if installed.resolve() not in keep:
            shutil.rmtree(installed, ignore_errors=True)


def restart_argv(environment: Path) -> list[str]:
    """The command that runs this agent again from ``environment``: its interpreter, with
    this process's arguments (a console script or ``-m llmgw`` alike)."""
    return [str(environment / "bin" / "python"), "-m", "llmgw", *sys.argv[1:]]


def handover(state_dir: str | Path) -> list[str] | None:
    """The command to run instead of this process, when ``current`` names another
    installation than the running one (this agent was started from the llmgw first
    installed, and an upgrade has installed another since); else None."""
    if os.environ.get(HANDED_OVER):
        return None
    current = root_of(state_dir) / CURRENT
    if not current.is_symlink():
        return None
    target = current.resolve()
    if target == Path(sys.prefix).resolve():
        return None
    if not (target / "bin" / "python").exists():
        log.warning("%s names %s, which holds no Python environment; running this llmgw "
                    "(%s) instead", current, target, sys.prefix)
        return None
    return restart_argv(target)


def exec_into(argv: list[str]) -> None:
    """Replace this process with ``argv`` (never returns), marked as handed over."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execve(argv[0], argv, {**os.environ, HANDED_OVER: "1"})


class SelfUpgrade:
    """Installs llmgw releases into ``<state_dir>/llmgw``; one at a time."""

    def __init__(self, state_dir: str | Path):
        self.root = root_of(state_dir)

    async def install(self, message: wire.UpgradeAgent, plane: ControlPlane,
                      status: Callable[[str], None]) -> Path:
        """Install ``message.version`` from ``message.wheels`` and make it current;
        returns its environment. InstallError says what failed; nothing changes then."""
        version = message.version
        if not _VERSION.fullmatch(version):
            raise InstallError(f"version {version!r} is not a version")
        if installation() == wire.INSTALL_NIX:
            raise InstallError(f"this node's llmgw runs from the Nix store ({sys.prefix}): "
                               "the system owns it; upgrade it with nixos-rebuild")
        wheels = suitable(message.wheels)
        if not any(wheelset.distribution(_file(w)) == "llmgw" for w in wheels):
            raise InstallError(
                f"the control plane's bundle holds no llmgw {version} wheel for this node "
                f"(CPython {sys.version_info[0]}.{sys.version_info[1]}, "
                f"{sys.platform} {platform.machine()}): make the bundle with this "
                "platform's wheels (`llmgw bundle create --wheels`)")
        size = sum(w.size for w in wheels)
        await asyncio.to_thread(self.root.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(sweep_scratch, self.root, _SCRATCH_PREFIX)
        free = await asyncio.to_thread(free_bytes, self.root)
        if free < _ROOM_FACTOR * size:
            raise InstallError(f"llmgw {version} needs {size_text(_ROOM_FACTOR * size)} free "
                               f"in {self.root}; {size_text(free)} is")
        work = self.root / f"{_SCRATCH_PREFIX}@{version}@{secrets.token_hex(4)}"
        target = self.root / VERSIONS / version
        try:
            await self._build(work, message, wheels, plane, status)
            await asyncio.to_thread(put_in_place, work / "env", target,
                                    self.root / f"{work.name}.old")
            await asyncio.to_thread(switch, self.root, target)
        except OSError as err:
            raise InstallError(f"installing llmgw {version} in {self.root}: "
                               f"{err.strerror or err}") from None
        finally:
            await asyncio.to_thread(shutil.rmtree, work, ignore_errors=True)
            await asyncio.to_thread(shutil.rmtree, self.root / f"{work.name}.old",
                                    ignore_errors=True)
        return target

    async def _build(self, work: Path, message: wire.UpgradeAgent,
                     wheels: list[wire.UpgradeWheel], plane: ControlPlane,
                     status: Callable[[str], None]) -> None:
        version = message.version
        downloads = work / "wheels"
        await asyncio.to_thread(downloads.mkdir, parents=True)
        status(f"downloading {len(wheels)} wheels "
               f"({size_text(sum(w.size for w in wheels))}) from the control plane")
        files = []
        try:
            context = plane.ssl_context()
        except TlsFilesUnusable as err:
            raise InstallError(str(err)) from None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
        async with aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(ssl=context)) as http:
            for wheel in wheels:
                # One plain file name: the URL's last element, matched as a wheel's above.
                name = _file(wheel)
                await download(http, plane.resolve(wheel.url), downloads / name,
                               sha256=wheel.sha256, max_bytes=wheel.size)
                files.append((name, wheel.sha256))
        await asyncio.to_thread((work / "requirements.txt").write_text,
                                wheelset.requirements(files))

        env = uv_env(work / "uv-cache")
        uv = find_uv_bin()
        environment = work / "env"
        status(f"creating the Python environment for llmgw {version}")
        result = await run_command(
            [uv, "venv", "--no-config", "--relocatable", "--python", sys.executable,
             str(environment)], env=env, timeout_s=VENV_TIMEOUT_S)
        if result.returncode != 0:
            raise uv_failure("creating the Python environment", result)
        status(f"installing llmgw {version} and its dependencies")
        result = await run_command(
            [uv, "pip", "install", "--no-config", "--python", str(environment / "bin/python"),
             "--no-index", "--find-links", str(downloads), "--require-hashes",
             "-r", str(work / "requirements.txt")], env=env, timeout_s=INSTALL_TIMEOUT_S)
        if result.returncode != 0:
            raise uv_failure(f"installing llmgw {version}", result)
        status(f"checking that llmgw {version} runs")
        check_env = {k: v for k, v in env.items() if not k.startswith("UV_")}
        check_env.pop(HANDED_OVER, None)
        result = await run_command(
            [str(environment / "bin/python"), "-c",
             "import llmgw, llmgw.agent.run, llmgw.cli.main; print(llmgw.__version__)"],
            env=check_env, timeout_s=CHECK_TIMEOUT_S, cwd=work)
        said = result.tail_text(8)
        if result.returncode != 0:
            raise InstallError(f"llmgw {version} was installed but does not import "
                               f"(exit {result.returncode}): {said}")
        if result.tail[-1:] != [version]:
            raise InstallError(f"the wheels installed llmgw {said or 'of no version'}, not "
                               f"{version}: the bundle's manifest and its wheels disagree")


def rollback(state_dir: str | Path) -> tuple[str, str]:
    """Go back to the installation before the current one: (the version left, the one
    gone back to; "" for the llmgw the agent is started with, when the first upgrade
    made the current one). The running agent is not touched: it takes effect at its next
    start. InstallError when there is nothing to go back from."""
    root = root_of(state_dir)
    current, previous = root / CURRENT, root / PREVIOUS
    if not current.is_symlink():
        raise InstallError(f"{current} does not exist: this node's llmgw was never upgraded "
                           "by `llmgw ctl upgrade`; there is nothing to go back from")
    left = current.resolve()
    if previous.is_symlink() and previous.resolve().is_dir():
        back = previous.resolve()
        _link(root, CURRENT, back)
        _link(root, PREVIOUS, left)
        return left.name, back.name
    current.unlink()
    return left.name, ""
