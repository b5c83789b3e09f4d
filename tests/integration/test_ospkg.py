"""OS packages through a stand-in apt-get that takes real locks.

The machine's own packages are never touched: ``apt-get`` and ``dpkg-query`` here are small
scripts in the test's directory, shaped like the real ones where llmgw depends on them.
apt-get takes an flock on ``lists/lock`` for ``update`` and on ``dpkg/lock-frontend`` for
``install`` (as apt takes /var/lib/apt/lists/lock and /var/lib/dpkg/lock-frontend), says
apt's own words when another process holds one, knows only the packages its last
``update`` fetched, and asks before installing unless given -y. The other process holding
the lock is a real ``flock`` from util-linux.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from llmgw.agent.install.ospkg import PackageManager, ensure_packages, package_manager
from llmgw.agent.install.pypi import InstallError

pytestmark = pytest.mark.skipif(shutil.which("flock") is None,
                                reason="needs flock from util-linux")

APT_GET = r'''#!{python}
import fcntl, os, sys
from pathlib import Path

sys.stdout.reconfigure(line_buffering=True)  # apt's lines in the order it says them
state = Path({state!r})
args = sys.argv[1:]
with open(state / "calls.log", "a") as log:
    log.write(" ".join(args) + " | DEBIAN_FRONTEND=" + os.environ.get("DEBIAN_FRONTEND", "")
              + "\n")


def holder(path):
    """The process holding an flock on path, as apt names it: from /proc/locks."""
    inode = os.stat(path).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            pid = fields[4]
            comm = Path(f"/proc/{{pid}}/comm").read_text().strip()
            return f"{{pid}} ({{comm}})"
    return "0 (unknown)"


def lock(path, *held_lines):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"E: Could not get lock {{path}}. It is held by process {{holder(path)}}",
              file=sys.stderr)
        print("N: Be aware that removing the lock file is not a solution and may break "
              "your system.", file=sys.stderr)
        for line in held_lines:
            print(line, file=sys.stderr)
        sys.exit(100)
    return fd


if args[0] == "update":
    lists = state / "lists"
    lock(lists / "lock", f"E: Unable to lock directory {{lists}}/")
    print("Reading package lists...")
    (lists / "Packages").write_text((state / "mirror").read_text())
    sys.exit(0)
if args[0] == "install":
    frontend = state / "dpkg" / "lock-frontend"
    lock(frontend, f"E: Unable to acquire the dpkg frontend lock ({{frontend}}), is another "
                   "process using it?")
    print("Reading package lists...")
    known = set((state / "lists" / "Packages").read_text().split())
    wanted = [a for a in args[1:] if not a.startswith("-") and "::" not in a]
    for name in wanted:
        if name not in known:
            print(f"E: Unable to locate package {{name}}", file=sys.stderr)
            sys.exit(100)
    if "-y" not in args:
        print("Do you want to continue? [Y/n] Abort.")
        sys.exit(1)
    with open(state / "dpkg" / "status", "a") as status:
        status.writelines(name + "\n" for name in wanted)
    sys.exit(0)
print(f"E: Invalid operation {{args[0]}}", file=sys.stderr)
sys.exit(100)
'''

DPKG_QUERY = r'''#!{python}
import sys
from pathlib import Path

installed = set(Path({state!r}, "dpkg", "status").read_text().split())
fmt = sys.argv[3]
rc = 0
for name in sys.argv[4:]:
    if name in installed:
        sys.stdout.write(fmt.replace("${{Package}}", name)
                         .replace("${{db:Status-Status}}", "installed").replace("\\n", "\n"))
    else:
        print(f"dpkg-query: no packages found matching {{name}}", file=sys.stderr)
        rc = 1
sys.exit(rc)
'''


class FakeApt:
    """A directory laid out like apt's state, with apt-get and dpkg-query that use it."""

    def __init__(self, root: Path, mirror: list[str], fetched: bool, installed=()) -> None:
        self.root = root
        (root / "bin").mkdir(parents=True)
        (root / "lists").mkdir()
        (root / "dpkg").mkdir()
        (root / "mirror").write_text("\n".join(mirror) + "\n")
        (root / "lists" / "Packages").write_text("\n".join(mirror) + "\n" if fetched else "")
        (root / "dpkg" / "status").write_text("".join(n + "\n" for n in installed))
        for name, text in (("apt-get", APT_GET), ("dpkg-query", DPKG_QUERY)):
            path = root / "bin" / name
            path.write_text(text.format(python=sys.executable, state=str(root)))
            path.chmod(0o755)
        manager = package_manager({"ID": "ubuntu", "ID_LIKE": "debian"},
                                  search_path=str(root / "bin"))
        assert manager is not None
        self.manager: PackageManager = manager

    def installed(self) -> list[str]:
        return (self.root / "dpkg" / "status").read_text().split()

    def calls(self) -> list[str]:
        log = self.root / "calls.log"
        return log.read_text().splitlines() if log.exists() else []


