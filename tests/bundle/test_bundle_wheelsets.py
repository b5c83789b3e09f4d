"""A Python engine's wheel set in a bundle (``bundle create --engine vllm@VERSION``):
resolved by uv from a local index (tests/pyindex.py) for this machine's CPython and
processor, one wheel per package, each checked against the index's sha256, with a
requirements.txt that installs them with no index. A stand-in ``vllm`` of tiny real
wheels plays vLLM; nothing leaves the machine."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from uv import find_uv_bin

from llmgw.agent.install.pyenv import check_requirements
from llmgw.bundle import create, signing, verify, wheelsets
from llmgw.bundle.manifest import BundleError
from llmgw.bundle.wheelsets import Chosen, Locked, Target, Wheel
from llmgw.cli.main import main as llmgw
from tests.hub import hub_in_thread
from tests.pyindex import Index, build_sdist, build_wheel

PYTHON = f"3.{sys.version_info.minor}"  # the wheels must install here, in the test
CP = f"cp3{sys.version_info.minor}"
ARCH = platform.machine()
PLATFORM = f"{ARCH}-manylinux_2_28"
# tiny-b's wheel under the names of other builds, as a binary package publishes them:
# the one for this target the most closely, one for a newer glibc, one for another
# processor.
BEST = f"tiny_b-0.2.0-{CP}-{CP}-manylinux_2_17_{ARCH}.manylinux2014_{ARCH}.whl"
TOO_NEW = f"tiny_b-0.2.0-{CP}-{CP}-manylinux_2_34_{ARCH}.whl"
OTHER_ARCH = "tiny_b-0.2.0-{cp}-{cp}-manylinux_2_17_{arch}.whl".format(
    cp=CP, arch="aarch64" if ARCH == "x86_64" else "x86_64")

pytestmark = pytest.mark.skipif(ARCH not in wheelsets.ARCHES,
                                reason=f"bundles are made for {wheelsets.ARCHES} nodes")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("wheels")
    return {
        "vllm": build_wheel(work, "vllm", "0.11.0",
                            "import tiny_b\n\ndef main():\n    print('vllm', tiny_b.VALUE)\n",
                            deps=["tiny-b==0.2.0", "tiny-win==1.0; sys_platform == 'win32'"]),
        # A vllm that needs a package published as a source archive only.
        "vllm-0.12": build_wheel(work, "vllm", "0.12.0", "import tiny_s\n",
                                 deps=["tiny-s>=1"]),
        "tiny-b": build_wheel(work, "tiny-b", "0.2.0", "VALUE = 42\n\ndef main(): pass\n"),
        "tiny-b-evil": build_wheel(work, "tiny-b", "0.2.0", "VALUE = 666\n"),
        "tiny-s": build_sdist(work, "tiny-s", "1.0", "VALUE = 1\n"),
    }


@pytest.fixture(scope="module")
def index(wheels):
    files = {p: wheels[p] for p in ("vllm", "tiny-b", "tiny-s")}
    with hub_in_thread(files, Index) as served:
        served.serve_as("vllm", wheels["vllm-0.12"].name, wheels["vllm-0.12"])
        for name in (BEST, TOO_NEW, OTHER_ARCH):
            served.serve_as("tiny-b", name, wheels["tiny-b"])
        yield served


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("key") / "signing.pem"
    return path, signing.keygen(path)


@pytest.fixture(scope="module")
def made(index, key, tmp_path_factory) -> tuple[Path, str]:
    """A bundle of vllm 0.11.0, made through the CLI as an operator would; its stderr."""
    out = tmp_path_factory.mktemp("made") / "bundle"
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = llmgw(["bundle", "create", str(out), "--key", str(key[0]),
                      "--engine", "vllm@0.11.0", "--index-url", index.url,
                      "--python", PYTHON, "--python-platform", PLATFORM,
                      "--exclude-newer", "2025-03-02T12:00:00Z", "--llmgw-version", "0.9.0"])
    assert code == 0, err.getvalue()
    return out, err.getvalue()


def test_a_bundle_holds_the_wheels_of_the_resolution_and_their_requirements(
        made, key, wheels, index):
    out, said = made
    checked = verify.verify_bundle(out, [key[1]])
    folder = "engines/vllm/0.11.0"
    vllm, tiny_b = wheels["vllm"], wheels["tiny-b"]
    text = (f"tiny-b==0.2.0 \\\n    --hash=sha256:{sha256(tiny_b.read_bytes())}\n"
            f"vllm==0.11.0 \\\n    --hash=sha256:{sha256(vllm.read_bytes())}\n")
    [engine] = checked.manifest.engines
    assert (engine.name, engine.version, engine.files) == (
        "vllm", "0.11.0", [f"{folder}/{BEST}", f"{folder}/{vllm.name}",
                           f"{folder}/requirements.txt"])
    listed = {f.path: (f.size, f.sha256) for f in checked.manifest.files}
    assert listed == {
        f"{folder}/{BEST}": (tiny_b.stat().st_size, sha256(tiny_b.read_bytes())),
        f"{folder}/{vllm.name}": (vllm.stat().st_size, sha256(vllm.read_bytes())),
        f"{folder}/requirements.txt": (len(text), sha256(text.encode())),
    }
    assert (out / "files" / folder / "requirements.txt").read_text() == text
    assert check_requirements(text) == ["tiny-b==0.2.0", "vllm==0.11.0"]
    size = vllm.stat().st_size
    assert (f"resolving vllm==0.11.0 for CPython {PYTHON} on {PLATFORM} from {index.url} as "
            "it stood at 2025-03-02T12:00:00Z\nresolved 2 packages, "
            f"{size + tiny_b.stat().st_size:,} bytes of wheels\n") in said
    assert f"downloading {vllm.name} ({size:,} bytes)\n" in said
    assert f"vllm 0.11.0: 2 wheels, {size + tiny_b.stat().st_size:,} bytes\n" in said


def test_the_requirements_install_the_bundled_wheels_with_no_index(made, tmp_path):
    out, _ = made
    folder = out / "files" / "engines" / "vllm" / "0.11.0"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))},
           "UV_CACHE_DIR": str(tmp_path / "cache"), "UV_NO_CONFIG": "1"}
    uv = find_uv_bin()
    venv = tmp_path / "venv"
    for argv in ([uv, "venv", "-q", "--python", sys.executable, str(venv)],
                 [uv, "pip", "install", "-q", "--offline", "--python", str(venv / "bin/python"),
                  "--no-index", "--find-links", str(folder), "--require-hashes",
                  "-r", str(folder / "requirements.txt")]):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
    ran = subprocess.run([str(venv / "bin/python"), "-c", "import vllm; vllm.main()"],
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert (ran.returncode, ran.stdout) == (0, "vllm 42\n"), ran.stderr


def _refused(key, out: Path, index_url: str, engine: str) -> str:
    out.parent.mkdir()
    request = create.Request(out=out, key_file=key[0], llmgw_version="0.9.0",
                             engines=[create.EngineWant("vllm", engine)],
                             python_target=Target(PYTHON, PLATFORM, index_url))
    with pytest.raises(BundleError) as err:
        asyncio.run(create.create_bundle(request))
    assert list(out.parent.iterdir()) == [], "a refused bundle leaves nothing"
    return str(err.value)


def test_a_wheel_whose_bytes_are_not_the_ones_the_index_lists_is_refused(
        wheels, key, tmp_path):
    tiny_b = wheels["tiny-b"]
    with hub_in_thread({"vllm": wheels["vllm"], "tiny-b": tiny_b}, Index) as tampered:
        tampered.tamper(tiny_b.name, wheels["tiny-b-evil"])
        said = _refused(key, tmp_path / "out" / "bundle", tampered.url, "0.11.0")
    base = tampered.url.removesuffix("/simple")
    assert said == (f"{tiny_b.name} from {base}/files/{tiny_b.name} has sha256 "
                    f"{sha256(wheels['tiny-b-evil'].read_bytes())}, but the index lists "
                    f"{sha256(tiny_b.read_bytes())}: the file is corrupt, or not the one the "
                    "index published")


def test_a_package_with_only_a_source_archive_refuses_the_bundle(index, key, tmp_path):
    said = _refused(key, tmp_path / "out" / "bundle", index.url, "0.12.0")
    assert said == (
        f"tiny-s 1.0 has no wheel for CPython {PYTHON} on {PLATFORM} (only a source "
        "archive): a node installs wheels and builds nothing; if the nodes' glibc is newer "
        f"than 2.28 (`ldd --version` on a node), say so with --python-platform "
        f"{ARCH}-manylinux_2_NN for glibc 2.NN, or choose a --python it publishes wheels for, "
        "or serve a wheel of it from an index of your own and add that with "
        "--extra-index-url")


# --- the choice, without uv ---------------------------------------------------------------

def _wheel(file: str) -> Wheel:
    return Wheel(file, f"https://files.example/{file}", "0" * 64, None)


TORCH = ["torch-2.9.0-cp312-cp312-manylinux_2_28_aarch64.whl",
         "torch-2.9.0-cp312-cp312-manylinux_2_28_x86_64.whl",
         "torch-2.9.0-cp312-abi3-manylinux_2_28_x86_64.whl",
         "torch-2.9.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
         "torch-2.9.0-py3-none-any.whl"]


@pytest.mark.parametrize("target, files, best", [
    (Target(), TORCH, TORCH[1]),
    (Target(platform="x86_64-manylinux_2_27"), TORCH, TORCH[3]),
    (Target(platform="aarch64-manylinux_2_28"), TORCH, TORCH[0]),
    (Target(python="3.13"), TORCH, TORCH[2]),
    (Target(platform="aarch64-manylinux_2_17"), TORCH, TORCH[4]),
    (Target(), ["torch-2.9.0-cp310-abi3-linux_x86_64.whl",
                "torch-2.9.0-cp311-abi3-manylinux1_x86_64.whl"],
     "torch-2.9.0-cp311-abi3-manylinux1_x86_64.whl"),
    (Target(), ["torch-2.9.0-py2.py3-none-any.whl", "torch-2.9.0-py312-none-any.whl"],
     "torch-2.9.0-py312-none-any.whl"),
])
def test_the_wheel_that_suits_the_target_most_closely_is_chosen(target, files, best):
    [chosen] = wheelsets.choose([Locked("torch", "2.9.0", tuple(map(_wheel, files)),
                                        False)], target)
    assert chosen.wheel.file == best


def test_a_package_without_a_wheel_for_the_target_names_what_the_index_has():
    locked = Locked("torch", "2.9.0", (_wheel(TORCH[0]),), True)
    with pytest.raises(BundleError, match=r"^torch 2\.9\.0 has no wheel for CPython 3\.12 on "
                       r"x86_64-manylinux_2_31 \(the index has only torch-2\.9\.0-cp312-cp312-"
                       r"manylinux_2_28_aarch64\.whl\): a node installs wheels"):
        wheelsets.choose([locked], Target())


def test_a_resolution_reads_as_packages_and_their_requirements_as_pinned_lines():
    lock = ('lock-version = "1.0"\n[[packages]]\nname = "Tiny_B"\nversion = "0.2.0+cu129"\n'
            'marker = "sys_platform == \'linux\'"\nwheels = [{ url = "https://x.example/a/'
            'tiny_b-0.2.0%2Bcu129-py3-none-any.whl", size = 10, hashes = { sha256 = "'
            + "a" * 64 + '" } }]\n[[packages]]\nname = "aaa"\nversion = "1"\nsdist = { url = '
            '"https://x.example/aaa-1.tar.gz", hashes = { sha256 = "' + "b" * 64 + '" } }\n')
    packages = wheelsets.read_pylock(lock)
    assert packages == [
        Locked("Tiny_B", "0.2.0+cu129", (Wheel(
            "tiny_b-0.2.0+cu129-py3-none-any.whl",
            "https://x.example/a/tiny_b-0.2.0%2Bcu129-py3-none-any.whl", "a" * 64, 10),), False),
        Locked("aaa", "1", (), True)]
    chosen = [Chosen("zz", "1", _wheel("zz-1-py3-none-any.whl")),
              *wheelsets.choose(packages[:1], Target())]
    text = wheelsets.requirements_text(chosen)
    assert text == (f"Tiny_B==0.2.0+cu129 \\\n    --hash=sha256:{'a' * 64}\n"
                    f"zz==1 \\\n    --hash=sha256:{'0' * 64}\n")
    assert check_requirements(text) == ["Tiny_B==0.2.0+cu129", "zz==1"]
    with pytest.raises(BundleError, match=r"the index serves other-1-py3-none-any\.whl, a "
                       "wheel of another package"):
        wheelsets.read_pylock(lock.replace("tiny_b-0.2.0%2Bcu129", "other-1"))


@pytest.mark.parametrize("changes, said", [
    ({"python": "3"}, "--python '3': write a CPython version, 3.MINOR"),
    ({"platform": "x86_64-unknown-linux-gnu"}, "--python-platform 'x86_64-unknown-linux-gnu': "
     "write ARCH-manylinux_2_NN"),
    ({"platform": "x86_64-manylinux_2_12"}, "2_17 or later"),
    ({"platform": "riscv64-manylinux_2_28"}, "ARCH one of x86_64, aarch64"),
    ({"index_url": "pypi.org/simple"}, "--index-url 'pypi.org/simple': write the http(s) URL"),
    ({"extra_index_urls": ("file:///srv",)}, "--extra-index-url 'file:///srv'"),
    ({"exclude_newer": "last week"}, "--exclude-newer 'last week': write a date"),
])
def test_a_target_that_is_not_a_linux_cpython_from_an_index_is_refused(changes, said):
    with pytest.raises(BundleError, match=re.escape(said)):
        Target(**changes)


def test_versions_are_read_and_an_engine_without_a_default_needs_one():
    assert create.parse_engine("vllm@0.11.0", ("x86_64",), ()).version == "0.11.0"
    assert create.parse_engine("comfyui@0.3.0", ("x86_64",), ()).version == "0.3.0"
    for name in ("sglang", "comfyui"):
        with pytest.raises(BundleError, match=f"{name} has no default version; write "
                                              f"{name}@VERSION"):
            create.parse_engine(name, ("x86_64",), ())


def test_llmgw_lock_refusals_name_what_is_wrong_and_leave_nothing(key, tmp_path, wheels):
    checkout = Path(__file__).resolve().parents[2]

    def refused(*args: str) -> str:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            code = llmgw(["bundle", "create", str(tmp_path / "out"), "--key", str(key[0]),
                          "--llmgw-version", "0.9.0", *args])
        assert code == 2 and not (tmp_path / "out").exists()
        return err.getvalue()

    assert "no uv.lock there; give llmgw's source checkout" in refused(
        "--llmgw-lock", str(tmp_path))
    said = refused("--llmgw-lock", str(checkout), "--llmgw-wheel", str(wheels["vllm"]))
    assert f"--llmgw-wheel {wheels['vllm']} is not a wheel of llmgw 0.9.0" in said
    assert "a bundle carries llmgw one way" in refused(
        "--llmgw-lock", str(checkout), "--wheels", str(tmp_path))
