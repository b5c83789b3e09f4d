"""OS packages an engine build needs (libgomp, the Vulkan loader, gcc), installed with the
machine's own package manager.

The manager is chosen from /etc/os-release's ID and ID_LIKE, the family a distribution
says it belongs to, never from a list of distribution names: Rocky, Mint or a distribution
born next year is handled by its family. Package names differ per family (libgomp1 on
Debian's, libgomp on Red Hat's). Every command runs non-interactively and in the C locale,
so that its messages can be read here.

On a fresh machine the package manager's lock is often held for minutes (cloud-init,
unattended-upgrades). A command that fails only because of that lock is not a failure: it
is retried until ``lock_wait_s`` has passed, and reported as "waiting for another apt-get
to finish". apt's own DPkg::Lock::Timeout is no help here: it covers dpkg's lock, not the
one ``apt-get update`` takes on its lists. Retrying a pass that did fail is the caller's
business (``llmgw.core.backoff``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from llmgw.agent.install.pypi import InstallError

# The words of ID and ID_LIKE that name a family we know how to install packages for.
_FAMILY_OF_WORD = {
    "debian": "debian", "ubuntu": "debian",
    "rhel": "rhel", "fedora": "rhel", "centos": "rhel",
    "suse": "suse", "opensuse": "suse",
}
_FAMILY_NAMES = {"debian": "Debian", "rhel": "Red Hat", "suse": "SUSE"}

# What each need is, for people, where no package name can be given.
NEEDS = {
    "gomp": "the GNU OpenMP runtime (libgomp)",
    "vulkan": "the Vulkan loader (libvulkan)",
    "gcc": "a C compiler (gcc)",
}

PACKAGES: dict[str, dict[str, list[str]]] = {
    "gomp": {"debian": ["libgomp1"], "rhel": ["libgomp"], "suse": ["libgomp1"]},
    "vulkan": {"debian": ["libvulkan1"], "rhel": ["vulkan-loader"], "suse": ["libvulkan1"]},
    # Triton compiles its launcher with gcc at the first model load.
    "gcc": {"debian": ["gcc"], "rhel": ["gcc"], "suse": ["gcc"]},
}


@dataclass(frozen=True, slots=True)
class PackageManager:
    tool: str  # "apt-get", "dnf", "yum" or "zypper"; also the word in status lines
    family: str  # "debian", "rhel" or "suse": the names PACKAGES gives
    path: str  # the executable that installs
    query_path: str  # dpkg-query or rpm: says what is installed, and changes nothing


def family(os_release: Mapping[str, str]) -> str | None:
    """The package family from ID, then ID_LIKE in the order the file gives."""
    words = [os_release.get("ID", ""), *os_release.get("ID_LIKE", "").split()]
    for word in words:
        found = _FAMILY_OF_WORD.get(word.strip().lower())
        if found:
            return found
    return None


def _tools(family_name: str) -> list[tuple[str, str]]:
    """(installer, query) pairs for a family, preferred first."""
    if family_name == "debian":
        return [("apt-get", "dpkg-query")]
    if family_name == "rhel":
        return [("dnf", "rpm"), ("yum", "rpm")]
    return [("zypper", "rpm")]


def package_manager(os_release: Mapping[str, str], *,
                    search_path: str | None = None) -> PackageManager | None:
    """The machine's package manager, or None when its family is not one llmgw knows or
    the family's tools are not installed. ``search_path`` is a PATH to look in (the
    process's own by default)."""
    found = family(os_release)
    if found is None:
        return None
    for tool, query in _tools(found):
        tool_path = shutil.which(tool, path=search_path)
        query_path = shutil.which(query, path=search_path)
        if tool_path and query_path:
            return PackageManager(tool, found, tool_path, query_path)
    return None


def unsupported(os_release: Mapping[str, str], needs: Sequence[str]) -> str:
    """Why ``package_manager`` gave None, and what the operator can do instead."""
    what = " and ".join(NEEDS.get(n, n) for n in needs) or "what the engine needs"
    name = os_release.get("PRETTY_NAME") or os_release.get("ID") or "this machine's OS"
    found = family(os_release)
    if found is None:
        like = os_release.get("ID_LIKE", "")
        return (f"{name} (ID={os_release.get('ID', '')!r}, ID_LIKE={like!r}) is not of a "
                "family llmgw installs packages for (Debian, Red Hat, SUSE): install "
                f"{what} with its own package manager")
    tools = " or ".join(f"{t} with {q}" for t, q in _tools(found))
    return (f"{name} is of the {_FAMILY_NAMES[found]} family but {tools} is not on PATH: "
            f"install {what} by hand")


