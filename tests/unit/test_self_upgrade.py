"""The agent's self-upgrade pieces that decide without doing: which wheels suit this
machine, the ``--require-hashes`` file, moving ``current`` and ``previous``, handing over
to ``current`` at start, and the upgrade messages on the wire."""

from __future__ import annotations

import logging
import os
import platform
import re
import sys
from pathlib import Path

import pytest

from llmgw import wire
from llmgw.agent import self_upgrade
from llmgw.agent.install.pypi import InstallError
from llmgw.agent.install.wheelset import python_of, requirements
from llmgw.agent.self_upgrade import (
    HANDED_OVER,
    handover,
    installation,
    restart_argv,
    rollback,
    suitable,
    switch,
)

MINOR = sys.version_info.minor
MACHINE = platform.machine().lower()
MANYLINUX = {
    "x86_64": "manylinux_2_17_x86_64.manylinux2014_x86_64",
    "aarch64": "manylinux_2_17_aarch64.manylinux2014_aarch64",
}


def _wheel(name: str) -> wire.UpgradeWheel:
    return wire.UpgradeWheel(url=f"{wire.MIRROR_SCHEME}{wire.MIRROR_FILES}/wheels/{name}",
                             sha256="0" * 64, size=1000)


def _file(wheel: wire.UpgradeWheel) -> str:
    return wheel.url.rsplit("/", 1)[-1]


# --- suitable() ----------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux wheels' cut")
def test_suitable_keeps_the_wheels_this_cpython_and_machine_can_install() -> None:
    # (file name, whether this interpreter on this machine takes it)
    cases = [
        ("llmgw-0.6.0-py3-none-any.whl", True),
        ("llmgw-0.6.0-1-py3-none-any.whl", True),  # a build tag
        ("six-1.16.0-py2.py3-none-any.whl", True),
        ("futures-3.4.0-py2-none-any.whl", False),
        ("llmgw-0.6.0.tar.gz", False),  # not a wheel at all
    ]
    for minor in (10, 11, 12, 13, 14):
        for machine, tags in MANYLINUX.items():
            cases.append((f"pydantic_core-2.33.2-cp3{minor}-cp3{minor}-{tags}.whl",
                          minor == MINOR and machine == MACHINE))
    for machine in ("x86_64", "aarch64"):
        # abi3 from 3.9 serves every later CPython, so this one too.
        cases.append((f"cryptography-45.0.5-cp39-abi3-manylinux_2_28_{machine}.whl",
                      machine == MACHINE))
        cases.append((f"cryptography-45.0.5-cp311-abi3-manylinux_2_34_{machine}.whl",
                      machine == MACHINE))
        cases.append((f"uvloop-0.21.0-cp3{MINOR}-cp3{MINOR}-linux_{machine}.whl",
                      machine == MACHINE))
        # The cut is by OS and machine, not by C library: uv picks between manylinux
        # and musllinux among what is left (self_upgrade.suitable's docstring).
        cases.append((f"pydantic_core-2.33.2-cp3{MINOR}-cp3{MINOR}-musllinux_1_1_{machine}"
                      ".whl", machine == MACHINE))
    cases += [
        # abi3 from a later CPython than this one: no.
        (f"cryptography-45.0.5-cp3{MINOR + 1}-abi3-{MANYLINUX['x86_64']}.whl", False),
        (f"cryptography-45.0.5-cp3{MINOR + 1}-abi3-{MANYLINUX['aarch64']}.whl", False),
        (f"pydantic_core-2.33.2-cp3{MINOR}-cp3{MINOR}-macosx_11_0_arm64.whl", False),
        (f"pydantic_core-2.33.2-cp3{MINOR}-cp3{MINOR}-macosx_10_12_x86_64.whl", False),
        (f"pydantic_core-2.33.2-cp3{MINOR}-cp3{MINOR}-win_amd64.whl", False),
        (f"pydantic_core-2.33.2-cp3{MINOR}-cp3{MINOR}-manylinux_2_17_i686.whl", False),
        (f"pydantic_core-2.33.2-pp3{MINOR}-pypy3{MINOR}_pp73-{MANYLINUX['x86_64']}.whl",
         False),
        (f"pydantic_core-2.33.2-pp3{MINOR}-pypy3{MINOR}_pp73-{MANYLINUX['aarch64']}.whl",
         False),
    ]
    wheels = [_wheel(name) for name, _ in cases]
    expected = [name for name, takes in cases if takes]

    assert [_file(w) for w in suitable(wheels)] == expected


