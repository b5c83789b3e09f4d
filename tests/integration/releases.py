"""llama.cpp release archives made offline, for the tests that install one: from the
llama-server llmgw builds in its cache (the ``llama_cpp`` fixture), with the shared
libraries it loads beside it."""

from __future__ import annotations

import hashlib
import platform
import subprocess
import tarfile
from pathlib import Path

from llmgw.core.builds import NodeFacts, candidate_builds
from llmgw.core.desired_engines import DEFAULT_VERSIONS

VERSION = DEFAULT_VERSIONS["llama.cpp"]


def asset(version: str = VERSION) -> str:
    """The archive this machine's CPU build installs from."""
    [build] = candidate_builds("llama.cpp", version, NodeFacts(platform.machine()))
    return build.asset


def _libraries(binary: Path) -> list[Path]:
    """The shared libraries ``binary`` loads from outside the system's own directories."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            path = Path(parts[2])
            if not str(path).startswith(("/lib", "/usr/lib")):
                found.append(path)
    return found


def release_archive(server_binary: Path, archive: Path, version: str = VERSION) -> Path:
    """A llama.cpp-shaped release archive at ``archive``: ``llama-<version>/llama-server``
    with ggml-rpc-server and the libraries they load beside it (links resolved to files)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    top = f"llama-{version}"
    bin_dir = server_binary.parent
    programs = [server_binary] + [p for p in [bin_dir / "ggml-rpc-server"] if p.exists()]
    libraries = {lib.name: lib for p in programs for lib in _libraries(p)}
    with tarfile.open(archive, "w:gz") as tar:
        for path in programs:
            tar.add(path.resolve(), arcname=f"{top}/{path.name}")
        for name, path in sorted(libraries.items()):
            tar.add(path.resolve(), arcname=f"{top}/{name}")
    return archive


def make_release(server_binary: Path, mirror_root: Path, asset: str) -> Path:
    """The archive in a release mirror laid out as ``<root>/llama.cpp/<version>/<file>``,
    with the mirror's SHA256SUMS listing it."""
    directory = mirror_root / "llama.cpp" / VERSION
    directory.mkdir(parents=True)
    archive = release_archive(server_binary, directory / asset)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    (directory / "SHA256SUMS").write_text(f"{digest}  {asset}\n")
    return archive