@contextlib.asynccontextmanager
async def lock_held(path: Path):
    """Another real process holding an flock on ``path`` until the block ends."""
    path.touch()
    holder = await asyncio.create_subprocess_exec(
        "flock", str(path), "sh", "-c", "echo held; read _", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        assert holder.stdout is not None
        assert await asyncio.wait_for(holder.stdout.readline(), 10) == b"held\n"
        yield holder
    finally:
        if holder.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(holder.pid, signal.SIGKILL)
        await holder.wait()


class Statuses(list):
    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()

    def __call__(self, text: str) -> None:
        self.append(text)
        if text.startswith("waiting for"):
            self.waiting.set()


@pytest.mark.parametrize("lock, fetched, expected", [
    # cloud-init runs apt-get update; ours needs fresh lists, and waits for its lock
    ("lists/lock", False, ["installing libgomp1 with apt-get",
                           "updating apt-get's package lists",
                           "waiting for another apt-get to finish",
                           "updating apt-get's package lists",
                           "installing libgomp1 with apt-get"]),
    # unattended-upgrades is installing; ours waits for dpkg's frontend lock
    ("dpkg/lock-frontend", True, ["installing libgomp1 with apt-get",
                                  "waiting for another apt-get to finish",
                                  "installing libgomp1 with apt-get"]),
])
async def test_a_held_lock_is_waited_for_and_the_install_succeeds_once_released(
        tmp_path, lock, fetched, expected):
    apt = FakeApt(tmp_path / "apt", mirror=["libgomp1", "gcc"], fetched=fetched)
    status = Statuses()
    async with lock_held(apt.root / lock) as holder:
        task = asyncio.create_task(ensure_packages(apt.manager, ["gomp"], status=status,
                                                   lock_wait_s=60, lock_poll_s=0.05))
        try:
            await asyncio.wait_for(status.waiting.wait(), 15)
            assert apt.installed() == [] and not task.done()
            assert holder.stdin is not None
            holder.stdin.close()  # the other apt-get finishes
            await asyncio.wait_for(holder.wait(), 10)
            await asyncio.wait_for(task, 20)
        finally:
            task.cancel()
    assert apt.installed() == ["libgomp1"]
    assert status == expected
    assert all(call.endswith("| DEBIAN_FRONTEND=noninteractive") for call in apt.calls())
    assert apt.calls()[-1].startswith("install -y -q --no-install-recommends")


async def test_a_lock_held_past_the_limit_fails_with_apts_words(tmp_path):
    apt = FakeApt(tmp_path / "apt", mirror=["libgomp1"], fetched=False)
    status = Statuses()
    async with lock_held(apt.root / "lists" / "lock") as holder:
        with pytest.raises(InstallError) as err:
            await asyncio.wait_for(ensure_packages(apt.manager, ["gomp"], status=status,
                                                   lock_wait_s=0.5, lock_poll_s=0.05), 20)
    message = str(err.value)
    assert message.startswith("updating apt-get's package lists: another apt-get held the "
                              "package lock for more than 0.5 s; it said:\n")
    assert (f"E: Could not get lock {apt.root}/lists/lock. It is held by process "
            f"{holder.pid} (flock)") in message
    assert message.endswith(f"E: Unable to lock directory {apt.root}/lists/")
    assert "waiting for another apt-get to finish" in status
    assert apt.installed() == []


async def test_installed_packages_are_left_alone(tmp_path):
    apt = FakeApt(tmp_path / "apt", mirror=["libgomp1", "gcc"], fetched=True,
                  installed=["libgomp1", "gcc"])
    status = Statuses()
    await asyncio.wait_for(ensure_packages(apt.manager, ["gomp", "gcc"], status=status), 20)
    assert status == [] and apt.calls() == []


async def test_only_the_missing_packages_are_installed(tmp_path):
    apt = FakeApt(tmp_path / "apt", mirror=["libgomp1", "gcc"], fetched=True,
                  installed=["libgomp1"])
    status = Statuses()
    await asyncio.wait_for(ensure_packages(apt.manager, ["gomp", "gcc"], status=status), 20)
    assert status == ["installing gcc with apt-get"]
    assert apt.installed() == ["libgomp1", "gcc"]


async def test_a_package_the_sources_lack_fails_with_the_commands_last_lines(tmp_path):
    apt = FakeApt(tmp_path / "apt", mirror=["libgomp1"], fetched=False)
    with pytest.raises(InstallError) as err:
        await asyncio.wait_for(ensure_packages(apt.manager, ["vulkan"], status=Statuses()), 20)
    assert str(err.value) == ("installing libvulkan1 with apt-get failed (exit 100); it "
                              "said:\nReading package lists...\n"
                              "E: Unable to locate package libvulkan1")
    # The lists were refreshed once before giving up.
    assert [c.split()[0] for c in apt.calls()] == ["install", "update", "install"]
