"""What a binary lacks to start, in words an operator can act on, from ``ldd``.

A binary that cannot load a library fails before it can say anything useful, and the
loader's own complaint names a path and a symbol version. ``ldd`` lists every library at
once; this turns its output into one line per library: "libgomp.so.1 is missing", or,
where the library is there but older than the build needs (a system older than the one
the build was made on), "libstdc++.so.6 is too old (needs GLIBCXX_3.4.30)" — once, with
the newest version asked for, however many of the binary's libraries ask.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

LDD_TIMEOUT_S = 30.0

_NOT_FOUND = re.compile(r"^\s*(?P<lib>\S+) => not found\s*$")
# "./llama-server: /lib64/libstdc++.so.6: version `GLIBCXX_3.4.30' not found (required by …)"
_TOO_OLD = re.compile(r"(?P<path>[^\s:]+): version [`'](?P<version>[^'`]+)' not found")
_VERSION_FAMILY = re.compile(r"^(?P<family>.*?)(?P<number>[\d.]+)$")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


def parse_ldd(output: str) -> list[str]:
    """The problems in ``ldd``'s output (stdout and stderr together), each library once,
    in the order ldd first names it; ``[]`` when everything resolves."""
    missing: dict[str, None] = {}
    too_old: dict[str, dict[str, str]] = {}  # library -> version family -> newest asked
    other: list[str] = []
    order: dict[str, None] = {}
    for line in output.splitlines():
        if m := _NOT_FOUND.match(line):
            lib = m["lib"]
            missing[lib] = None
            order.setdefault(lib, None)
        elif m := _TOO_OLD.search(line):
            lib = os.path.basename(m["path"])
            version = m["version"]
            fm = _VERSION_FAMILY.match(version)
            family = fm["family"] if fm else version
            newest = too_old.setdefault(lib, {}).get(family)
            if newest is None or _version_key(version) > _version_key(newest):
                too_old[lib][family] = version
            order.setdefault(lib, None)
        elif line.startswith("ldd: "):
            other.append(line.removeprefix("ldd: ").strip())
    problems = []
    for lib in order:
        if lib in missing:
            problems.append(f"{lib} is missing")
        else:
            problems.append(f"{lib} is too old (needs {', '.join(too_old[lib].values())})")
    return problems + list(dict.fromkeys(other))


def library_problems(binary: Path, env: Mapping[str, str] | None = None) -> list[str]:
    """Run ``ldd binary`` (with ``env``, where libraries are looked for) and say what is
    missing or too old; ``[]`` when all resolve, for a static binary or a script, and where
    the machine has no ``ldd`` (running the binary is the proof that always follows)."""
    ldd = shutil.which("ldd", path=(env or os.environ).get("PATH"))
    if ldd is None:
        return []
    # ldd is a script that runs the loader: its own session, so a timeout stops both.
    with subprocess.Popen([ldd, str(binary)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, errors="replace",
                          env=dict(env) if env is not None else None,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=LDD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return [f"ldd {binary.name} did not finish within {LDD_TIMEOUT_S:.0f} s"]
    return parse_ldd(out + "\n" + err)
