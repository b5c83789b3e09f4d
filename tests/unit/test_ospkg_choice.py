"""Which package manager a machine gets, from its os-release; how its output is read; the
retry policy for failed install passes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llmgw.agent.discovery.host import os_release
from llmgw.agent.install.ospkg import (
    CommandResult,
    ensure_packages,
    held_lock,
    package_manager,
    package_names,
    unsupported,
)
from llmgw.agent.install.pypi import InstallError
from llmgw.core.backoff import Retry, RetryPolicy, after_failure

# The os-release files as these distributions ship them (the lines that matter).
OS_RELEASES = {
    "debian-12": 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\n'
                 'VERSION_ID="12"\nID=debian\n',
    "ubuntu-24.04": 'PRETTY_NAME="Ubuntu 24.04.1 LTS"\nNAME="Ubuntu"\nVERSION_ID="24.04"\n'
                    'ID=ubuntu\nID_LIKE=debian\n',
    "rhel-9": 'NAME="Red Hat Enterprise Linux"\nVERSION_ID="9.4"\nID="rhel"\n'
              'ID_LIKE="fedora"\nPRETTY_NAME="Red Hat Enterprise Linux 9.4 (Plow)"\n',
    "rocky-9": 'NAME="Rocky Linux"\nVERSION_ID="9.4"\nID="rocky"\nID_LIKE="rhel centos fedora"\n'
               'PRETTY_NAME="Rocky Linux 9.4 (Blue Onyx)"\n',
    "fedora-40": 'NAME="Fedora Linux"\nVERSION_ID=40\nID=fedora\n'
                 'PRETTY_NAME="Fedora Linux 40 (Server Edition)"\n',
    "opensuse-leap-15.6": 'NAME="openSUSE Leap"\nVERSION_ID="15.6"\nID="opensuse-leap"\n'
                          'ID_LIKE="suse opensuse"\nPRETTY_NAME="openSUSE Leap 15.6"\n',
    "arch": 'NAME="Arch Linux"\nPRETTY_NAME="Arch Linux"\nID=arch\nBUILD_ID=rolling\n',
}


def release(tmp_path: Path, name: str) -> dict[str, str]:
    path = tmp_path / f"{name}.os-release"
    path.write_text(OS_RELEASES[name])
    return os_release(path)


def machine(tmp_path: Path, *tools: str) -> str:
    """A PATH holding only ``tools``, as empty executables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        (bin_dir / tool).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    return str(bin_dir)


ALL_TOOLS = ("apt-get", "dpkg-query", "dnf", "yum", "rpm", "zypper")


@pytest.mark.parametrize("name, tool, family, gomp", [
    ("debian-12", "apt-get", "debian", ["libgomp1"]),
    ("ubuntu-24.04", "apt-get", "debian", ["libgomp1"]),
    ("rhel-9", "dnf", "rhel", ["libgomp"]),
    ("rocky-9", "dnf", "rhel", ["libgomp"]),
    ("fedora-40", "dnf", "rhel", ["libgomp"]),
    ("opensuse-leap-15.6", "zypper", "suse", ["libgomp1"]),
])
def test_the_manager_comes_from_id_and_id_like(tmp_path, name, tool, family, gomp):
    path = machine(tmp_path, *ALL_TOOLS)
    manager = package_manager(release(tmp_path, name), search_path=path)
    assert manager is not None
    assert (manager.tool, manager.family, manager.path) == (tool, family, f"{path}/{tool}")
    assert package_names(manager.family, ["gomp"]) == gomp


def test_a_distribution_named_nowhere_is_known_by_its_family(tmp_path):
    path = machine(tmp_path, *ALL_TOOLS)
    manager = package_manager({"ID": "neolinux", "ID_LIKE": "almalinux rhel"},
                              search_path=path)
    assert manager is not None and manager.tool == "dnf"


def test_the_red_hat_family_without_dnf_uses_yum(tmp_path):
    manager = package_manager(release(tmp_path, "rocky-9"),
                              search_path=machine(tmp_path, "yum", "rpm"))
    assert manager is not None and (manager.tool, manager.query_path.rsplit("/")[-1]) == \
        ("yum", "rpm")


def test_arch_has_none_and_says_what_to_install(tmp_path):
    arch = release(tmp_path, "arch")
    assert package_manager(arch, search_path=machine(tmp_path, *ALL_TOOLS)) is None
    assert unsupported(arch, ["gomp"]) == (
        "Arch Linux (ID='arch', ID_LIKE='') is not of a family llmgw installs packages for "
        "(Debian, Red Hat, SUSE): install the GNU OpenMP runtime (libgomp) with its own "
        "package manager")


