"""A real, throwaway systemd *user* manager for tests: the bus the systemd runtime talks to.

The test machines boot without systemd, yet shards run as systemd transient units. A
systemd user manager can run here, confined to a cgroup of its own, and answers the same
``org.freedesktop.systemd1.Manager`` calls as the system manager on a real node.

SAFETY. A systemd manager takes over the cgroup it starts in; started at the cgroup root
it would move every process of the machine (everyone else's too) into its own scope. So
the manager is started only this way, and every one of these checks is kept:

1. it runs in a private mount namespace (``unshare --mount --propagation private``), and
   refuses to start unless its mount namespace differs from PID 1's;
2. in that namespace the cgroup2 tree is bind-mounted over ``/sys/fs/cgroup`` (where that
   is not already cgroup2), so systemd never sees the v1 hierarchies; it refuses to start
   unless ``/sys/fs/cgroup`` is then cgroup2;
3. it moves itself into a fresh child cgroup first and refuses to start unless
   ``/proc/self/cgroup`` shows exactly that child (``0::/<name>``).

Stopping is by the manager's PID (SIGTERM: it stops its units and exits), then SIGKILL
of every PID left in its cgroup tree, then ``rmdir`` of that tree depth-first. Nothing
is ever signalled by name.

Use it as ``with user_manager() as manager: ... manager.address ...``, or through the
``systemd_manager`` fixture (one manager per test session): load this module as a plugin
with ``pytest_plugins = ["tests.systemd_manager"]``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SYSTEMD = "/lib/systemd/systemd"
START_DEADLINE_S = 10.0
TERM_DEADLINE_S = 5.0
KILL_DEADLINE_S = 5.0

_PR_SET_PDEATHSIG = 1

_NAME_RE = re.compile(r"llmgw-test-[a-z0-9-]{1,64}")

# Run by bash in the new mount namespace, as the process that becomes the manager.
# Arguments: $1 the cgroup2 mount, $2 the cgroup name, $3 the runtime directory.
_INNER = r"""
set -e
V2=$1 NAME=$2 RT=$3
[ "$(readlink /proc/self/ns/mnt)" != "$(readlink /proc/1/ns/mnt)" ] \
    || { echo "refusing: not in a private mount namespace" >&2; exit 5; }
echo $$ > "$V2/$NAME/cgroup.procs"
[ "$V2" = /sys/fs/cgroup ] || mount --bind "$V2" /sys/fs/cgroup
[ "$(stat -f -c %T /sys/fs/cgroup)" = cgroup2fs ] \
    || { echo "refusing: /sys/fs/cgroup is not cgroup2 here" >&2; exit 3; }
grep -qx "0::/$NAME" /proc/self/cgroup \
    || { echo "refusing: in cgroup $(grep ^0:: /proc/self/cgroup), not /$NAME" >&2; exit 4; }
mount -t tmpfs tmpfs /run/systemd
mkdir /run/systemd/system      # sd_booted() is true, in this namespace only
export XDG_RUNTIME_DIR=$RT
exec "$4" --user
"""


class ManagerUnavailable(Exception):
    """No systemd manager can be started on this machine; the message says why."""


@dataclass(frozen=True)
class Manager:
    pid: int
    name: str  # the cgroup's name, directly under the cgroup2 root
    cgroup: Path  # that cgroup's directory in the cgroup2 mount
    runtime_dir: Path

    @property
    def address(self) -> str:
        """The manager's own peer-to-peer socket (no bus daemon, no ``Hello`` needed)."""
        return f"unix:path={self.runtime_dir}/systemd/private"


def cgroup2_mount() -> Path | None:
    """Where the cgroup2 hierarchy is mounted: /sys/fs/cgroup on a pure-v2 host, its
    ``unified`` directory on a hybrid one; None without cgroup2."""
    for path in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if _fs_type(path) == "cgroup2fs":
            return path
    return None