def test_suitable_keeps_the_wheels_as_they_were_sent() -> None:
    wheel = wire.UpgradeWheel(url=f"{wire.MIRROR_SCHEME}/mirror/files/llmgw-0.6.0-py3-none-any"
                              ".whl", sha256="ab" * 32, size=123_456)
    assert suitable([wheel]) == [wheel]
    assert suitable([]) == []


# --- requirements() ------------------------------------------------------------------------


def test_requirements_pins_each_version_with_the_hash_of_each_of_its_files() -> None:
    text = requirements([
        ("pydantic_core-2.33.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
         "bb" * 32),
        ("llmgw-0.6.0-py3-none-any.whl", "11" * 32),
        ("pydantic_core-2.33.2-cp311-cp311-musllinux_1_1_x86_64.whl", "aa" * 32),
        ("anyio-4.9.0-py3-none-any.whl", "ff" * 32),
    ])
    assert text == (
        f"anyio==4.9.0 --hash=sha256:{'ff' * 32}\n"
        f"llmgw==0.6.0 --hash=sha256:{'11' * 32}\n"
        f"pydantic_core==2.33.2 --hash=sha256:{'aa' * 32} --hash=sha256:{'bb' * 32}\n")


def test_requirements_of_nothing_is_empty() -> None:
    assert requirements([]) == ""


@pytest.mark.parametrize("name", ["llmgw-0.6.0.tar.gz", "llmgw-0.6.0-py3-none.whl",
                                  "README.md"])
def test_requirements_refuses_a_file_that_is_not_a_wheel_and_names_it(name: str) -> None:
    with pytest.raises(InstallError, match=f"^{re.escape(name)} is not a wheel's file name"):
        requirements([("llmgw-0.6.0-py3-none-any.whl", "11" * 32), (name, "22" * 32)])


# --- switch() ------------------------------------------------------------------------------


def _install(root: Path, version: str) -> Path:
    """What SelfUpgrade.install leaves before it switches: the new environment in place."""
    target = root / "versions" / version
    (target / "bin").mkdir(parents=True)
    (target / "bin" / "python").write_text("")
    return target


def _links(root: Path) -> dict[str, str]:
    return {name: os.readlink(root / name) for name in ("current", "previous")
            if (root / name).is_symlink()}


def _versions(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "versions").iterdir())


def test_switch_keeps_current_and_previous_and_removes_the_one_before(tmp_path: Path) -> None:
    root = tmp_path / "llmgw"

    switch(root, _install(root, "0.5.0"))
    assert _links(root) == {"current": "versions/0.5.0"}
    assert _versions(root) == ["0.5.0"]

    switch(root, _install(root, "0.5.1"))
    assert _links(root) == {"current": "versions/0.5.1", "previous": "versions/0.5.0"}
    assert _versions(root) == ["0.5.0", "0.5.1"]

    switch(root, _install(root, "0.6.0"))
    assert _links(root) == {"current": "versions/0.6.0", "previous": "versions/0.5.1"}
    assert _versions(root) == ["0.5.1", "0.6.0"]
    assert (root / "current" / "bin" / "python").is_file()
    # Each link was put in place by one rename: no temporary link is left behind.
    assert sorted(p.name for p in root.iterdir()) == ["current", "previous", "versions"]


def test_switch_to_the_current_one_again_keeps_previous(tmp_path: Path) -> None:
    root = tmp_path / "llmgw"
    switch(root, _install(root, "0.5.0"))
    switch(root, _install(root, "0.6.0"))

    switch(root, root / "versions" / "0.6.0")

    assert _links(root) == {"current": "versions/0.6.0", "previous": "versions/0.5.0"}
    assert _versions(root) == ["0.5.0", "0.6.0"]


