"""Requirements texts, as the agent installs Python environments from them and bundles
resolve them: a pinned, hashed list (``--require-hashes``: ``name==version --hash=sha256:…``
per package) and a source tree's own list (ComfyUI's ``requirements.txt``: package names
with version specifiers at most).

Either may name packages from the index and nothing else: a URL, a path, a VCS reference,
an editable install or an index option is refused, naming its line, before uv runs, so
the only code installed is what the index llmgw chose serves. Pure: text in, packages or
a RequirementsError out.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

# The most a source tree's requirements file may be (ComfyUI's is a few hundred bytes).
MAX_SOURCE_REQUIREMENTS_BYTES = 1 * 2**20

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_PINNED = re.compile(rf"({_NAME})\s*(\[\s*{_NAME}(?:\s*,\s*{_NAME})*\s*\])?\s*==\s*"
                     r"([A-Za-z0-9.+!_-]+)\s*(;.*)?")
# An unpinned requirement, as a source tree's requirements.txt gives them: "numpy>=1.25.0".
_SPECIFIER = r"(?:~=|===|==|!=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
_SPECIFIED = re.compile(rf"{_NAME}\s*(\[\s*{_NAME}(?:\s*,\s*{_NAME})*\s*\])?\s*"
                        rf"(?:{_SPECIFIER}(?:\s*,\s*{_SPECIFIER})*)?\s*(;.*)?")
_HASH = re.compile(r"sha256:[0-9a-f]{64}")
_OPTIONS_START = re.compile(r"(?:^|\s)-")
_COMMENT = re.compile(r"(?:^|\s)#.*$")
_INDEX_OPTIONS = ("-i", "--index-url", "--extra-index-url", "-f", "--find-links",
                  "--no-index", "--trusted-host", "--index")


class RequirementsError(ValueError):
    """A requirements text that is not what it must be; the message names the line."""


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) per requirement, continuations joined, comments gone."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = _COMMENT.sub("", raw)
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        joined = (pending + line).strip()
        pending = ""
        if joined:
            out.append((start, joined))
    if pending.strip():
        out.append((start, pending.strip()))
    return out


def _refusal(spec: str, options: str, pinned: bool = True) -> str | None:
    """Why one requirement line is not a plain, pinned, hashed package from the index (with
    ``pinned`` False: a package from the index, any version specifier, no options)."""
    if not spec:
        option = options.split()[0].split("=")[0]
        if option in ("-e", "--editable"):
            return "is an editable install; only packages from the index are taken"
        if option in ("-r", "--requirement", "-c", "--constraint"):
            return "includes another file; give every package in this text"
        if option in _INDEX_OPTIONS:
            return "names an index or a place to find packages; the index is llmgw's to choose"
        return f"is an option ({option}); only packages with --hash options are taken"
    if "://" in spec or re.match(r"(git|hg|svn|bzr)\+", spec):
        return "names a URL; only packages from the index are taken"
    if re.match(rf"{_NAME}\s*(\[[^\]]*\])?\s*@", spec):
        return "is a direct reference (name @ URL); only packages from the index are taken"
    if spec.startswith((".", "/", "~")) or "/" in spec.split(";")[0] or "\\" in spec \
            or spec.endswith((".whl", ".tar.gz", ".zip")):
        return "is a path; only packages from the index are taken"
    if not pinned:
        if options:
            return f"has the option {options.split()[0]}; only package names are taken"
        if not _SPECIFIED.fullmatch(spec):
            return "is not a package name with version specifiers"
        return None
    if not _PINNED.fullmatch(spec):
        return "is not pinned to one version with =="
    words = options.replace("=", " ").split()
    hashes = [w for w in words if w != "--hash"]
    if any(w.startswith("-") for w in hashes):
        bad = next(w for w in hashes if w.startswith("-"))
        return f"has the option {bad}; only --hash is taken after a package"
    if not hashes:
        return "has no --hash=sha256:…; every package needs the sha256 of its files"
    if not all(_HASH.fullmatch(h) for h in hashes) or words.count("--hash") != len(hashes):
        return "has a --hash that is not sha256:<64 hex digits>"
    return None


def _checked_lines(text: str, pinned: bool, what: str) -> list[str]:
    specs: list[str] = []
    for number, line in _logical_lines(text):
        cut = _OPTIONS_START.search(line)
        spec = line[:cut.start()].strip() if cut else line
        options = line[cut.start():].strip() if cut else ""
        why = _refusal(spec, options, pinned)
        if why:
            shown = line if len(line) <= 160 else line[:157] + "..."
            raise RequirementsError(f"{what} line {number} ({shown}) {why}")
        specs.append(spec)
    if not specs:
        raise RequirementsError(f"the {what} name no packages")
    return specs


def check_requirements(text: str) -> list[str]:
    """The packages (``name==version``) of a pinned, hashed requirements text; RequirementsError
    naming the first line that is anything else."""
    packages: list[str] = []
    for spec in _checked_lines(text, True, "requirements"):
        match = _PINNED.fullmatch(spec)
        assert match is not None
        packages.append(f"{match[1]}=={match[3]}")
    return packages


def check_source_requirements(text: str, what: str) -> list[str]:
    """The requirements of a source tree (``numpy>=1.25.0``, ``torch``), each a package from
    the index with version specifiers at most; RequirementsError naming the first line that is
    a URL, a path, a VCS reference, an option or anything else. ``what`` names the file."""
    return _checked_lines(text, False, what)


def day_after(newest: float) -> str | None:
    """The time a source release's requirements are resolved at: a day after the newest
    file date in its archive (``newest``, seconds since the epoch; GitHub dates every
    member of a tag's archive with the tagged commit's time), as an RFC 3339 time; None
    where the archive gives no dates."""
    if newest <= 0:
        return None
    when = datetime.fromtimestamp(newest, UTC) + timedelta(days=1)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")