def test_a_known_family_without_its_tools_says_so(tmp_path):
    debian = release(tmp_path, "debian-12")
    assert package_manager(debian, search_path=machine(tmp_path, "rpm")) is None
    assert unsupported(debian, ["gomp", "gcc"]) == (
        "Debian GNU/Linux 12 (bookworm) is of the Debian family but apt-get with dpkg-query "
        "is not on PATH: install the GNU OpenMP runtime (libgomp) and a C compiler (gcc) "
        "by hand")


def test_an_unknown_need_is_refused():
    with pytest.raises(InstallError, match="unknown OS package need 'cuda'; known: gcc, "
                                           "gomp, vulkan"):
        package_names("debian", ["cuda"])


# --- reading the tools' output -------------------------------------------------------------

APT_LISTS_HELD = ["E: Could not get lock /var/lib/apt/lists/lock. It is held by process 1234 "
                  "(apt-get)",
                  "N: Be aware that removing the lock file is not a solution and may break "
                  "your system.",
                  "E: Unable to lock directory /var/lib/apt/lists/"]
APT_DPKG_HELD = ["E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process "
                 "2345 (unattended-upgr)",
                 "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), "
                 "is another process using it?"]
APT_NOT_ROOT = ["E: Could not open lock file /var/lib/apt/lists/lock - open (13: Permission "
                "denied)",
                "E: Unable to lock directory /var/lib/apt/lists/"]
APT_LOCK_AND_BROKEN = [*APT_DPKG_HELD, "E: Sub-process /usr/bin/dpkg returned an error code (1)"]


@pytest.mark.parametrize("tool, lines, held", [
    ("apt-get", APT_LISTS_HELD, True),
    ("apt-get", APT_DPKG_HELD, True),
    ("apt-get", APT_NOT_ROOT, False),
    ("apt-get", APT_LOCK_AND_BROKEN, False),
    ("apt-get", ["E: Unable to locate package libvulkan1"], False),
    ("dnf", ["Failed to obtain rpm transaction lock. Another transaction is in progress."],
     True),
    ("yum", ["Existing lock /var/run/yum.pid: another copy is running as pid 3456."], True),
    ("zypper", ["System management is locked by the application with pid 4567 (zypper).",
                "Close this application before trying again."], True),
    ("zypper", ["Root privileges are required for installing or uninstalling packages."],
     False),
])
def test_only_a_lock_another_process_holds_counts_as_held(tool, lines, held):
    assert held_lock(tool, lines) is held


class FakeZypper:
    """A runner shaped like rpm and zypper: answers from a set of installed names, and says
    the system is locked for the first ``locked`` installs."""

    def __init__(self, locked: int) -> None:
        self.installed: set[str] = set()
        self.locked = locked
        self.calls: list[list[str]] = []

    async def __call__(self, argv, *, env, timeout_s, on_line=None, keep_lines=40):
        self.calls.append(list(argv))
        assert env["LC_ALL"] == "C"
        if argv[0].endswith("rpm"):
            names = argv[4:]
            return CommandResult(sum(n not in self.installed for n in names), [
                n if n in self.installed else f"package {n} is not installed" for n in names])
        if self.locked:
            self.locked -= 1
            return CommandResult(7, ["System management is locked by the application with "
                                     "pid 4567 (zypper).",
                                     "Close this application before trying again."])
        self.installed.update(argv[5:])
        return CommandResult(0, [])


def test_zypper_is_asked_non_interactively_and_a_held_lock_is_retried(tmp_path):
    manager = package_manager(release(tmp_path, "opensuse-leap-15.6"),
                              search_path=machine(tmp_path, "zypper", "rpm"))
    assert manager is not None
    runner, status = FakeZypper(locked=2), []
    asyncio.run(ensure_packages(manager, ["gomp", "vulkan"], status=status.append,
                                run=runner, lock_poll_s=0))
    assert runner.installed == {"libgomp1", "libvulkan1"}
    assert runner.calls[1] == [manager.path, "--non-interactive", "--quiet", "install",
                               "--no-recommends", "libgomp1", "libvulkan1"]
    assert status == ["installing libgomp1 libvulkan1 with zypper",
                      "waiting for another zypper to finish"]


# --- retrying a failed pass ----------------------------------------------------------------


def test_a_failed_pass_is_retried_after_a_minute_backing_off_to_ten():
    retry, waits = Retry(), []
    for now in range(0, 8000, 1000):
        retry = after_failure(retry, now)
        waits.append(retry.not_before - now)
    assert waits == [60, 120, 240, 480, 600, 600, 600, 600]
    assert not retry.due(7000 + 599) and retry.due(7000 + 600)


def test_a_policy_must_make_sense():
    with pytest.raises(ValueError, match="0 < first_s <= max_s"):
        RetryPolicy(first_s=600, max_s=60)