def test_switch_back_to_previous_swaps_the_two(tmp_path: Path) -> None:
    root = tmp_path / "llmgw"
    switch(root, _install(root, "0.5.0"))
    switch(root, _install(root, "0.6.0"))

    switch(root, root / "versions" / "0.5.0")

    assert _links(root) == {"current": "versions/0.5.0", "previous": "versions/0.6.0"}
    assert _versions(root) == ["0.5.0", "0.6.0"]


def test_rollback_swaps_current_and_previous_and_after_a_first_upgrade_removes_current(
        tmp_path: Path) -> None:
    state = tmp_path
    root = state / "llmgw"
    with pytest.raises(InstallError, match="never upgraded by `llmgw ctl upgrade`"):
        rollback(state)
    switch(root, _install(root, "0.5.0"))
    switch(root, _install(root, "0.6.0"))

    assert rollback(state) == ("0.6.0", "0.5.0")
    assert _links(root) == {"current": "versions/0.5.0", "previous": "versions/0.6.0"}
    assert rollback(state) == ("0.5.0", "0.6.0")
    assert _links(root) == {"current": "versions/0.6.0", "previous": "versions/0.5.0"}

    (root / "previous").unlink()
    assert rollback(state) == ("0.6.0", "")
    assert _links(root) == {}
    assert _versions(root) == ["0.5.0", "0.6.0"]  # nothing installed is removed


def test_switch_removes_installations_neither_link_names(tmp_path: Path) -> None:
    root = tmp_path / "llmgw"
    _install(root, "0.4.0")  # left by an agent that stopped before switching
    _install(root, "0.4.1")

    switch(root, _install(root, "0.5.0"))

    assert _links(root) == {"current": "versions/0.5.0"}
    assert _versions(root) == ["0.5.0"]