def package_names(family_name: str, needs: Sequence[str]) -> list[str]:
    names: list[str] = []
    for need in needs:
        per_family = PACKAGES.get(need)
        if per_family is None:
            raise InstallError(f"unknown OS package need {need!r}; known: "
                               + ", ".join(sorted(PACKAGES)))
        names += [n for n in per_family[family_name] if n not in names]
    return names


# --- running a command -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CommandResult:
    returncode: int
    tail: list[str]  # the last lines of stdout and stderr together

    def tail_text(self, lines: int = 12) -> str:
        return "\n".join(self.tail[-lines:])


Runner = Callable[..., Awaitable[CommandResult]]


async def run_command(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                      timeout_s: float, on_line: Callable[[str], None] | None = None,
                      keep_lines: int = 40, cwd: str | os.PathLike[str] | None = None,
                      ) -> CommandResult:
    """Run ``argv`` in its own session, stdout and stderr merged and read line by line;
    the process group is killed when ``timeout_s`` passes (InstallError) or the caller is
    cancelled."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=dict(env) if env is not None else None,
            cwd=cwd, start_new_session=True)
    except OSError as err:
        raise InstallError(f"cannot run {argv[0]}: {err.strerror}") from None
    tail: list[str] = []

    async def read() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            tail.append(line)
            del tail[:-keep_lines]
            if on_line:
                on_line(line)
        await proc.wait()

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        command = " ".join([os.path.basename(argv[0]), *argv[1:2]])
        raise InstallError(f"{command} did not finish in {timeout_s:.0f} s; it said:\n"
                           + "\n".join(tail[-12:])) from None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert proc.returncode is not None
    return CommandResult(proc.returncode, tail)


# --- what each tool says -----------------------------------------------------------------

# A lock someone else holds (not one we may not take: "Permission denied", "are you root?").
_HELD = {
    "apt-get": ("Could not get lock",),
    "dnf": ("Failed to obtain rpm transaction lock", "Waiting for process with pid"),
    "yum": ("Existing lock ", "Another app is currently holding the yum lock"),
    "zypper": ("System management is locked by the application with pid",),
}
# apt's other lines about the same held lock.
_APT_LOCK_LINES = ("Could not get lock", "Unable to lock directory",
                   "Unable to acquire the dpkg frontend lock",
                   "Unable to lock the administration directory")
_NOT_ROOT = ("Permission denied", "are you root", "root privileges")
_NOT_FOUND = {
    "apt-get": ("Unable to locate package", "has no installation candidate"),
    "dnf": ("No match for argument", "Unable to find a match"),
    "yum": ("No package ",),
    "zypper": ("No provider of", "not found in package names"),
}


def held_lock(tool: str, lines: Sequence[str]) -> bool:
    """Whether a failed command's output says it failed only because another process held
    the package manager's lock."""
    if any(m in line for line in lines for m in _NOT_ROOT):
        return False
    if not any(m in line for line in lines for m in _HELD.get(tool, ())):
        return False
    if tool == "apt-get":
        errors = [line for line in lines if line.startswith("E:")]
        return all(any(m in line for m in _APT_LOCK_LINES) for line in errors)
    return True


def _lock_chatter(line: str) -> bool:
    """A line a command prints while failing on a lock, not a sign of it working."""
    return line.startswith(("E:", "N:", "W:")) or any(
        m in line for m in (*_APT_LOCK_LINES, *(m for ms in _HELD.values() for m in ms)))


def _not_found(tool: str, lines: Sequence[str]) -> bool:
    return any(m in line for line in lines for m in _NOT_FOUND.get(tool, ()))


def _install_argv(m: PackageManager, names: Sequence[str]) -> list[str]:
    if m.tool == "apt-get":
        return [m.path, "install", "-y", "-q", "--no-install-recommends",
                "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold",
                *names]
    if m.tool == "dnf":
        return [m.path, "install", "-y", "-q", "--setopt=install_weak_deps=False", *names]
    if m.tool == "yum":  # exit_on_lock: fail at once on a held lock, and say so, not wait mute
        return [m.path, "install", "-y", "-q", "--setopt=exit_on_lock=True", *names]
    return [m.path, "--non-interactive", "--quiet", "install", "--no-recommends", *names]


