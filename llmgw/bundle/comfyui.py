"""ComfyUI in a bundle: its release's source archive, and the wheel set its
``requirements.txt`` resolves to, so that nodes build its environment with no index.

GitHub publishes no digest for a tag's archive: the operator pins it (``--engine-sha256
v0.3.60.tar.gz=HEX``, as ``engines.comfyui.sha256`` in server.yaml) and nothing else is
taken. The archive's ``requirements.txt`` (beside ``main.py``, at the top of the tree or
in its one top folder) is read without unpacking anything and checked as the node checks
it (core.requirements: packages from the index only, 1 MiB at most); it is resolved as the
node would resolve it, as the indexes stood at ``--exclude-newer``, else a day after the
archive's newest file date (GitHub dates every member with the tagged commit's time).
create.py resolves it with wheelsets.py and puts the wheels beside the archive.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path

from llmgw.bundle.manifest import BundleError
from llmgw.core import requirements
from llmgw.core.builds import comfyui_archive

NAME = "comfyui"
MAIN = "main.py"
REQUIREMENTS = "requirements.txt"
MAX_MEMBERS = 50_000  # as the node bounds ComfyUI's archive


@dataclass(frozen=True, slots=True)
class SourceRequirements:
    """A ComfyUI archive's requirements.txt (``text``, its ``packages``) and the time its
    release is resolved at (a day after its newest file date; None where it has none)."""

    text: str
    packages: list[str]
    released_cutoff: str | None


def read_archive(path: Path, version: str) -> SourceRequirements:
    """The requirements of ComfyUI ``version``'s source archive at ``path``; BundleError
    naming what is wrong with it (the node would refuse it for the same)."""
    label = comfyui_archive(version)
    what = f"ComfyUI {version}'s {REQUIREMENTS}"
    try:
        with tarfile.open(path) as tar:
            members = []
            for member in tar:
                members.append(member)
                if len(members) > MAX_MEMBERS:
                    raise BundleError(f"{label} has more than {MAX_MEMBERS:,} files; it is "
                                      "not a ComfyUI release")
            files = {m.name.removeprefix("./"): m for m in members if m.isfile()}
            mains = sorted((name.count("/"), name) for name in files
                           if name.rsplit("/", 1)[-1] == MAIN)
            if not mains or mains[0][0] > 1:
                raise BundleError(f"{label} has no {MAIN} at its top; it is not a ComfyUI "
                                  "release")
            top = mains[0][1].removesuffix(MAIN)
            member = files.get(top + REQUIREMENTS)
            if member is None:
                raise BundleError(f"{label} has no {REQUIREMENTS} beside {MAIN}")
            if member.size > requirements.MAX_SOURCE_REQUIREMENTS_BYTES:
                raise BundleError(f"{what} is {member.size:,} bytes; over "
                                  f"{requirements.MAX_SOURCE_REQUIREMENTS_BYTES:,} is no "
                                  "requirements file")
            data = tar.extractfile(member)
            assert data is not None  # a regular file
            text = data.read().decode(errors="replace")
    except (tarfile.TarError, EOFError, OSError) as err:
        raise BundleError(f"{label} is not a readable tar archive: {err}") from None
    try:
        packages = requirements.check_source_requirements(text, what)
    except requirements.RequirementsError as err:
        raise BundleError(f"{err}; nodes could not install this ComfyUI either") from None
    newest = max((m.mtime for m in members), default=0)
    return SourceRequirements(text, packages, requirements.day_after(newest))