# --- handover() ----------------------------------------------------------------------------


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An agent state directory, this process running from an environment elsewhere."""
    monkeypatch.delenv(HANDED_OVER, raising=False)
    running = tmp_path / "first-install"
    (running / "bin").mkdir(parents=True)
    monkeypatch.setattr(sys, "prefix", str(running))
    monkeypatch.setattr(sys, "argv", ["/usr/bin/llmgw", "agent", "run", "--config",
                                      "/etc/llmgw/agent.yaml"])
    state = tmp_path / "state"
    state.mkdir()
    return state


def test_no_handover_without_current(state_dir: Path) -> None:
    assert handover(state_dir) is None
    (state_dir / "llmgw" / "versions").mkdir(parents=True)
    assert handover(state_dir) is None


def test_no_handover_when_current_is_the_running_installation(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = state_dir / "llmgw"
    switch(root, _install(root, "0.6.0"))
    monkeypatch.setattr(sys, "prefix", str(root / "versions" / "0.6.0"))
    assert handover(state_dir) is None
    # Named through the link as well: compared resolved.
    monkeypatch.setattr(sys, "prefix", str(root / "current"))
    assert handover(state_dir) is None


def test_handover_runs_current_with_this_process_arguments(state_dir: Path) -> None:
    root = state_dir / "llmgw"
    target = _install(root, "0.6.0")
    switch(root, target)

    argv = handover(state_dir)

    assert argv == [str(target.resolve() / "bin" / "python"), "-m", "llmgw", "agent", "run",
                    "--config", "/etc/llmgw/agent.yaml"]
    assert argv == restart_argv(target.resolve())


def test_no_handover_once_handed_over(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = state_dir / "llmgw"
    switch(root, _install(root, "0.6.0"))
    monkeypatch.setenv(HANDED_OVER, "1")
    assert handover(state_dir) is None


def test_no_handover_to_a_folder_without_python_and_a_warning_says_so(
        state_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = state_dir / "llmgw"
    target = root / "versions" / "0.6.0"
    target.mkdir(parents=True)
    switch(root, target)

    with caplog.at_level(logging.WARNING, logger=self_upgrade.__name__):
        assert handover(state_dir) is None

    [record] = [r for r in caplog.records if r.name == self_upgrade.__name__]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"{root / 'current'} names {target.resolve()}, which holds no Python environment; "
        f"running this llmgw ({sys.prefix}) instead")


def test_restart_argv_uses_the_environment_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/nix/store/x/llmgw/__main__.py", "agent", "run"])
    assert restart_argv(Path("/var/lib/llmgw/llmgw/versions/0.6.0")) == [
        "/var/lib/llmgw/llmgw/versions/0.6.0/bin/python", "-m", "llmgw", "agent", "run"]


# --- installation() ------------------------------------------------------------------------


def test_installation_is_nix_from_the_nix_store(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    assert installation() == wire.INSTALL_PYTHON

    monkeypatch.setattr(sys, "prefix", "/nix/store/0123456789abcdfghijklmnpqrsvwxyz-llmgw-env")
    assert installation() == wire.INSTALL_NIX

    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(sys, "executable",
                        "/nix/store/0123456789abcdfghijklmnpqrsvwxyz-python3-3.12.8/bin/python3")
    assert installation() == wire.INSTALL_NIX


# --- the wire ------------------------------------------------------------------------------


def test_upgrade_agent_round_trips() -> None:
    message = wire.UpgradeAgent(request="9f3c2a1b7d4e5f60", version="0.6.0", wheels=[
        _wheel("llmgw-0.6.0-py3-none-any.whl"),
        wire.UpgradeWheel(url=f"{wire.MIRROR_SCHEME}{wire.MIRROR_FILES}/wheels/"
                          f"pydantic_core-2.33.2-cp311-cp311-{MANYLINUX['aarch64']}.whl",
                          sha256="cd" * 32, size=2_000_000),
    ])
    frame = wire.encode(message)
    assert wire.decode_down(frame) == message


@pytest.mark.parametrize("state", [wire.UPGRADE_WORKING, wire.UPGRADE_FAILED,
                                   wire.UPGRADE_RESTARTING])
def test_upgrade_status_round_trips(state: str) -> None:
    message = wire.UpgradeStatus(request="9f3c2a1b7d4e5f60", state=state,
                                 detail="installing llmgw 0.6.0 and its dependencies")
    assert wire.decode_up(wire.encode(message)) == message


@pytest.mark.parametrize("installed", [wire.INSTALL_NIX, wire.INSTALL_PYTHON, ""])
def test_register_carries_how_llmgw_is_installed(installed: str) -> None:
    message = wire.Register(node_id="gpu-1", address="10.0.0.5",
                            inventory=wire.Inventory(hostname="gpu-1"), agent_version="0.6.0",
                            features=[wire.FEATURE_SELF_UPGRADE], installation=installed)
    decoded = wire.decode_up(wire.encode(message))
    assert decoded == message
    assert isinstance(decoded, wire.Register)
    assert decoded.installation == installed


def test_python_of_reads_a_version_or_an_interpreter_named_by_it() -> None:
    assert python_of("3.12") == (3, 12)
    assert python_of("/usr/bin/python3.11") == (3, 11)
    assert python_of("/opt/venv/bin/python") is None


def test_switch_never_removes_the_installation_this_process_runs_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Running from 0.5.0 after a rollback made another one current: upgrading twice more
    # removes 0.6.0, never 0.5.0 (the running agent imports from it until it execs).
    root = tmp_path / "llmgw"
    running = _install(root, "0.5.0")
    monkeypatch.setattr(sys, "prefix", str(running))
    switch(root, _install(root, "0.6.0"))
    switch(root, _install(root, "0.7.0"))
    switch(root, _install(root, "0.8.0"))
    assert _links(root) == {"current": "versions/0.8.0", "previous": "versions/0.7.0"}
    assert _versions(root) == ["0.5.0", "0.7.0", "0.8.0"]
