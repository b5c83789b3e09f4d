"""uv environments from a local index: two tiny real wheels built by ``uv build``, served
PyPI-shaped from 127.0.0.1 by an aiohttp server the test starts (tests/pyindex.py). uv
reads no configuration, uses only this index and keeps its cache in the test's directory,
so nothing here leaves the machine."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.agent.install.archives import MARKER
from llmgw.agent.install.pyenv import (
    RESOLVED,
    build_environment,
    check_requirements,
    installed_environment,
)
from llmgw.agent.install.pypi import InstallError
from tests.pyindex import Index, build_wheel

ROOT = Path(__file__).resolve().parents[2]
A_DAY_LATER = "2025-03-02T12:00:00Z"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("wheels")
    return {
        "tiny-a": build_wheel(work, "tiny-a", "0.1.0",
                              "import tiny_b\n\ndef main():\n    print('a', tiny_b.VALUE)\n",
                              deps=["tiny-b==0.2.0"]),
        "tiny-b": build_wheel(work, "tiny-b", "0.2.0", "VALUE = 42\n\ndef main(): pass\n"),
        # The same name and version with other bytes: what a tampered index would serve.
        "tiny-b-evil": build_wheel(work, "tiny-b", "0.2.0",
                                   "VALUE = 666\n\ndef main(): pass\n"),
    }


def requirements(wheels: dict[str, Path]) -> str:
    """What ``uv pip compile --generate-hashes`` writes for tiny-a."""
    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()
    return ("# pinned for the test\n"
            f"tiny-a==0.1.0 \\\n    --hash=sha256:{digest(wheels['tiny-a'])}\n"
            f"tiny-b==0.2.0 \\\n    --hash=sha256:{digest(wheels['tiny-b'])}\n"
            "    # via tiny-a\n")


@pytest.fixture
async def index(wheels):
    async with Index({"tiny-a": wheels["tiny-a"], "tiny-b": wheels["tiny-b"]}) as served:
        yield served


async def build(root: Path, index: Index, text: str, *, status=None, name="tiny",
                version="0.1.0", import_check="import tiny_a; assert tiny_a.tiny_b.VALUE == 42",
                exclude_newer: str | None = A_DAY_LATER, min_free_bytes=0) -> Path:
    return await asyncio.wait_for(build_environment(
        root=root, name=name, version=version, requirements=text, index_url=index.url,
        python=sys.executable, exclude_newer=exclude_newer, import_check=import_check,
        status=status if status is not None else (lambda _: None),
        min_free_bytes=min_free_bytes, cache_dir=root.parent / "uv-cache"), 60)


def left_in(root: Path) -> list[str]:
    return sorted(os.listdir(root)) if root.exists() else []


async def test_an_environment_is_built_with_hashes_checked_and_renamed_into_place(
        tmp_path, index, wheels):
    root, status = tmp_path / "engines", []
    path = await build(root, index, requirements(wheels), status=status.append)
    assert path == root / "tiny" / "0.1.0" == installed_environment(root, "tiny", "0.1.0")
    assert status == [f"creating a Python {sys.executable} environment for tiny 0.1.0",
                      "installing 2 packages for tiny 0.1.0",
                      "checking that tiny 0.1.0 imports", "installed tiny 0.1.0"]
    assert (path / RESOLVED).read_text() == "tiny-a==0.1.0\ntiny-b==0.2.0\n"
    marker = json.loads((path / MARKER).read_text())
    assert (marker["index_url"], marker["exclude_newer"], marker["packages"]) == \
        (index.url, A_DAY_LATER, 2)
    # Renamed after it was built, and still runs: the console script finds its Python.
    script = await asyncio.create_subprocess_exec(
        str(path / "bin" / "tiny-a"), stdout=asyncio.subprocess.PIPE)
    try:
        out, _ = await asyncio.wait_for(script.communicate(), 30)
    finally:
        if script.returncode is None:
            script.kill()
            await script.wait()
    assert (script.returncode, out) == (0, b"a 42\n")
    assert left_in(root) == ["tiny"]
    # Built once: asking again touches neither uv nor the index.
    seen = len(index.requests)
    assert await build(root, index, requirements(wheels)) == path
    assert len(index.requests) == seen


async def test_a_tampered_wheel_is_refused_and_nothing_is_left(tmp_path, index, wheels):
    text = requirements(wheels)  # the hashes are taken, then the index serves other bytes
    index.serve_instead(wheels["tiny-b"].name, wheels["tiny-b-evil"])
    evil = hashlib.sha256(wheels["tiny-b-evil"].read_bytes()).hexdigest()
    good = hashlib.sha256(wheels["tiny-b"].read_bytes()).hexdigest()
    with pytest.raises(InstallError) as err:
        await build(tmp_path / "engines", index, text)
    assert str(err.value) == (
        f"tiny-b==0.2.0: the file the index served has sha256:{evil}, not sha256:{good} as "
        "the requirements pin; it was changed after the hashes were taken (on the index or "
        "on the way), and nothing was installed")
    assert left_in(tmp_path / "engines") == []
    assert installed_environment(tmp_path / "engines", "tiny", "0.1.0") is None


async def test_packages_published_after_the_cutoff_are_not_taken(tmp_path, index, wheels):
    with pytest.raises(InstallError) as err:
        await build(tmp_path / "engines", index, requirements(wheels),
                    exclude_newer="2025-02-01T00:00:00Z")
    assert str(err.value).startswith("installing tiny 0.1.0's packages failed (exit 1): "
                                     "error: No solution found")
    assert "exclude-newer" in str(err.value)
    assert left_in(tmp_path / "engines") == []


async def test_an_environment_that_does_not_import_is_not_put_in_place(tmp_path, index, wheels):
    with pytest.raises(InstallError) as err:
        await build(tmp_path / "engines", index, requirements(wheels),
                    import_check="import tiny_c")
    assert str(err.value).startswith("tiny 0.1.0 was installed but does not import (exit 1): ")
    assert str(err.value).endswith("ModuleNotFoundError: No module named 'tiny_c'")
    assert left_in(tmp_path / "engines") == []


HASH = "--hash=sha256:" + "0" * 64


@pytest.mark.parametrize("line, why", [
    (f"tiny-a @ https://example.org/tiny_a-0.1.0-py3-none-any.whl {HASH}",
     "names a URL; only packages from the index are taken"),
    (f"git+https://example.org/tiny-a.git@v0.1.0#egg=tiny-a {HASH}",
     "names a URL; only packages from the index are taken"),
    ("-e ./src/tiny-a", "is an editable install; only packages from the index are taken"),
    ("--extra-index-url http://127.0.0.1:1/simple",
     "names an index or a place to find packages; the index is llmgw's to choose"),
    ("--index-url=http://127.0.0.1:1/simple",
     "names an index or a place to find packages; the index is llmgw's to choose"),
    ("-r more.txt", "includes another file; give every package in this text"),
    (f"./tiny_a-0.1.0-py3-none-any.whl {HASH}",
     "is a path; only packages from the index are taken"),
    (f"tiny-a>=0.1 {HASH}", "is not pinned to one version with =="),
    ("tiny-a==0.1.0", "has no --hash=sha256:…; every package needs the sha256 of its files"),
    ("tiny-a==0.1.0 --hash=md5:0123", "has a --hash that is not sha256:<64 hex digits>"),
    (f"tiny-a==0.1.0 --no-binary tiny-a {HASH}",
     "has the option --no-binary; only --hash is taken after a package"),
])
async def test_anything_but_a_pinned_hashed_package_is_refused_before_uv_runs(
        tmp_path, index, wheels, line, why):
    text = requirements(wheels) + line + "\n"
    with pytest.raises(InstallError) as err:
        await build(tmp_path / "engines", index, text)
    assert str(err.value) == f"requirements line 7 ({line}) {why}"
    assert index.requests == [] and not (tmp_path / "engines").exists()


def test_a_compiled_requirements_text_reads_as_its_packages():
    text = ("tiny-a[extra]==0.1.0 ; python_version >= '3.8' \\\n"
            f"    {HASH} \\\n    {HASH}\n    # via -r in.txt\n\nTiny_B==0.2.0+cu129 {HASH}\n")
    assert check_requirements(text) == ["tiny-a==0.1.0", "Tiny_B==0.2.0+cu129"]
    with pytest.raises(InstallError, match=r"^the requirements name no packages$"):
        check_requirements("# nothing\n")


@pytest.mark.parametrize("name, version", [("tiny", "../x"), ("..", "0.1.0"),
                                           ("tiny", ".hidden"), ("a/b", "1")])
async def test_a_name_or_version_that_is_not_one_path_element_is_refused_first(
        tmp_path, index, wheels, name, version):
    with pytest.raises(InstallError, match="is not allowed: use 1-64 letters"):
        await build(tmp_path / "engines", index, requirements(wheels), name=name,
                    version=version)
    with pytest.raises(InstallError, match="is not allowed"):
        installed_environment(tmp_path / "engines", name, version)
    assert index.requests == [] and not (tmp_path / "engines").exists()


# --- too little disk, on a real 2 MiB filesystem -----------------------------------------

CHILD = """
import asyncio, sys
from pathlib import Path
from llmgw.agent.install.pyenv import build_environment
from llmgw.agent.install.pypi import InstallError
from tests.pyindex import Index, build_wheel

try:
    asyncio.run(build_environment(
        root=Path(sys.argv[1]), name="vllm", version="0.30.0",
        requirements="vllm==0.30.0 --hash=sha256:" + "0" * 64 + "\\n",
        index_url="http://127.0.0.1:9/simple", python=sys.executable, exclude_newer=None,
        import_check="import vllm", status=print, min_free_bytes=25 * 10**9))
except InstallError as err:
    print("refused:", err)
"""


def test_too_little_disk_is_refused_with_the_numbers(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a 2 MiB tmpfs in a private mount namespace needs root")
    engines = tmp_path / "engines"
    engines.mkdir()
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=2m,mode=0755 llmgw-test "$1" && exec "$2" -c "$3" "$1" && '
         'ls -A "$1"', "sh", str(engines), sys.executable, CHILD],
        capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"refused: vllm needs 25.0 GB free in {engines}; 2.1 MB is\n"