def _fs_type(path: Path) -> str:
    try:
        out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def unavailable() -> str | None:
    """Why a manager cannot be started here, or None when it can."""
    if os.geteuid() != 0:
        return "starting a systemd manager in its own cgroup needs root"
    if not os.access(SYSTEMD, os.X_OK):
        return f"systemd is not installed ({SYSTEMD} is missing)"
    for tool in ("unshare", "mount", "bash", "stat"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if cgroup2_mount() is None:
        return "no cgroup2 hierarchy is mounted at /sys/fs/cgroup or /sys/fs/cgroup/unified"
    if not Path("/run/systemd").is_dir():
        return "/run/systemd does not exist"
    return None


def _own_cgroup(pid: int | str = "self") -> str:
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""
    return next((line[3:] for line in text.splitlines() if line.startswith("0::")), "")


@contextlib.contextmanager
def user_manager(name: str | None = None) -> Iterator[Manager]:
    """Start a systemd user manager confined to a fresh cgroup; stop it and remove every
    trace of it on the way out, whatever happened in between."""
    why = unavailable()
    if why is not None:
        raise ManagerUnavailable(why)
    name = name or f"llmgw-test-{os.getpid()}-{secrets.token_hex(3)}"
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"cgroup name {name!r} must match {_NAME_RE.pattern}")
    v2 = cgroup2_mount()
    assert v2 is not None
    cgroup = v2 / name
    ours_before, pid1_before = _own_cgroup(), _own_cgroup(1)
    _sweep_stale(v2)
    runtime_dir = Path(tempfile.gettempdir()) / name
    log_path = runtime_dir.with_name(runtime_dir.name + ".log")
    runtime_dir.mkdir(mode=0o700)  # never an existing one: the name is fresh
    cgroup.mkdir()
    proc: subprocess.Popen | None = None
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private",
                 "bash", "-c", _INNER, "inner", str(v2), name, str(runtime_dir), SYSTEMD],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "LANG": "C.UTF-8"},
                preexec_fn=_term_when_parent_dies,
            )
        socket = runtime_dir / "systemd" / "private"
        deadline = time.monotonic() + START_DEADLINE_S
        while not socket.is_socket():
            if proc.poll() is not None:
                raise RuntimeError(f"the systemd manager exited with {proc.returncode} before "
                                   f"its bus was up: {_read(log_path)!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the systemd manager's bus was not up within "
                                   f"{START_DEADLINE_S:g} s: {_read(log_path)!r}")
            time.sleep(0.02)
        # The manager stayed where it was put, and nobody else moved.
        manager_cgroup = _own_cgroup(proc.pid)
        if not manager_cgroup.startswith(f"/{name}/"):
            raise RuntimeError(f"the manager runs in cgroup {manager_cgroup!r}, not under "
                               f"/{name}")
        if (_own_cgroup(), _own_cgroup(1)) != (ours_before, pid1_before):
            raise RuntimeError("starting the manager changed the cgroup of PID 1 or of the "
                               "test process")
        yield Manager(pid=proc.pid, name=name, cgroup=cgroup, runtime_dir=runtime_dir)
    finally:
        _stop(proc, cgroup, runtime_dir, log_path)


def _term_when_parent_dies() -> None:
    """In the child, before exec: SIGTERM it when the test process dies, however it dies
    (even by SIGKILL, which runs no ``finally``), so a manager never outlives its tests."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        os._exit(121)


def _sweep_stale(v2: Path) -> None:
    """Remove what a test process that died without cleaning up left behind: its empty
    cgroup and its runtime directory (the name carries the dead process's PID). A cgroup
    that still holds processes is left alone."""
    for cgroup in v2.glob("llmgw-test-*"):
        match = re.fullmatch(r"llmgw-test-(\d+)-[0-9a-f]+", cgroup.name)
        if match is None or Path(f"/proc/{match.group(1)}").exists() or _pids_in(cgroup):
            continue
        below = sorted((p for p in cgroup.rglob("*") if p.is_dir()),
                       key=lambda p: len(p.parts), reverse=True)
        with contextlib.suppress(OSError):
            for directory in [*below, cgroup]:
                directory.rmdir()
        runtime_dir = Path(tempfile.gettempdir()) / cgroup.name
        shutil.rmtree(runtime_dir, ignore_errors=True)
        runtime_dir.with_name(runtime_dir.name + ".log").unlink(missing_ok=True)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-2000:]
    except OSError:
        return ""


def _pids_in(cgroup: Path) -> set[int]:
    pids: set[int] = set()
    for procs in cgroup.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in procs.read_text().split())
    # Never ourselves nor init, whatever a cgroup file said.
    return pids - {0, 1, os.getpid()}


def _stop(proc: subprocess.Popen | None, cgroup: Path, runtime_dir: Path,
          log_path: Path) -> None:
    errors = []
    if proc is not None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)  # stops its units, then exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=TERM_DEADLINE_S)
        deadline = time.monotonic() + KILL_DEADLINE_S
        while (left := _pids_in(cgroup)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if left:
            errors.append(f"processes {sorted(left)} survived SIGKILL")
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_DEADLINE_S)
    if cgroup.exists():
        below = sorted((p for p in cgroup.rglob("*") if p.is_dir()),
                       key=lambda p: len(p.parts), reverse=True)
        for directory in [*below, cgroup]:
            for _ in range(50):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy while its last process is being reaped
                    time.sleep(0.02)
        if cgroup.exists():
            errors.append(f"cgroup {cgroup} could not be removed")
    shutil.rmtree(runtime_dir, ignore_errors=True)
    log = _read(log_path)
    log_path.unlink(missing_ok=True)
    if errors:
        raise RuntimeError(f"stopping the systemd manager: {'; '.join(errors)}; its log: "
                           f"{log!r}")


def required() -> bool:
    """In CI (CI=true) a manager is required: a missing one fails instead of skipping."""
    return os.environ.get("CI", "").strip().lower() == "true"


@pytest.fixture(scope="session")
def systemd_manager() -> Iterator[Manager]:
    """One real systemd user manager for the whole test session."""
    why = unavailable()
    if why is not None:
        if required():
            pytest.fail(f"a systemd manager is required in CI (CI=true): {why}",
                        pytrace=False)
        pytest.skip(f"no systemd manager for the systemd runtime tests: {why}")
    with user_manager() as manager:
        yield manager
