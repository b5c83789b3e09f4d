"""A set of wheels pinned by sha256, installed with no index: llmgw's own release
(``llmgw ctl upgrade``) and a Python engine's (vLLM, SGLang) from the control plane's
mirror, each file checked against the sha256 the control plane sent from the bundle's
signed manifest.

Only wheels that can suit the target (its CPython, OS and machine) are fetched: a first
cut by file name that spares other platforms' downloads; uv picks among what is left.
"""

from __future__ import annotations

import platform
import re
import sys
from collections.abc import Iterable

from llmgw.agent.install.pypi import InstallError
from llmgw.core.wheels import WHEEL

_PYTHON = re.compile(r"(?:python)?(\d+)\.(\d+)")


def python_of(python: str) -> tuple[int, int] | None:
    """(major, minor) of a Python named by version ("3.12"); None for an interpreter's
    path, whose version is not known without running it."""
    found = _PYTHON.fullmatch(python.rsplit("/", 1)[-1])
    return (int(found[1]), int(found[2])) if found else None


def _suits_python(python_tags: str, abi_tags: str, python: tuple[int, int] | None) -> bool:
    if python is None:
        return True
    major, minor = python
    for tag in python_tags.split("."):
        if tag in (f"py{major}", f"py{major}{minor}"):
            return True
        found = re.fullmatch(r"cp(\d)(\d+)", tag)
        if found and int(found[1]) == major:
            wanted = int(found[2])
            # An abi3 wheel serves every later CPython; any other only its own.
            if wanted == minor or ("abi3" in abi_tags.split(".") and wanted <= minor):
                return True
    return False


def _suits_platform(platform_tags: str) -> bool:
    machine = platform.machine().lower()
    for tag in platform_tags.split("."):
        if tag == "any":
            return True
        if (sys.platform.startswith("linux") and tag.endswith(f"_{machine}")
                and tag.startswith(("linux_", "manylinux", "musllinux"))):
            return True
    return False


def suits(name: str, python: tuple[int, int] | None) -> bool:
    """Whether the wheel file ``name`` can install for ``python`` (None: any) here."""
    found = WHEEL.fullmatch(name)
    return bool(found and _suits_python(found["python"], found["abi"], python)
                and _suits_platform(found["platform"]))


def distribution(name: str) -> str | None:
    """The distribution a wheel file is of; None for a name that is not a wheel's."""
    found = WHEEL.fullmatch(name)
    return found["name"] if found else None


def requirements(wheels: Iterable[tuple[str, str]]) -> str:
    """``--require-hashes`` lines for (file name, sha256) pairs: one line per distribution
    and version, with the hash of each of its files."""
    hashes: dict[tuple[str, str], list[str]] = {}
    for name, sha256 in wheels:
        found = WHEEL.fullmatch(name)
        if found is None:
            raise InstallError(f"{name} is not a wheel's file name (NAME-VERSION-PY-ABI-"
                               "PLATFORM.whl); the bundle was not made by llmgw bundle create")
        hashes.setdefault((found["name"], found["version"]), []).append(sha256)
    return "".join(
        f"{name}=={version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(digests)) + "\n"
        for (name, version), digests in sorted(hashes.items()))