def _refresh_argv(m: PackageManager) -> list[str]:
    if m.tool == "apt-get":
        return [m.path, "update", "-q"]
    if m.tool == "yum":
        return [m.path, "makecache", "-q", "--setopt=exit_on_lock=True"]
    if m.tool == "dnf":
        return [m.path, "makecache", "-q"]
    return [m.path, "--non-interactive", "refresh"]


def _query_argv(m: PackageManager, names: Sequence[str]) -> list[str]:
    if m.query_path.endswith("dpkg-query"):
        return [m.query_path, "-W", "-f", "${Package}\t${db:Status-Status}\n", *names]
    return [m.query_path, "-q", "--qf", "%{NAME}\n", *names]


def _installed(m: PackageManager, names: Sequence[str], lines: Sequence[str]) -> set[str]:
    if m.query_path.endswith("dpkg-query"):
        pairs = (line.split("\t", 1) for line in lines if "\t" in line)
        return {name for name, state in pairs if state.strip() == "installed"}
    return {line.strip() for line in lines} & set(names)


# --- installing --------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C",
            "LANG": "C", "LANGUAGE": "C",
            # Ubuntu's needrestart would otherwise restart services (or ask) after the install.
            "NEEDRESTART_SUSPEND": "1"}


async def missing_packages(manager: PackageManager, names: Sequence[str], *,
                           run: Runner = run_command) -> list[str]:
    """Which of ``names`` are not installed (read-only; no lock is taken)."""
    result = await run(_query_argv(manager, names), env=_env(), timeout_s=60)
    have = _installed(manager, names, result.tail)
    return [n for n in names if n not in have]


async def ensure_packages(manager: PackageManager, needs: list[str], *,
                          status: Callable[[str], None], lock_wait_s: float = 600,
                          run: Runner = run_command, lock_poll_s: float = 5.0,
                          command_timeout_s: float = 1800) -> None:
    """Install the packages ``needs`` calls for that are missing. A held lock is waited for
    (reported through ``status``) up to ``lock_wait_s``; any other failure raises
    InstallError ending with the command's last lines."""
    names = package_names(manager.family, needs)
    missing = await missing_packages(manager, names, run=run)
    if not missing:
        return
    tool = manager.tool
    doing = f"installing {' '.join(missing)} with {tool}"
    waiting = f"waiting for another {tool} to finish"
    shown = ""

    def say(text: str) -> None:
        nonlocal shown
        if text != shown:
            shown = text
            status(text)

    async def attempt(argv: list[str], what: str) -> CommandResult:
        waiting_since: float | None = None

        def on_line(line: str) -> None:
            if any(m in line for m in _HELD.get(tool, ())):
                say(waiting)  # dnf and zypper may wait for a lock themselves
            elif waiting_since is not None and not _lock_chatter(line):
                say(what)  # the lock is free again and the real work has begun

        say(what)
        while True:
            result = await run(argv, env=_env(), timeout_s=command_timeout_s,
                               on_line=on_line)
            if result.returncode == 0 or not held_lock(tool, result.tail):
                return result
            now = time.monotonic()
            if waiting_since is None:
                waiting_since = now
            elif now - waiting_since >= lock_wait_s:
                raise InstallError(
                    f"{what}: another {tool} held the package lock for more than "
                    f"{_duration(lock_wait_s)}; it said:\n{result.tail_text()}")
            say(waiting)
            await asyncio.sleep(min(lock_poll_s, max(0.0, waiting_since + lock_wait_s - now)))

    result = await attempt(_install_argv(manager, missing), doing)
    if result.returncode != 0 and _not_found(tool, result.tail):
        # Lists that are old or were never fetched (a fresh image): refresh them once.
        refreshed = await attempt(_refresh_argv(manager), f"updating {tool}'s package lists")
        if refreshed.returncode != 0:
            raise InstallError(f"updating {tool}'s package lists failed "
                               f"(exit {refreshed.returncode}); it said:\n"
                               + refreshed.tail_text())
        result = await attempt(_install_argv(manager, missing), doing)
    if result.returncode != 0:
        raise InstallError(f"{doing} failed (exit {result.returncode}); it said:\n"
                           + result.tail_text())
    still = await missing_packages(manager, missing, run=run)
    if still:
        raise InstallError(f"{tool} finished, yet {' '.join(still)} is still not installed")


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"
